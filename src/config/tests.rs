//! Tests of the settings: the shipped defaults, each rule's errors, the layering and redaction.
//! Test code only (`#![cfg(test)]`): its unwraps and expects never run in the service.
#![cfg(test)]

use super::sources::is_kubernetes_service_link;
use super::*;

/// The settings with `pairs` as overrides set by code (not given on a command line, so an error
/// names no flag: the rule's own words).
fn with(pairs: &[(&str, &str)]) -> Result<Settings, ConfigError> {
    let sources = Sources {
        use_env: false,
        overrides: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Sources::default()
    };
    Settings::load(&sources)
}

/// The users pipeline as `s` resolves it.
fn users(s: &Settings) -> &pipelines::PipelineSpec {
    s.pipeline("users").expect("the built-in users pipeline")
}

#[test]
fn kubernetes_service_links_are_told_from_misspelled_settings() {
    for (name, value) in [
        ("WARREN_SERVICE_HOST", "10.96.0.12"),
        ("WARREN_SERVICE_PORT", "9898"),
        ("WARREN_SERVICE_PORT_METRICS", "9898"),
        ("WARREN_PORT", "tcp://10.96.0.12:9898"),
        ("WARREN_PORT_9898_TCP", "tcp://10.96.0.12:9898"),
        ("WARREN_PORT_9898_TCP_PROTO", "tcp"),
        ("WARREN_PORT_9898_TCP_PORT", "9898"),
        ("WARREN_PORT_9898_TCP_ADDR", "10.96.0.12"),
        ("WARREN_API_PORT_8080_UDP_ADDR", "10.96.0.13"),
        ("WARREN_API_PORT", "udp://10.96.0.13:8080"),
    ] {
        assert!(is_kubernetes_service_link(name, value), "{name}={value}");
    }
    for (name, value) in [
        ("WARREN_METRICS_PORT", "9898"),
        ("WARREN_PORT", "9898"),
        ("WARREN_PORT_X_TCP", "1"),
        ("WARREN_PORT_9898_HTTP", "1"),
        ("WARREN_9898_TCP_ADDR", "1"),
        ("WARREN_USER_BATCH_SIZE", "10"),
    ] {
        assert!(!is_kubernetes_service_link(name, value), "{name}={value}");
    }
}

#[test]
fn balancing_settings_that_cannot_work_are_refused_naming_the_setting() {
    let refused = |pairs: &[(&str, &str)], setting: &str| match with(pairs) {
        Err(ConfigError::Invalid { setting: s, .. }) => assert_eq!(s, setting, "{pairs:?}"),
        other => panic!("{pairs:?}: {other:?}"),
    };
    refused(
        &[
            ("users_min_concurrency", "5"),
            ("users_max_concurrency", "4"),
        ],
        "USERS_MIN_CONCURRENCY",
    );
    refused(
        &[
            ("users_balance", "auto"),
            ("users_scale_up_threshold", "100"),
        ],
        "SCALE_DOWN_THRESHOLD (pipeline users)",
    );
    refused(
        &[("min_concurrency", "5"), ("max_concurrency", "4")],
        "MIN_CONCURRENCY (pipeline users)",
    );
    // The users pipeline's own minimum wins over the default one (the only pipeline here).
    assert!(with(&[("min_concurrency", "9"), ("users_min_concurrency", "3")]).is_ok());
    refused(&[("max_inserts_in_flight", "1")], "MAX_INSERTS_IN_FLIGHT");
    // simple ignores auto's thresholds; a budget of what is held is enough.
    assert!(
        with(&[
            ("users_balance", "simple"),
            ("users_scale_up_threshold", "100")
        ])
        .is_ok()
    );
    let s = with(&[("max_inserts_in_flight", "2")]).unwrap();
    assert_eq!(s.inserts_budget(), 2);
    let s = with(&[("batch_concurrency", "12"), ("database_pool_size", "4")]).unwrap();
    assert_eq!(
        s.inserts_budget(),
        12,
        "0: the pool size, or what is held if more"
    );
}

#[test]
fn shipped_defaults_parse_and_match_the_documented_values() {
    let s = Settings::defaults();
    assert_eq!(s.retry_ttl_ms, 10_000);
    assert_eq!(s.max_retries, 3);
    assert_eq!(s.batch_size, 1000);
    assert_eq!(s.batch_timeout_ms, 1000);
    assert_eq!(s.proc_concurrency, 1);
    assert_eq!(s.batch_concurrency, 2);
    // The users pipeline's own settings are unset: the defaults apply to it.
    assert_eq!(s.users_batch_size, None);
    assert_eq!(s.users_balance, None);
    assert_eq!(users(&s).batching.size, 1000);
    assert_eq!(s.amqp_url, "amqp://guest:guest@127.0.0.1:5672/%2f");
    assert_eq!(
        s.database_url,
        "postgres://warren:warren@127.0.0.1:5432/warren"
    );
    assert_eq!(s.redis_url, "redis://127.0.0.1:6379");
    assert_eq!(s.http_addr, "127.0.0.1:8080");
    assert_eq!(s.metrics_addr, "127.0.0.1:9898");
    assert_eq!(s.shutdown_timeout_ms, 20_000);
    assert_eq!(users(&s).prefetch, 4000);
    // Without a file, the built-in users pipeline is the one pipeline.
    assert_eq!(s.pipelines().len(), 1);
    assert!(users(&s).builtin);
}

#[test]
fn every_rule_has_a_key_in_the_shipped_file_and_back() {
    let table: toml::Table = default_settings_toml().parse().unwrap();
    for (key, _) in RULES {
        assert!(table.contains_key(*key), "{key} missing from default.toml");
    }
    assert_eq!(table.len(), RULES.len());
    // Beyond the settings, the file declares the users pipeline, and nothing else.
    let whole: toml::Table = DEFAULT_TOML.parse().unwrap();
    assert_eq!(whole.len(), RULES.len() + 1);
    assert!(whole["pipelines"].is_array());
}

#[test]
fn a_non_integer_names_setting_range_and_value() {
    let err = with(&[("users_batch_size", "abc")]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "USERS_BATCH_SIZE: expected an integer from 1 to 10000, got \"abc\""
    );
}

#[test]
fn out_of_range_and_negative_are_refused() {
    let err = with(&[("users_batch_size", "0")]).unwrap_err();
    assert!(err.to_string().contains("got 0"), "{err}");
    let err = with(&[("max_retries", "-1")]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("MAX_RETRIES: expected an integer from 0 to 100"),
        "{err}"
    );
}

#[test]
fn urls_addresses_and_roles_are_checked() {
    let err = with(&[("amqp_url", "http://x")]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("AMQP_URL: expected a URL starting with amqp://"),
        "{err}"
    );
    let err = with(&[("http_addr", "localhost")]).unwrap_err();
    assert!(err.to_string().starts_with("HTTP_ADDR:"), "{err}");
    let err = with(&[("roles", "consumer,web")]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("ROLES: expected a comma-separated subset"),
        "{err}"
    );
    assert!(
        with(&[("roles", "consumer, api")])
            .unwrap()
            .has_role(Role::Api)
    );
}

#[test]
fn roles_and_log_format_are_closed_sets() {
    let s = with(&[("roles", " api ,consumer,api"), ("log_format", "json")]).unwrap();
    assert_eq!(s.roles.to_string(), "api,consumer");
    assert!(s.has_role(Role::Consumer) && !s.has_role(Role::Dlq));
    assert_eq!(s.log_format, LogFormat::Json);
    for bad in ["", "consumer,", "Consumer"] {
        let err = with(&[("roles", bad)]).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "ROLES: expected a comma-separated subset of consumer,dlq,api, got {:?}",
                bad
            ),
        );
    }
    let err = with(&[("log_format", "yaml")]).unwrap_err().to_string();
    assert!(
        err.starts_with("LOG_FORMAT: expected one of text, json"),
        "{err}"
    );
    assert_eq!(Settings::defaults().roles.to_string(), "consumer,dlq,api");
}

#[test]
fn consumer_timeout_gives_deliveries_back_at_80_percent() {
    assert_eq!(hand_back_after(0), None);
    assert_eq!(
        hand_back_after(1_800_000),
        Some(Duration::from_secs(24 * 60))
    );
    assert_eq!(hand_back_after(5000), Some(Duration::from_secs(4)));
    let s = with(&[]).unwrap();
    assert_eq!(s.hand_back_after(), Some(Duration::from_secs(24 * 60)));
    let e = with(&[("amqp_consumer_timeout_ms", "500")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("AMQP_CONSUMER_TIMEOUT_MS"), "{e}");
    assert!(e.contains("at least 1000 ms"), "{e}");
    assert!(with(&[("amqp_consumer_timeout_ms", "0")]).is_ok());
    // A window of 4000 deliveries at 1 per second waits 4000 s, past 80% of 30 minutes.
    let e = with(&[("rate_limit_per_s", "1")]).unwrap_err().to_string();
    assert!(e.contains("RATE_LIMIT_PER_S"), "{e}");
    assert!(e.contains("4000 deliveries"), "{e}");
    assert!(with(&[("rate_limit_per_s", "1"), ("prefetch", "100")]).is_ok());
    assert!(with(&[("rate_limit_per_s", "1"), ("amqp_consumer_timeout_ms", "0")]).is_ok());
    // The same rule for a live rate (`warren ctl rate`): 3 per second passes the window in
    // 1333 s, within 1440 s; 2 per second does not; 0 is no limit.
    let give_back = Some(Duration::from_secs(24 * 60));
    let users = users(&s);
    assert_eq!(users.window_outlasts(2, s.hand_back_after()), give_back);
    assert_eq!(users.window_outlasts(3, s.hand_back_after()), None);
    assert_eq!(users.window_outlasts(0, s.hand_back_after()), None);
}

#[test]
fn overrides_win_and_prefetch_is_derived_or_capped() {
    let prefetch = |pairs: &[(&str, &str)]| users(&with(pairs).unwrap()).prefetch;
    assert_eq!(
        prefetch(&[("batch_size", "100"), ("batch_concurrency", "3")]),
        600
    );
    // The users pipeline's own win over the defaults.
    assert_eq!(
        prefetch(&[("batch_size", "100"), ("users_batch_concurrency", "3")]),
        600
    );
    assert_eq!(
        prefetch(&[
            ("batch_size", "10000"),
            ("batch_concurrency", "64"),
            ("max_inflight_bytes", "17179869184"),
        ]),
        65535
    );
    assert_eq!(prefetch(&[("prefetch", "50")]), 50);
    // The byte budget holds 4096 bodies of the largest accepted size by default: the window
    // never exceeds it.
    let s = with(&[("batch_concurrency", "8")]).unwrap();
    assert_eq!(users(&s).window_cap, 4096);
    assert_eq!(users(&s).prefetch, 4096);
    assert_eq!(
        prefetch(&[
            ("max_message_bytes", "16777216"),
            ("max_inflight_bytes", "33554432"),
        ]),
        2
    );
    // Balanced, the main stage starts at its minimum's window, capped by PREFETCH.
    let s = with(&[("balance", "simple"), ("min_concurrency", "1")]).unwrap();
    assert_eq!(users(&s).start_prefetch, 2000);
    assert_eq!(users(&s).prefetch, 4000);
    let s = with(&[("users_balance", "simple"), ("prefetch", "100")]).unwrap();
    assert_eq!(users(&s).start_prefetch, 100);
}

#[test]
fn unknown_set_flags_and_file_keys_are_named() {
    let err = Sources::default()
        .with_set_flags(&["nope=1".into()])
        .unwrap_err();
    assert!(err.to_string().contains("`nope`"), "{err}");
    let err = Sources::default()
        .with_set_flags(&["nope".into()])
        .unwrap_err();
    assert!(err.to_string().contains("KEY=VALUE"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.toml");
    std::fs::write(&path, "users_batch_size = 10\nbogus = 1\n").unwrap();
    let err = Settings::load(&Sources {
        file: Some(path),
        use_env: false,
        ..Sources::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("`bogus`"), "{err}");
}

#[test]
fn a_config_file_layers_over_the_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.toml");
    std::fs::write(&path, "users_batch_size = 10\n").unwrap();
    let s = Settings::load(&Sources {
        file: Some(path),
        use_env: false,
        ..Sources::default()
    })
    .unwrap();
    assert_eq!(s.users_batch_size, Some(10));
    assert_eq!(users(&s).batching.size, 10);
    assert_eq!(s.max_retries, 3);
}

#[test]
fn urls_are_checked_by_the_amqp_parser_and_redacted_in_errors() {
    // A query number that is not one names its parameter (review R40a F7).
    let err = with(&[("amqp_url", "amqp://u:s3cret@h:5672/%2f?heartbeat=10s")]).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("AMQP_URL: expected heartbeat as a whole number of its unit"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
    // What the client's own parser refuses is said in its words.
    let err = with(&[("amqp_url", "amqp://u:s3cret@h:5672/%2f?auth_mechanism=nope")]).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("AMQP_URL: expected an AMQP URL the client accepts"),
        "{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
    let err = with(&[("database_url", "http://u:s3cret@h/db")]).unwrap_err();
    assert!(!err.to_string().contains("s3cret"), "{err}");
}

#[test]
fn amqp_url_takes_a_list_and_names_the_bad_entry_without_its_password() {
    let list = "amqp://u:p1@h1:5681/%2f, amqp://u:p2@h2:5682/%2f,amqp://u:p3@h3:5683/%2f";
    let s = with(&[("amqp_url", list)]).unwrap();
    assert_eq!(
        s.amqp_urls(),
        [
            "amqp://u:p1@h1:5681/%2f",
            "amqp://u:p2@h2:5682/%2f",
            "amqp://u:p3@h3:5683/%2f"
        ]
    );
    assert!(!s.amqp_shuffle);

    let bad = "amqp://u:p1@h1:5681/%2f,http://u:s3cret@h2:5682/%2f,amqp://u:p3@h3/%2f";
    let text = with(&[("amqp_url", bad)]).unwrap_err().to_string();
    assert_eq!(
        text,
        "AMQP_URL (entry 2 of 3): expected a URL starting with amqp:// or amqps://, \
         got \"http://u:***@h2:5682/%2f\"",
    );
    let bad = "amqp://u:p1@h1:5681/%2f,amqp://u:s3cret@h2:5682/%2f?heartbeat=x";
    let text = with(&[("amqp_url", bad)]).unwrap_err().to_string();
    // The parameter is named (review R40a F7: "invalid digit found in string" alone).
    assert!(
        text.starts_with(
            "AMQP_URL (entry 2 of 2): expected heartbeat as a whole number of its unit \
             (?heartbeat=60), not \"x\""
        ),
        "{text}"
    );
    assert!(!text.contains("s3cret") && !text.contains("p1"), "{text}");
    // An empty entry (a trailing comma) is named too.
    let text = with(&[("amqp_url", "amqp://h1/%2f,")])
        .unwrap_err()
        .to_string();
    assert!(
        text.starts_with("AMQP_URL (entry 2 of 2): expected a URL"),
        "{text}"
    );
}

#[test]
fn amqp_shuffle_is_a_boolean() {
    assert!(with(&[("amqp_shuffle", "true")]).unwrap().amqp_shuffle);
    assert!(!with(&[("amqp_shuffle", "false")]).unwrap().amqp_shuffle);
    let text = with(&[("amqp_shuffle", "yes")]).unwrap_err().to_string();
    assert_eq!(text, "AMQP_SHUFFLE: expected true or false, got \"yes\"");
}

#[test]
fn database_url_takes_several_hosts_and_the_client_reads_them_all() {
    let url = "postgres://u:s3cret@127.0.0.1:1,127.0.0.1:5432/warren\
               ?target_session_attrs=read-write";
    let s = with(&[("database_url", url)]).unwrap();
    let config = s.database().pg_config().unwrap();
    assert_eq!(config.get_hosts().len(), 2);
    assert_eq!(config.get_ports(), [1, 5432]);
    assert_eq!(
        config.get_target_session_attrs(),
        tokio_postgres::config::TargetSessionAttrs::ReadWrite
    );
    assert_eq!(
        redact_url(url),
        "postgres://u:***@127.0.0.1:1,127.0.0.1:5432/warren?target_session_attrs=read-write"
    );
    assert!(
        !s.to_redacted_toml().contains("s3cret"),
        "{}",
        s.to_redacted_toml()
    );
    for bad in [
        "postgres://u:s3cret@h1:5432,h2:x/db",
        "postgres:///db",
        "mysql://u:s3cret@h/db",
    ] {
        let text = with(&[("database_url", bad)]).unwrap_err().to_string();
        assert!(
            text.starts_with("DATABASE_URL: expected a URL starting with postgres://"),
            "{text}"
        );
        assert!(!text.contains("s3cret"), "{text}");
    }
}

#[test]
fn redaction_covers_lists_multi_host_urls_and_what_no_parser_accepts() {
    let cases = [
        (
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "amqp://guest:***@127.0.0.1:5672/%2f",
        ),
        (
            "amqp://a:p1@h1:5681/%2f,amqp://h2:5682/%2f,amqps://c:p3@h3/v?heartbeat=5",
            "amqp://a:***@h1:5681/%2f,amqp://h2:5682/%2f,amqps://c:***@h3/v?heartbeat=5",
        ),
        ("redis://:s3cret@h:6379", "redis://:***@h:6379"),
        ("redis://h:6379", "redis://h:6379"),
        // a password with characters a URL parser refuses
        ("postgres://u:p,@w@h1,h2/db", "postgres://u:***@h1,h2/db"),
        ("postgres://u@h/db", "postgres://u@h/db"),
        ("not a url", "not a url"),
        // a password with the characters that end an authority (tokio-postgres accepts it)
        (
            "postgres://warren:Sup3r?Secret@h/db",
            "postgres://warren:***@h/db",
        ),
        ("postgres://u:a#b/c@h:5432/db", "postgres://u:***@h:5432/db"),
        ("amqp://u:p@ss@h/%2f", "amqp://u:***@h/%2f"),
        // secrets in query strings, in every entry of a list
        (
            "postgres://postgres@127.0.0.1:5432/db?password=s3cret",
            "postgres://postgres@127.0.0.1:5432/db?password=***",
        ),
        (
            "postgres://h/db?sslmode=require&SSLPassword=s3cret&application_name=w#frag",
            "postgres://h/db?sslmode=require&SSLPassword=***&application_name=w#frag",
        ),
        (
            "amqp://h1/%2f?auth_token=s3cret,amqps://u:s3cret@h2/v?heartbeat=5",
            "amqp://h1/%2f?auth_token=***,amqps://u:***@h2/v?heartbeat=5",
        ),
        (
            "amqp://h1/%2f?password=s3cret, amqp://h2/%2f",
            "amqp://h1/%2f?password=***, amqp://h2/%2f",
        ),
        // a PostgreSQL key/value string
        (
            "host=h user=u password=s3cret dbname=d",
            "host=h user=u password=*** dbname=d",
        ),
        (
            "host=h password = 'a \\' b' dbname=d",
            "host=h password = *** dbname=d",
        ),
        // an unquoted value with an escaped space is one value (review R38-F6), and what
        // sticks to a quoted one is hidden with it
        (
            "host=h password=my\\ sekret2 dbname=d",
            "host=h password=*** dbname=d",
        ),
        (
            "host=h password=a\\\\ sekret2 dbname=d",
            "host=h password=*** sekret2 dbname=d",
        ),
        (
            "host=h password='ab'sekretB dbname=d",
            "host=h password=*** dbname=d",
        ),
        ("host=h password=trailing\\", "host=h password=***"),
        // a parameter name as the client decodes it (review R39-F1)
        (
            "postgres://u@h:5432/db?%70assword=s3cret&sslmode=disable",
            "postgres://u@h:5432/db?%70assword=***&sslmode=disable",
        ),
        (
            "postgres://u@h/db?p%61ssw%6Frd=s3cret",
            "postgres://u@h/db?p%61ssw%6Frd=***",
        ),
        (
            "amqp://h/%2f?auth%5Ftoken=s3cret",
            "amqp://h/%2f?auth%5Ftoken=***",
        ),
    ];
    for (raw, shown) in cases {
        assert_eq!(redact_url(raw), shown, "{raw}");
    }
}

/// Every way to misplace the `://`, the `:` before the password or the `@` after it (one at a
/// time, and the `://` with the `@`), for each URL setting, alone, as the first and the second
/// entry of a list, with a query: neither the redacted form nor the error shows the password.
#[test]
fn a_url_of_the_wrong_shape_never_shows_its_password() {
    const PW: &str = "S3cretPw";
    let schemes = [":/", "//", ":", "/", "", ":///", "::/", "://"];
    let users = [":", "@", "/", "::", "//", ":/", ":@"];
    let ats = ["@", ":", "/", "", "@@", "//", ":/", "?", "#", "/@"];
    let mut shapes = vec![];
    for (scheme, host) in [
        ("amqp", "127.0.0.1:5672/%2f"),
        ("postgres", "127.0.0.1:5432/db"),
        ("redis", "127.0.0.1:6379"),
    ] {
        for a in schemes {
            for c in ats {
                shapes.push(format!("{scheme}{a}g:{PW}{c}{host}"));
            }
            shapes.push(format!("{scheme}{a}g:{PW}"));
        }
        for b in users {
            shapes.push(format!("{scheme}://g{b}{PW}@{host}"));
        }
    }
    // The review's own spellings.
    shapes.extend(
        [
            "guest:S3cretPw@127.0.0.1:5672",
            "amqp://guest:S3cretPw",
            "warren:S3cretPw@h/db",
            "postgres:/warren:S3cretPw@h/db",
            "postgres://warren:S3cretPw/db",
            ":S3cretPw@127.0.0.1:6379",
            "redis://u:S3cretPw",
        ]
        .map(String::from),
    );
    for shape in &shapes {
        for raw in [
            shape.clone(),
            format!("{shape}?heartbeat=5"),
            format!("amqp://u:p@h/%2f,{shape}"),
            format!("amqp://h/%2f,{shape}"),
            format!("{shape},amqp://h/%2f"),
        ] {
            let shown = redact_url(&raw);
            assert!(!shown.contains(PW), "{raw:?} is shown as {shown:?}");
            for key in ["amqp_url", "database_url", "redis_url"] {
                if let Err(e) = with(&[(key, raw.as_str())]) {
                    let text = e.to_string();
                    assert!(!text.contains(PW), "{key}={raw:?}: {text}");
                }
            }
        }
    }
}

/// A DLQ delivery limit that an outage can spend is refused; 0 (none declared) and the floor
/// are taken.
#[test]
fn a_dlq_delivery_limit_an_outage_can_spend_is_refused() {
    for bad in ["1", "20", "9999"] {
        let text = with(&[("dlq_delivery_limit", bad)])
            .unwrap_err()
            .to_string();
        assert!(
            text.starts_with(
                "DLQ_DELIVERY_LIMIT: expected 0 (none declared) or 10000 to 1000000000"
            ),
            "{text}"
        );
        assert!(text.ends_with(&format!("got {bad}")), "{text}");
    }
    for good in ["0", "10000", "1000000"] {
        let s = with(&[("dlq_delivery_limit", good)]).unwrap();
        assert_eq!(s.dlq_delivery_limit.to_string(), good);
    }
}

/// A `frame_max` outside what AMQP 0-9-1 and the broker allow, and a database URL warren
/// could never connect with, are refused at load, naming what is wrong.
#[test]
fn urls_warren_could_never_connect_with_are_refused() {
    for n in ["0", "1", "4095", "1048577"] {
        let url = format!("amqp://guest:s3cret@127.0.0.1:5672/%2f?frame_max={n}");
        let text = with(&[("amqp_url", &url)]).unwrap_err().to_string();
        assert!(
            text.starts_with(
                "AMQP_URL: expected frame_max from 4096 (the AMQP 0-9-1 minimum frame size) \
                 to 1048576"
            ),
            "{text}"
        );
        assert!(text.contains(&format!("not {n}")), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }
    for n in ["4096", "131072", "1048576"] {
        let url = format!("amqp://guest:guest@127.0.0.1:5672/%2f?frame_max={n}");
        with(&[("amqp_url", &url)]).unwrap();
    }
    let pg = "postgres://warren:s3cret@127.0.0.1:5432/warren";
    let text = with(&[("database_url", &format!("{pg}?sslmode=require"))])
        .unwrap_err()
        .to_string();
    assert!(text.contains("DATABASE_URL"), "{text}");
    assert!(
        text.contains("without sslmode=require (warren connects without TLS"),
        "{text}"
    );
    for (query, option) in [
        ("sslpassword=x", "sslpassword"),
        ("sslmode=verify-full", "sslmode"),
    ] {
        let text = with(&[("database_url", &format!("{pg}?{query}"))])
            .unwrap_err()
            .to_string();
        assert!(text.contains("DATABASE_URL"), "{text}");
        assert!(text.contains(&format!("option `{option}`")), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }
    for query in ["sslmode=disable", "sslmode=prefer"] {
        with(&[("database_url", &format!("{pg}?{query}"))]).unwrap();
    }
}

/// REDIS_PREFIX is a Redis key prefix: `amq.` is fine there, and its error cites Redis's rule,
/// not the broker's.
#[test]
fn redis_prefix_follows_redis_rules() {
    assert_eq!(
        with(&[("redis_prefix", "amq.x")]).unwrap().redis_prefix,
        "amq.x"
    );
    let text = with(&[("redis_prefix", "")]).unwrap_err().to_string();
    assert_eq!(
        text,
        "REDIS_PREFIX: expected a Redis key prefix of 1 to 255 characters without control \
         characters, got \"\""
    );
}

/// A password with an unencoded `#`, `?` or `/` is named as such (the character only), not as a
/// port (review R35e F11); a Redis URL its client refuses, or with a port out of range, is
/// refused at load for what it is, not taken for an outage at run time (review R35e F1).
#[test]
fn unencoded_passwords_and_redis_urls_the_client_refuses_are_named() {
    for (key, url, code) in [
        (
            "amqp_url",
            "amqp://guest:hun#ter2@127.0.0.1:5672/%2f",
            "%23",
        ),
        (
            "amqp_url",
            "amqp://guest:hun/ter2@127.0.0.1:5672/%2f",
            "%2F",
        ),
        (
            "amqp_url",
            "amqp://guest:hunter2?x@127.0.0.1:5672/%2f",
            "%3F",
        ),
        ("redis_url", "redis://:pa#ss@127.0.0.1:6379", "%23"),
    ] {
        let text = with(&[(key, url)]).unwrap_err().to_string();
        assert!(
            text.contains("the user and password percent-encoded") && text.contains(code),
            "{url}: {text}"
        );
        assert!(
            !text.contains("ter2") && !text.contains("pa#ss"),
            "{url}: {text}"
        );
    }
    let text = with(&[("redis_url", "redis://:pw@127.0.0.1:6379/abc")])
        .unwrap_err()
        .to_string();
    assert!(
        text.starts_with("REDIS_URL: expected a Redis URL the client accepts (")
            && !text.contains(":pw@"),
        "{text}"
    );
    let text = with(&[("redis_url", "redis://127.0.0.1:99999")])
        .unwrap_err()
        .to_string();
    assert!(
        text.starts_with("REDIS_URL: expected a port from 1 to 65535"),
        "{text}"
    );
    assert!(with(&[("redis_url", "redis://:p%23w@127.0.0.1:6379/2")]).is_ok());
}

/// An AMQP URL with the right scheme says what is wrong after it, not "starting with amqp://".
#[test]
fn an_amqp_url_with_a_bad_port_or_no_host_says_so() {
    for (url, expected) in [
        (
            "amqp://g:s3cret@127.0.0.1:99999/%2f",
            "AMQP_URL: expected a port from 1 to 65535",
        ),
        (
            "amqp://g:s3cret@:5672/%2f",
            "AMQP_URL: expected a host after amqp://",
        ),
        ("amqp:///%2f", "AMQP_URL: expected a host after amqp://"),
        (
            "http://h/%2f",
            "AMQP_URL: expected a URL starting with amqp://",
        ),
    ] {
        let text = with(&[("amqp_url", url)]).unwrap_err().to_string();
        assert!(text.starts_with(expected), "{url}: {text}");
        assert!(!text.contains("s3cret"), "{text}");
    }
}

#[test]
fn passwords_are_redacted() {
    let shown = Settings::defaults().to_redacted_toml();
    assert!(
        shown.contains("amqp://guest:***@127.0.0.1:5672/%2f"),
        "{shown}"
    );
    assert!(
        shown.contains("postgres://warren:***@127.0.0.1:5432/warren"),
        "{shown}"
    );
    assert!(!shown.contains(":guest@"));
}

#[test]
fn identical_queue_names_are_refused() {
    let err = with(&[("dlq_queue", "raffle_queue")]).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("DLQ_QUEUE: expected a queue name different from MAIN_QUEUE"),
        "{err}"
    );
}

#[test]
fn queue_type_is_classic_by_default_and_a_closed_set() {
    let s = Settings::defaults();
    assert_eq!(s.queue_type, QueueType::Classic);
    assert_eq!(s.delivery_limit, 20);
    assert_eq!(
        with(&[("queue_type", "quorum")]).unwrap().queue_type,
        QueueType::Quorum
    );
    let err = with(&[("queue_type", "stream")]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "QUEUE_TYPE: expected one of classic, quorum, got \"stream\""
    );
    let err = with(&[("delivery_limit", "0")]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "DELIVERY_LIMIT: expected an integer from 1 to 1000, got 0"
    );
}

#[test]
fn without_retry_tiers_the_retry_queue_is_the_one_tier() {
    let s = Settings::defaults();
    assert_eq!(s.retry_ttls_ms, RetryTtls::default());
    assert_eq!(
        s.retry_tiers(),
        [RetryTier {
            queue: "raffle_retry_10s".into(),
            ttl_ms: 10_000
        }]
    );
}

#[test]
fn retry_tiers_are_named_from_the_retry_queue_base() {
    let s = with(&[("retry_ttls_ms", "1000, 10000,60000")]).unwrap();
    let names: Vec<_> = s.retry_tiers().into_iter().map(|t| t.queue).collect();
    assert_eq!(
        names,
        ["raffle_retry_1s", "raffle_retry_10s", "raffle_retry_1m"]
    );
    assert_eq!(
        s.retry_tiers().iter().map(|t| t.ttl_ms).collect::<Vec<_>>(),
        [1000, 10_000, 60_000]
    );
    // A name without a TTL suffix is the base as it is.
    let s = with(&[("retry_queue", "q_retry"), ("retry_ttls_ms", "300,7200000")]).unwrap();
    let names: Vec<_> = s.retry_tiers().into_iter().map(|t| t.queue).collect();
    assert_eq!(names, ["q_retry_300ms", "q_retry_2h"]);
    // One number (as an environment variable holding one arrives) is one tier.
    let s = with(&[("retry_ttls_ms", "1500")]).unwrap();
    assert_eq!(s.retry_tiers()[0].queue, "raffle_retry_1500ms");
    // The settings survive the round trip through TOML (`warren config`, the topology).
    let s = with(&[("retry_ttls_ms", "1000,2000")]).unwrap();
    let shown = s.to_redacted_toml();
    assert!(shown.contains("retry_ttls_ms = \"1000,2000\""), "{shown}");
    assert!(shown.contains("queue_type = \"classic\""), "{shown}");
}

#[test]
fn humanized_ttls_and_bases() {
    assert_eq!(humanize_ms(999), "999ms");
    assert_eq!(humanize_ms(1000), "1s");
    assert_eq!(humanize_ms(90_000), "90s");
    assert_eq!(humanize_ms(60_000), "1m");
    assert_eq!(humanize_ms(5_400_000), "90m");
    assert_eq!(humanize_ms(86_400_000), "24h");
    assert_eq!(retry_base("raffle_retry_10s"), "raffle_retry");
    assert_eq!(retry_base("raffle_retry_300ms"), "raffle_retry");
    assert_eq!(retry_base("raffle_retry_1h"), "raffle_retry");
    assert_eq!(retry_base("raffle_retry"), "raffle_retry");
    assert_eq!(retry_base("retry_x10s"), "retry_x10s");
    assert_eq!(retry_base("_10s"), "_10s");
    assert_eq!(retry_base("q_10d"), "q_10d");
}

#[test]
fn bad_retry_tiers_name_the_setting() {
    for bad in [
        "1000,abc",
        "1000,1000",
        "10000,1000",
        "0",
        "1,86400001",
        "1,2,3,4,5,6,7,8,9,10,11",
        "-5",
    ] {
        let err = with(&[("retry_ttls_ms", bad)]).unwrap_err();
        assert!(
            err.to_string().starts_with(
                "RETRY_TTLS_MS: expected a comma-separated list of at most 10 increasing TTLs in ms"
            ),
            "{bad}: {err}"
        );
    }
    let err = with(&[
        ("main_queue", "raffle_retry_1s"),
        ("retry_ttls_ms", "1000,2000"),
    ])
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("RETRY_TTLS_MS: expected a queue name different from MAIN_QUEUE"),
        "{err}"
    );
}

#[test]
fn retry_tiers_from_a_file_may_be_a_toml_list() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.toml");
    std::fs::write(
        &path,
        "retry_ttls_ms = [500, 5000]\nqueue_type = \"quorum\"\n",
    )
    .unwrap();
    let s = Settings::load(&Sources {
        file: Some(path),
        use_env: false,
        ..Sources::default()
    })
    .unwrap();
    assert_eq!(s.retry_ttls_ms, RetryTtls(vec![500, 5000]));
    assert_eq!(s.queue_type, QueueType::Quorum);
}

/// Review R38-F15: the API and the metrics listener of one process on one address is refused at
/// load (exit 2, naming both), not at the start's bind as "another process"; without the API
/// role only the metrics listener runs, and the address is fine.
#[test]
fn the_api_and_the_metrics_listener_on_one_address_are_refused() {
    let same = [
        ("http_addr", "127.0.0.1:19101"),
        ("metrics_addr", "127.0.0.1:19101"),
    ];
    match with(&same) {
        Err(ConfigError::Invalid { setting, got, .. }) => {
            assert_eq!(setting, "HTTP_ADDR");
            assert!(got.contains("METRICS_ADDR"), "{got}");
        }
        other => panic!("{other:?}"),
    }
    // Equal once bound (review R40a F2): a name that resolves to the other, a wildcard.
    for (http, metrics) in [
        ("localhost:19101", "127.0.0.1:19101"),
        ("127.0.0.1:19101", "0.0.0.0:19101"),
    ] {
        match with(&[("http_addr", http), ("metrics_addr", metrics)]) {
            Err(ConfigError::Invalid { setting, got, .. }) => {
                assert_eq!(setting, "HTTP_ADDR");
                assert!(got.contains("METRICS_ADDR"), "{got}");
            }
            other => panic!("{http} {metrics}: {other:?}"),
        }
    }
    with(&[
        ("http_addr", "127.0.0.1:19101"),
        ("metrics_addr", "127.0.0.1:19102"),
    ])
    .expect("two ports");
    let mut consumer = same.to_vec();
    consumer.push(("roles", "consumer"));
    with(&consumer).expect("no API listener");
    with(&[
        ("http_addr", "127.0.0.1:0"),
        ("metrics_addr", "127.0.0.1:0"),
    ])
    .expect("port 0: each listener gets a free port of its own");
}

/// Review R44 F2: the value a refused number probably meant is offered only when the setting
/// takes it. `1e3` (a float) and `"1,000"` (separated) mean 1000, outside the 1 to 256 of a
/// concurrency: no "did you mean 1000?", the error names the setting, the value and the range;
/// a meant value inside the range is still offered.
#[test]
fn a_suggestion_is_a_value_the_setting_takes_or_none() {
    let from_file = |text: &str| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.toml");
        std::fs::write(&path, text).unwrap();
        Settings::load(&Sources {
            file: Some(path),
            use_env: false,
            ..Sources::default()
        })
        .unwrap_err()
        .to_string()
    };
    for (text, got) in [
        ("proc_concurrency = 1e3\n", "got 1000.0"),
        ("proc_concurrency = \"1,000\"\n", "got \"1,000\""),
        ("batch_concurrency = 100.0\n", "got 100.0"),
        (
            "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"id\"]\n\
             proc_concurrency = 1e3\n[pipelines.columns]\nid = { path = \"/id\", type = \"uuid\" }\n",
            "got 1000.0",
        ),
    ] {
        let err = from_file(text);
        assert!(
            err.contains("expected an integer from 1 to ") && err.contains(got),
            "{text}: {err}"
        );
        assert!(err.contains("concurrency"), "{text}: {err}");
        assert!(!err.contains("did you mean"), "{text}: {err}");
    }
    let err = from_file("proc_concurrency = \"1_00\"\n");
    assert!(err.contains("(did you mean 100?)"), "{err}");
}
