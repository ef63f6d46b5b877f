//! Tests of the `[[pipelines]]` configuration: loading, derived names, and the errors it names.
//! Test code only (`#![cfg(test)]`): its unwraps and expects never run in the service.
#![cfg(test)]

use std::io::Write;

use super::*;
use crate::config::Sources;

const ORDERS: &str = r#"
[[pipelines]]
name = "orders"
table = "shop.orders"
key = ["order_id"]
batch_size = 500

[pipelines.columns]
order_id = { path = "/id", type = "uuid" }
total = { path = "/total", type = "numeric", min = 0 }
"#;

/// The settings from a file holding `text` (no environment).
fn load(text: &str) -> Result<Settings, ConfigError> {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(text.as_bytes()).expect("write");
    let sources = Sources {
        file: Some(file.path().to_path_buf()),
        use_env: false,
        ..Sources::default()
    };
    Settings::load(&sources)
}

#[test]
fn a_files_pipeline_loads_with_derived_names_and_its_own_settings() {
    let s = load(ORDERS).expect("valid");
    assert_eq!(s.pipelines.len(), 1);
    let p = &s.pipelines[0];
    assert_eq!(p.batch_size, Some(500));
    let names = p.names(&s);
    assert_eq!(names.main_exchange, "orders_exchange");
    assert_eq!(names.main_queue, "orders_queue");
    assert_eq!(names.retry_exchange, "orders_retry_exchange");
    assert_eq!(names.retry_tiers[0].queue, "orders_retry_10s");
    assert_eq!(names.dlx_exchange, "orders_dlx");
    assert_eq!(names.dlq_queue, "orders_dlq");
    assert!(p.mapping().is_ok());
    // `warren config` shows it.
    assert!(
        s.to_redacted_toml().contains("[[pipelines]]"),
        "{}",
        s.to_redacted_toml()
    );
    // Tiers of its own.
    let tiers =
        load(&ORDERS.replace("batch_size = 500", "retry_ttls_ms = [1000, 60000]")).expect("valid");
    let queues: Vec<String> = tiers.pipelines[0]
        .names(&tiers)
        .retry_tiers
        .into_iter()
        .map(|t| t.queue)
        .collect();
    assert_eq!(queues, ["orders_retry_1s", "orders_retry_1m"]);
}

#[test]
fn every_mistake_in_a_pipeline_is_named() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "name = \"orders\"",
            "name = \"Orders\"",
            "pipelines[0].name: expected a name of a lower-case letter",
        ),
        (
            "batch_size = 500",
            "batch_size = 0",
            "pipelines.orders.batch_size: expected an integer from 1 to 10000, got 0",
        ),
        (
            "batch_size = 500",
            "retry_ttls_ms = [60000, 1000]",
            "pipelines.orders.retry_ttls_ms: expected a non-empty list of TTLs in ascending order",
        ),
        (
            "batch_size = 500",
            "colour = \"red\"",
            "line 6: unknown key `colour` in pipeline orders",
        ),
        (
            "type = \"numeric\"",
            "type = \"money\"",
            "line 10: pipelines.orders.columns.total.type: expected one of text, uuid,",
        ),
        (
            "path = \"/id\"",
            "path = \"id\"",
            "pipeline orders: columns.order_id:",
        ),
        (
            "key = [\"order_id\"]",
            "key = [\"nope\"]",
            "pipeline orders:",
        ),
        (
            "batch_size = 500",
            "on_conflict = \"update\"",
            "version_column",
        ),
        (
            "batch_size = 500",
            "dlq_queue = \"amq.orders\"",
            "pipelines.orders.dlq_queue: expected a name of 1 to 255 bytes",
        ),
        (
            "batch_size = 500",
            "main_queue = \"raffle_queue\"",
            "pipelines.orders.main_queue: expected a name no other pipeline uses for its exchanges and queues, got \"raffle_queue\", also the main_queue of pipeline users",
        ),
        (
            "key = [\"order_id\"]",
            "key = [\"order_id\", \"total\"]\napi = true",
            "pipelines.orders.api: expected false, or a one-column key (PUT and GET /api/v1/<name>/<key> address a row by it), got true with key [\"order_id\", \"total\"]",
        ),
    ];
    for (from, to, expected) in cases {
        assert!(ORDERS.contains(from), "{from}");
        let text = ORDERS.replacen(from, to, 1);
        let error = load(&text).expect_err(to).to_string();
        assert!(error.contains(expected), "{to}: {error}");
    }
    // Two pipelines of one name.
    let twice = format!("{ORDERS}{}", ORDERS.replace("shop.orders", "shop.orders2"));
    let error = load(&twice).unwrap_err().to_string();
    assert!(
        error.contains("pipelines[1].name: expected a name no other pipeline has, got \"orders\", as pipelines[0]"),
        "{error}"
    );
    // A pipeline named users replaces the built-in one, so it may take its names.
    let users = ORDERS
        .replace("name = \"orders\"", "name = \"users\"")
        .replace("batch_size = 500", "main_queue = \"raffle_queue\"");
    assert!(load(&users).is_ok());
    // Stages are labelled by pipeline and stage kind, not by name: any valid name is free.
    for name in ["main", "dlq", "router", "api", "orders_dlq"] {
        let named = ORDERS.replace("name = \"orders\"", &format!("name = \"{name}\""));
        assert!(load(&named).is_ok(), "{name}: {:?}", load(&named).err());
    }
}

#[test]
fn the_users_pipeline_is_declared_in_the_shipped_defaults_in_the_format_of_any_other() {
    let users = users().expect("config/default.toml declares users");
    assert_eq!(users.name, "users");
    assert_eq!(users.table, "users");
    assert_eq!(users.key, vec!["id".to_string()]);
    assert_eq!(
        users.columns.keys().collect::<Vec<_>>(),
        ["email", "id", "name"]
    );
    users.mapping().expect("it compiles");
    // The declaration is the built-in pipeline, not a default of the file's list: without a
    // file there are no configured pipelines, and a file's list does not lose users.
    assert!(Settings::defaults().pipelines.is_empty());
    let s = load(ORDERS).unwrap();
    assert_eq!(s.pipelines.len(), 1);
    assert_eq!(s.pipelines[0].name, "orders");
    // `warren config` shows both, users first.
    let shown: toml::Table = s.to_redacted_toml().parse().unwrap();
    let names: Vec<&str> = shown["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["users", "orders"]);
}
