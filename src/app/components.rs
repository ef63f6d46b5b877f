//! The one place (in the composition root) warren's settings become the components' own
//! configurations: the broker link's [`AmqpConfig`], the database layer's [`DbConfig`], the
//! registry's and remote control's [`RegistryConfig`] (with the [`RedisConfig`] the events writer
//! shares, in [`EventsConfig`]), the HTTP API's [`HttpConfig`], the metrics listener's
//! [`ListenerConfig`] and the shutdown's [`ShutdownConfig`]. Each component is given its own piece;
//! no layer below the root reads [`Settings`], and `config` imports none of them. Each
//! configuration's `validate()` holds what its component relies on, its errors named by the
//! setting.

use crate::amqp::AmqpConfig;
use crate::config::Settings;
use crate::db::DbConfig;
use crate::events::EventsConfig;
use crate::http::{HttpConfig, ListenerConfig};
use crate::pipeline::shutdown::ShutdownConfig;
use crate::registry::{RedisConfig, RegistryConfig};

impl Settings {
    /// The broker link's configuration: `AMQP_URL` (its nodes, in order), `AMQP_SHUFFLE`,
    /// `AMQP_HEARTBEAT_S`, `AMQP_CONNECT_TIMEOUT_MS`, `AMQP_CONSUMER_TIMEOUT_MS`,
    /// `PUBLISH_TIMEOUT_MS` and `PUBLISH_LATENCY_HEADER`.
    pub fn amqp(&self) -> AmqpConfig {
        AmqpConfig {
            urls: self.amqp_urls().into_iter().map(String::from).collect(),
            shuffle: self.amqp_shuffle,
            heartbeat_s: self.amqp_heartbeat_s,
            connect_timeout_ms: self.amqp_connect_timeout_ms,
            consumer_timeout_ms: self.amqp_consumer_timeout_ms,
            publish_timeout_ms: self.publish_timeout_ms,
            publish_latency_header: self.publish_latency_header,
        }
    }

    /// The database layer's configuration: `DATABASE_URL`, `DATABASE_SCHEMA`,
    /// `DATABASE_STATEMENT_TIMEOUT_MS`, and `DATABASE_POOL_SIZE` as the pool's size (the
    /// composition root raises it to what the pipelines hold).
    pub fn database(&self) -> DbConfig {
        DbConfig {
            url: self.database_url.clone(),
            schema: self.database_schema.clone(),
            statement_timeout_ms: self.database_statement_timeout_ms,
            pool_size: self.database_pool_size,
        }
    }

    /// The deployment's Redis: `REDIS_URL` and `REDIS_PREFIX`.
    pub fn redis(&self) -> RedisConfig {
        RedisConfig {
            url: self.redis_url.clone(),
            prefix: self.redis_prefix.clone(),
        }
    }

    /// The registry's and remote control's configuration: the deployment's Redis,
    /// `CONTROL_SECRET` and `REGISTRY_HEARTBEAT_MS`.
    pub fn registry(&self) -> RegistryConfig {
        RegistryConfig {
            redis: self.redis(),
            control_secret: self.control_secret.clone(),
            heartbeat_ms: self.registry_heartbeat_ms,
        }
    }

    /// The events writer's configuration: the deployment's Redis and `EVENTS_MAX_LEN`.
    pub fn events(&self) -> EventsConfig {
        EventsConfig {
            redis: self.redis(),
            max_len: self.events_max_len,
        }
    }

    /// The HTTP API's configuration: `HTTP_ADDR`, `API_POOL_SIZE`, `MAX_MESSAGE_BYTES` as the
    /// largest body it publishes, `MAX_INFLIGHT_BYTES` as what its writes hold between them.
    pub fn http(&self) -> HttpConfig {
        HttpConfig {
            addr: self.http_addr.clone(),
            pool_size: self.api_pool_size,
            max_message_bytes: self.max_message_bytes,
            max_inflight_bytes: self.max_inflight_bytes,
        }
    }

    /// The metrics listener's configuration: `METRICS_ADDR`.
    pub fn metrics_listener(&self) -> ListenerConfig {
        ListenerConfig {
            addr: self.metrics_addr.clone(),
        }
    }

    /// The shutdown's configuration: `SHUTDOWN_TIMEOUT_MS`.
    pub fn shutdown(&self) -> ShutdownConfig {
        ShutdownConfig {
            timeout_ms: self.shutdown_timeout_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Settings, Sources};

    /// Settings loaded from the shipped defaults and `set` (key, value) overrides.
    fn with(set: &[(&str, &str)]) -> Settings {
        let mut sources = Sources {
            use_env: false,
            ..Sources::default()
        };
        for (k, v) in set {
            sources = sources.with_override(k, v.to_string());
        }
        Settings::load(&sources).expect("valid settings")
    }

    /// The shipped defaults make a database configuration the database layer accepts, and
    /// each field comes from its own setting.
    #[test]
    fn the_defaults_make_a_valid_database_configuration() {
        let settings = crate::config::Settings::defaults();
        let db = settings.database();
        assert_eq!(db.validate(), Ok(()));
        assert_eq!(db.url, settings.database_url);
        assert_eq!(db.schema, settings.database_schema);
        assert_eq!(
            db.statement_timeout_ms,
            settings.database_statement_timeout_ms
        );
        assert_eq!(db.pool_size, settings.database_pool_size);
    }

    /// Every component's configuration made from the shipped defaults passes its own checks.
    #[test]
    fn the_defaults_make_every_component_s_configuration_valid() {
        let s = Settings::defaults();
        assert_eq!(s.amqp().validate(), Ok(()));
        assert_eq!(s.database().validate(), Ok(()));
        assert_eq!(s.registry().validate(), Ok(()));
        assert_eq!(s.events().validate(), Ok(()));
        assert_eq!(s.http().validate(), Ok(()));
        assert_eq!(s.metrics_listener().validate(), Ok(()));
        assert_eq!(s.shutdown().validate(), Ok(()));
    }

    /// Each field of the broker link's configuration comes from its own setting: values unlike
    /// the defaults and unlike each other, so a field read from the wrong setting shows.
    #[test]
    fn the_broker_link_takes_each_field_from_its_setting() {
        let s = with(&[
            (
                "amqp_url",
                "amqp://u:p@node-a:5601/%2f, amqps://u:p@node-b:5602/v",
            ),
            ("amqp_shuffle", "true"),
            ("amqp_heartbeat_s", "17"),
            ("amqp_connect_timeout_ms", "4321"),
            ("amqp_consumer_timeout_ms", "765432"),
            ("publish_timeout_ms", "6543"),
            ("publish_latency_header", "true"),
        ]);
        let amqp = s.amqp();
        assert_eq!(
            amqp.urls,
            ["amqp://u:p@node-a:5601/%2f", "amqps://u:p@node-b:5602/v"],
            "each node, trimmed, in order"
        );
        assert!(amqp.shuffle);
        assert_eq!(amqp.heartbeat_s, 17);
        assert_eq!(amqp.connect_timeout_ms, 4321);
        assert_eq!(amqp.consumer_timeout_ms, 765_432);
        assert_eq!(amqp.publish_timeout_ms, 6543);
        assert!(amqp.publish_latency_header);
        assert_eq!(amqp.validate(), Ok(()));
        let off = with(&[
            ("amqp_shuffle", "false"),
            ("publish_latency_header", "false"),
        ])
        .amqp();
        assert!(!off.shuffle && !off.publish_latency_header);
    }

    /// The registry's, the events writer's, the API's, the listener's and the shutdown's
    /// fields each come from their own setting.
    #[test]
    fn redis_registry_events_http_listener_and_shutdown_take_each_field_from_its_setting() {
        let s = with(&[
            ("redis_url", "redis://:pw@redis-host:6390/3"),
            ("redis_prefix", "deploy-7"),
            ("control_secret", "sekrit-42"),
            ("registry_heartbeat_ms", "1234"),
            ("events_max_len", "98765"),
            ("http_addr", "127.0.0.1:18080"),
            ("api_pool_size", "7"),
            ("max_message_bytes", "54321"),
            ("metrics_addr", "127.0.0.1:19090"),
            ("shutdown_timeout_ms", "23456"),
        ]);
        let registry = s.registry();
        assert_eq!(registry.redis.url, "redis://:pw@redis-host:6390/3");
        assert_eq!(registry.redis.prefix, "deploy-7");
        assert_eq!(registry.control_secret, "sekrit-42");
        assert_eq!(registry.heartbeat_ms, 1234);
        assert_eq!(registry.validate(), Ok(()));
        let events = s.events();
        assert_eq!(events.redis, registry.redis, "the same Redis");
        assert_eq!(events.max_len, 98_765);
        let http = s.http();
        assert_eq!(http.addr, "127.0.0.1:18080");
        assert_eq!(http.pool_size, 7);
        assert_eq!(http.max_message_bytes, 54_321);
        assert_eq!(http.validate(), Ok(()));
        assert_eq!(s.metrics_listener().addr, "127.0.0.1:19090");
        assert_eq!(s.shutdown().timeout_ms, 23_456);
    }
}
