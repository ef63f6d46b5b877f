//! The database layer's own settings ([`DbConfig`]: where the database is, the schema, the
//! statement timeout, the pipeline pool's size), their checks ([`DbConfig::validate`]) and the
//! client configuration made from them. Built from warren's settings above this layer
//! (`config::components`); nothing here reads those.

use std::fmt;
use std::time::Duration;

/// What the database layer needs to reach PostgreSQL and bound its statements.
#[derive(Clone, PartialEq, Eq)]
pub struct DbConfig {
    /// Where the server is, with the credentials: a `postgres://` URL naming one host or several
    /// (`DATABASE_URL`). Never shown: it may hold a password.
    pub url: String,
    /// The schema every session searches and the migrations create (`DATABASE_SCHEMA`); it is
    /// written into SQL text, so only a plain identifier is accepted.
    pub schema: String,
    /// The server's bound on one statement, in ms (`statement_timeout`); the client gives up a
    /// little later ([`DbConfig::call_bound`]).
    pub statement_timeout_ms: u64,
    /// The pipeline pool's connections ([`super::pool`]); the composition root sizes it to the
    /// inserts the pipelines can have in flight.
    pub pool_size: usize,
}

/// A [`DbConfig`] that cannot work, named by the setting it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DbConfigError {
    /// The URL does not parse as a PostgreSQL connection string.
    #[error("DATABASE_URL: {0}")]
    Url(String),
    /// The URL parses but names no host.
    #[error("DATABASE_URL: expected a URL naming a host (postgres://user:password@host:5432/db)")]
    NoHost,
    /// The schema is not a plain SQL identifier.
    #[error(
        "DATABASE_SCHEMA: expected an SQL identifier (lower-case letters, digits and _, at most \
         63, not starting with a digit), got {0:?}"
    )]
    Schema(String),
    /// A statement timeout of 0, which PostgreSQL reads as no bound at all.
    #[error("DATABASE_STATEMENT_TIMEOUT_MS: expected at least 1 (0 leaves statements unbounded)")]
    StatementTimeout,
    /// A pool of no connection.
    #[error("DATABASE_POOL_SIZE: expected at least 1 connection")]
    PoolSize,
    /// The pool could not be built from the configuration.
    #[error("DATABASE_URL: {0}")]
    Pool(String),
}

impl fmt::Debug for DbConfig {
    /// Everything but the URL, which may hold a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DbConfig")
            .field("url", &"(not shown)")
            .field("schema", &self.schema)
            .field("statement_timeout_ms", &self.statement_timeout_ms)
            .field("pool_size", &self.pool_size)
            .finish()
    }
}

impl DbConfig {
    /// The rules the database layer relies on: a URL the client parses and that names a host,
    /// a schema that is a plain identifier (it is written into SQL text), a statement timeout
    /// (0 would be none) and a pool of at least one connection.
    pub fn validate(&self) -> Result<(), DbConfigError> {
        self.parsed_url()?;
        let s = &self.schema;
        let ident = !s.is_empty()
            && s.len() <= 63
            && s.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !ident {
            return Err(DbConfigError::Schema(s.clone()));
        }
        if self.statement_timeout_ms == 0 {
            return Err(DbConfigError::StatementTimeout);
        }
        if self.pool_size == 0 {
            return Err(DbConfigError::PoolSize);
        }
        Ok(())
    }

    fn parsed_url(&self) -> Result<tokio_postgres::Config, DbConfigError> {
        let config: tokio_postgres::Config = self
            .url
            .parse()
            .map_err(|e: tokio_postgres::Error| DbConfigError::Url(e.to_string()))?;
        if config.get_hosts().is_empty() {
            return Err(DbConfigError::NoHost);
        }
        Ok(config)
    }

    /// The `tokio_postgres` configuration, once [`DbConfig::validate`] passed: the schema on the
    /// search path, the statement timeout, and the session in UTC (an instant written to a
    /// `timestamp` column is its UTC wall time, whatever the server's default zone).
    pub fn pg_config(&self) -> Result<tokio_postgres::Config, DbConfigError> {
        self.validate()?;
        let mut config = self.parsed_url()?;
        config.options(format!(
            "-c search_path={} -c statement_timeout={} -c TimeZone=UTC",
            self.schema, self.statement_timeout_ms
        ));
        config.application_name("warren");
        config.connect_timeout(Duration::from_secs(5));
        // A peer that vanished (a partition, a dead host) is noticed by the kernel within about
        // ten seconds instead of the default fifteen minutes of retransmissions.
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(5));
        config.keepalives_interval(Duration::from_secs(2));
        config.keepalives_retries(3);
        config.tcp_user_timeout(Duration::from_secs(10));
        Ok(config)
    }

    /// The client-side bound on one statement: the server's `statement_timeout` plus a margin
    /// for the round trip. A statement with no answer by then is abandoned with its connection.
    pub fn call_bound(&self) -> Duration {
        Duration::from_millis(self.statement_timeout_ms) + Duration::from_secs(2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> DbConfig {
        DbConfig {
            url: "postgres://u:s3cret@127.0.0.1:1,127.0.0.1:5432/warren\
                  ?target_session_attrs=read-write"
                .into(),
            schema: "warren".into(),
            statement_timeout_ms: 30_000,
            pool_size: 4,
        }
    }

    /// A multi-host URL reaches the client whole, with the schema and the timeouts in the
    /// session options; the client's bound is the server's plus its margin.
    #[test]
    fn the_client_configuration_carries_every_host_the_schema_and_the_timeout() {
        let config = good().pg_config().unwrap();
        assert_eq!(config.get_hosts().len(), 2);
        assert_eq!(config.get_ports(), [1, 5432]);
        assert_eq!(
            config.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
        assert_eq!(
            config.get_options(),
            Some("-c search_path=warren -c statement_timeout=30000 -c TimeZone=UTC")
        );
        assert_eq!(good().call_bound(), Duration::from_millis(32_000));
    }

    /// Each rule fails on its own, with the setting named; the password never shows.
    #[test]
    fn each_rule_names_its_setting_and_no_password_shows() {
        let with = |f: fn(&mut DbConfig)| {
            let mut c = good();
            f(&mut c);
            c.validate().map_err(|e| e.to_string())
        };
        assert_eq!(with(|_| {}), Ok(()));
        let schema = with(|c| c.schema = "public; DROP TABLE users".into()).unwrap_err();
        assert!(
            schema.starts_with("DATABASE_SCHEMA: expected an SQL identifier"),
            "{schema}"
        );
        for bad in ["", "1abc", "Warren", "a-b"] {
            let mut c = good();
            c.schema = bad.into();
            assert_eq!(c.validate(), Err(DbConfigError::Schema(bad.into())));
        }
        assert_eq!(
            with(|c| c.statement_timeout_ms = 0),
            Err(DbConfigError::StatementTimeout.to_string())
        );
        assert_eq!(
            with(|c| c.pool_size = 0),
            Err(DbConfigError::PoolSize.to_string())
        );
        assert_eq!(
            with(|c| c.url = "postgres:///db".into()),
            Err(DbConfigError::NoHost.to_string())
        );
        let url = with(|c| c.url = "postgres://u:s3cret@h:x/db".into()).unwrap_err();
        assert!(url.starts_with("DATABASE_URL: "), "{url}");
        assert!(!format!("{:?}", good()).contains("s3cret"));
        // The client configuration is made only from a configuration that passes.
        let mut c = good();
        c.schema = "a-b".into();
        assert!(c.pg_config().is_err());
    }
}
