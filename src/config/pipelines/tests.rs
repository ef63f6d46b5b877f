//! Tests of the `[[pipelines]]` configuration: loading, derived names, and the errors it names.
//! Test code only (`#![cfg(test)]`): its unwraps and expects never run in the service.
#![cfg(test)]

use std::io::Write;
use std::time::Duration;

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
    assert_eq!(names, s.pipeline("orders").unwrap().names);
    assert_eq!(s.pipeline("orders").unwrap().batching.size, 500);
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
            "pipelines.orders.retry_ttls_ms: expected a non-empty list of at most 10 increasing \
             TTLs (no two equal)",
        ),
        (
            "batch_size = 500",
            "retry_ttls_ms = [1000, 1000]",
            "pipelines.orders.retry_ttls_ms: expected a non-empty list of at most 10 increasing \
             TTLs (no two equal), each from 1 to 86400000 ms, got [1000, 1000]",
        ),
        (
            "batch_size = 500",
            "retry_ttls_ms = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]",
            "pipelines.orders.retry_ttls_ms: expected a non-empty list of at most 10 increasing",
        ),
        (
            "batch_size = 500",
            "colour = \"red\"",
            "line 6: unknown key `colour` in pipeline orders",
        ),
        // Review R46a F4: durations with units are offered the numbers meant.
        (
            "batch_size = 500",
            "retry_ttls_ms = \"1s,1.5m\"",
            "pipelines.orders.retry_ttls_ms: expected a list, got \"1s,1.5m\" (did you mean \
             [1000, 90000]?)",
        ),
        (
            "batch_size = 500",
            "retry_ttls_ms = [\"1s\", \"1m\"]",
            "pipelines.orders.retry_ttls_ms.0: expected a whole number, got \"1s\" (did you mean \
             1000?)",
        ),
        (
            "batch_size = 500",
            "batch_timeout_ms = \"1.5s\"",
            "pipelines.orders.batch_timeout_ms: expected an integer from 0 to 600000, got \
             \"1.5s\" (did you mean 1500?)",
        ),
        (
            "batch_size = 500",
            "batch_size = \"5.0\"",
            "pipelines.orders.batch_size: expected an integer from 1 to 10000, got \"5.0\" (did \
             you mean 5?)",
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
        // Within one entry the name written is blamed, at its line, not the one derived.
        (
            "batch_size = 500",
            "main_queue = \"orders_dlq\"",
            "line 6: pipelines.orders.main_queue: expected a name of its own, used by no other exchange or queue of a pipeline, got \"orders_dlq\", also its dlq_queue",
        ),
        (
            "batch_size = 500",
            "dlq_queue = \"orders_queue\"",
            "line 6: pipelines.orders.dlq_queue: expected a name of its own, used by no other exchange or queue of a pipeline, got \"orders_queue\", also its main_queue",
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
    // A users naming setting given the name an entry derives is blamed, where it was given
    // (review R35i F2), not the entry that writes no such key.
    let setting = format!("main_queue = \"orders_queue\"\n{ORDERS}");
    let error = load(&setting).unwrap_err().to_string();
    assert!(
        error.contains("line 1: main_queue: expected a name no other pipeline uses for its exchanges and queues, got \"orders_queue\", also the main_queue of pipeline orders"),
        "{error}"
    );
    // A pipeline whose derived name is the users setting's shipped one: the entry is blamed.
    let raffle = ORDERS.replace("name = \"orders\"", "name = \"raffle\"");
    let error = load(&raffle).unwrap_err().to_string();
    assert!(
        error.contains("pipelines.raffle.main_exchange: expected a name no other pipeline uses for its exchanges and queues, got \"raffle_exchange\", also the main_exchange of pipeline users"),
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

/// The settings from a file holding `text` and `pairs` as overrides set by code.
fn load_with(text: &str, pairs: &[(&str, &str)]) -> Result<Settings, ConfigError> {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(text.as_bytes()).expect("write");
    let mut sources = Sources {
        file: Some(file.path().to_path_buf()),
        use_env: false,
        ..Sources::default()
    };
    for (k, v) in pairs {
        sources = sources.with_override(k, *v);
    }
    Settings::load(&sources)
}

#[test]
fn users_batch_size_is_users_own_and_batch_size_every_pipelines_default() {
    let orders = ORDERS.replace("batch_size = 500\n", "");
    let size = |s: &Settings, name: &str| s.pipeline(name).expect(name).batching.size;
    let s = load_with(&orders, &[("users_batch_size", "7")]).expect("valid");
    assert_eq!(
        size(&s, "orders"),
        1000,
        "USERS_BATCH_SIZE is the users pipeline's own"
    );
    assert_eq!(size(&s, "users"), 7);
    let s = load_with(&orders, &[("batch_size", "9")]).expect("BATCH_SIZE is a setting");
    assert_eq!(
        size(&s, "orders"),
        9,
        "BATCH_SIZE is every pipeline's default"
    );
    assert_eq!(size(&s, "users"), 9);
}

/// Each field of a pipeline comes from its entry, else (for users) its own `USERS_*` setting,
/// else the default of the same name.
#[test]
fn each_field_is_the_entrys_else_users_own_else_the_default() {
    // (entry key and value, users' own setting, default setting, what the spec holds)
    type Read = fn(&PipelineSpec) -> u64;
    let fields: &[(&str, &str, &str, &str, &str, &str, Read)] = &[
        (
            "batch_size",
            "11",
            "users_batch_size",
            "12",
            "batch_size",
            "13",
            |p| p.batching.size as u64,
        ),
        (
            "batch_timeout_ms",
            "21",
            "users_batch_timeout_ms",
            "22",
            "batch_timeout_ms",
            "23",
            |p| p.batching.timeout.as_millis() as u64,
        ),
        (
            "batch_min_wait_ms",
            "21",
            "users_batch_min_wait_ms",
            "22",
            "batch_min_wait_ms",
            "23",
            |p| p.batching.min_wait.as_millis() as u64,
        ),
        (
            "proc_concurrency",
            "3",
            "users_proc_concurrency",
            "4",
            "proc_concurrency",
            "5",
            |p| p.batching.processors as u64,
        ),
        (
            "batch_concurrency",
            "3",
            "users_batch_concurrency",
            "4",
            "batch_concurrency",
            "5",
            |p| p.batching.concurrency as u64,
        ),
        (
            "min_concurrency",
            "2",
            "users_min_concurrency",
            "3",
            "min_concurrency",
            "4",
            |p| p.balance.min as u64,
        ),
        (
            "max_concurrency",
            "12",
            "users_max_concurrency",
            "13",
            "max_concurrency",
            "14",
            |p| p.balance.max as u64,
        ),
        (
            "balance_cooldown_ms",
            "1001",
            "users_balance_cooldown_ms",
            "1002",
            "balance_cooldown_ms",
            "1003",
            |p| p.balance.cooldown.as_millis() as u64,
        ),
        (
            "balance_max_shift",
            "2",
            "users_balance_max_shift",
            "3",
            "balance_max_shift",
            "4",
            |p| p.balance.max_shift as u64,
        ),
        (
            "scale_threshold",
            "31",
            "users_scale_threshold",
            "32",
            "scale_threshold",
            "33",
            |p| p.balance.threshold,
        ),
        (
            "scale_up_threshold",
            "41",
            "users_scale_up_threshold",
            "42",
            "scale_up_threshold",
            "43",
            |p| p.balance.up_threshold,
        ),
        (
            "scale_down_threshold",
            "1",
            "users_scale_down_threshold",
            "2",
            "scale_down_threshold",
            "3",
            |p| p.balance.down_threshold,
        ),
    ];
    let users_entry = |line: &str| {
        ORDERS
            .replace("name = \"orders\"", "name = \"users\"")
            .replace("batch_size = 500", line)
    };
    for (key, in_entry, own, own_value, default, default_value, read) in fields {
        let both = [(*own, *own_value), (*default, *default_value)];
        // The entry wins over both.
        let s = load_with(&users_entry(&format!("{key} = {in_entry}")), &both).expect(key);
        assert_eq!(
            read(&s.pipelines()[0]).to_string(),
            *in_entry,
            "{key}: the entry"
        );
        // Without it, users' own wins over the default for the pipeline named users ...
        let s = load_with(&users_entry(""), &both).expect(key);
        assert_eq!(
            read(&s.pipelines()[0]).to_string(),
            *own_value,
            "{key}: users' own"
        );
        // ... the built-in one included, and never for another pipeline.
        let s = load_with(&ORDERS.replace("batch_size = 500", ""), &both).expect(key);
        let (users, orders) = (&s.pipelines()[0], &s.pipelines()[1]);
        assert_eq!((users.name.as_str(), users.builtin), ("users", true));
        assert_eq!(
            read(users).to_string(),
            *own_value,
            "{key}: built-in users' own"
        );
        assert_eq!(
            read(orders).to_string(),
            *default_value,
            "{key}: orders' default"
        );
        // Without both, the default.
        let s = load_with(&users_entry(""), &[(*default, *default_value)]).expect(key);
        assert_eq!(
            read(&s.pipelines()[0]).to_string(),
            *default_value,
            "{key}: the default"
        );
    }
    // The choice of balancing, the same way.
    let balance = |text: &str, pairs: &[(&str, &str)]| {
        load_with(text, pairs).expect("valid").pipelines()[0]
            .balance
            .strategy
    };
    let pairs = [("users_balance", "simple"), ("balance", "auto")];
    assert_eq!(
        balance(&users_entry("balance = \"off\""), &pairs),
        crate::config::Balance::Off
    );
    assert_eq!(
        balance(&users_entry(""), &pairs),
        crate::config::Balance::Simple
    );
    assert_eq!(
        balance(&ORDERS.replace("name = \"orders\"", "name = \"o\""), &pairs),
        crate::config::Balance::Simple,
        "the built-in users pipeline comes first"
    );
    let s = load_with(ORDERS, &pairs).expect("valid");
    assert_eq!(
        s.pipeline("orders").unwrap().balance.strategy,
        crate::config::Balance::Auto
    );
}

/// A batch's minimum wait stays within its timeout (the longest a partial batch is held), and
/// the error says which value came from where.
#[test]
fn the_minimum_wait_is_at_most_the_batch_timeout() {
    let error =
        |text: &str, pairs: &[(&str, &str)]| load_with(text, pairs).unwrap_err().to_string();
    let e = error(
        &ORDERS.replace(
            "batch_size = 500",
            "batch_timeout_ms = 50\nbatch_min_wait_ms = 80",
        ),
        &[],
    );
    assert!(
        e.contains(
            "pipelines.orders.batch_min_wait_ms: expected at most batch_timeout_ms (50): the \
             batch timeout is the longest a partial batch is held, got 80"
        ),
        "{e}"
    );
    let e = error(ORDERS, &[("users_batch_min_wait_ms", "1001")]);
    assert!(
        e.contains("USERS_BATCH_MIN_WAIT_MS: expected at most BATCH_TIMEOUT_MS (1000)"),
        "{e}"
    );
    let s = load_with(ORDERS, &[("batch_min_wait_ms", "1000")]).expect("equal is allowed");
    let wait = |name: &str| s.pipeline(name).expect(name).batching.min_wait;
    assert_eq!(wait("orders"), Duration::from_secs(1));
    assert_eq!(wait("users"), Duration::from_secs(1));
}

/// A rule across fields names the pipeline and the field, where the value was given: the
/// entry's key (with its line), or the setting (users' own, or a default named with the
/// pipeline it fails for).
#[test]
fn a_rules_error_names_the_pipeline_and_the_field() {
    let error =
        |text: &str, pairs: &[(&str, &str)]| load_with(text, pairs).unwrap_err().to_string();
    let e = error(
        &ORDERS.replace("batch_size = 500", "min_concurrency = 9"),
        &[],
    );
    assert!(
        e.contains(
            ", line 6: pipelines.orders.min_concurrency: expected at most \
                        MAX_CONCURRENCY (8), got 9"
        ),
        "{e}"
    );
    let e = error(
        &ORDERS.replace("batch_size = 500", "max_concurrency = 2"),
        &[("min_concurrency", "3")],
    );
    assert!(
        e.contains(
            "MIN_CONCURRENCY (pipeline orders): expected at most max_concurrency (2), got 3"
        ),
        "{e}"
    );
    let e = error(ORDERS, &[("users_min_concurrency", "9")]);
    assert!(
        e.contains("USERS_MIN_CONCURRENCY: expected at most MAX_CONCURRENCY (8), got 9"),
        "{e}"
    );
    let e = error(
        &ORDERS.replace(
            "batch_size = 500",
            "balance = \"auto\"\nscale_up_threshold = 100",
        ),
        &[],
    );
    assert!(
        e.contains(
            "SCALE_DOWN_THRESHOLD (pipeline orders): expected below \
                        scale_up_threshold (100)"
        ),
        "{e}"
    );
    // The rate against the consumer timeout, with the pipeline's own window.
    let e = error(
        &ORDERS.replace("batch_size = 500", "rate_limit_per_s = 1"),
        &[("users_batch_size", "1")],
    );
    assert!(
        e.contains(
            "pipelines.orders.rate_limit_per_s: expected a rate at which one prefetch \
                        window (4000 deliveries)"
        ),
        "{e}"
    );
    // Every pipeline's prefetch derived from its own batching, capped by the bodies' window.
    let s = load_with(ORDERS, &[("batch_concurrency", "1")]).unwrap();
    assert_eq!(s.pipeline("orders").unwrap().prefetch, 1000);
    assert_eq!(s.pipeline("users").unwrap().prefetch, 2000);
    // What the pipelines always hold, against the budget.
    let e = error(ORDERS, &[("max_inserts_in_flight", "3")]);
    assert!(
        e.contains("MAX_INSERTS_IN_FLIGHT: expected 0 or at least the 4 batch inserts"),
        "{e}"
    );
    let s = load_with(
        ORDERS,
        &[("batch_concurrency", "5"), ("database_pool_size", "4")],
    )
    .unwrap();
    assert_eq!(s.inserts_budget(), 10);
    assert_eq!(s.pipelines_pool_size(), 10 + 10 + 1);
}

/// A file's pipeline named users keeps the users naming settings for each name it does not
/// give, as the built-in one does (found by the review: `MAIN_QUEUE=rv_mq` and a file users
/// entry ran on `users_queue` while `config --origin` said `main_queue = "rv_mq"`); a name the
/// entry gives wins; another pipeline's names are still derived from its own name.
#[test]
fn a_files_users_pipeline_keeps_the_users_names() {
    let users = ORDERS.replace("name = \"orders\"", "name = \"users\"");
    let s = load_with(
        &users,
        &[
            ("main_queue", "rv_mq"),
            ("main_exchange", "rv_ex"),
            ("dlq_queue", "rv_dlq"),
            ("retry_queue", "rv_retry_10s"),
        ],
    )
    .expect("valid");
    let names = &s.pipeline("users").expect("users").names;
    assert_eq!(names.main_queue, "rv_mq");
    assert_eq!(names.main_exchange, "rv_ex");
    assert_eq!(names.dlq_queue, "rv_dlq");
    assert_eq!(names.retry_exchange, s.retry_exchange);
    assert_eq!(names.dlx_exchange, s.dlx_exchange);
    assert_eq!(names.retry_tiers, s.retry_tiers());
    // With tiers, named from RETRY_QUEUE's base, as the built-in users pipeline's.
    let s = load_with(
        &users,
        &[
            ("retry_queue", "rv_retry_10s"),
            ("retry_ttls_ms", "1000,60000"),
        ],
    )
    .expect("valid");
    let tiers: Vec<String> = s.pipelines()[0]
        .names
        .retry_tiers
        .iter()
        .map(|t| t.queue.clone())
        .collect();
    assert_eq!(tiers, ["rv_retry_1s", "rv_retry_1m"]);
    // The entry's own name wins.
    let own = users.replace("batch_size = 500", "main_queue = \"mine\"");
    let s = load_with(&own, &[("main_queue", "rv_mq")]).expect("valid");
    assert_eq!(s.pipelines()[0].names.main_queue, "mine");
    // Another pipeline's are its own.
    let s = load_with(ORDERS, &[("main_queue", "rv_mq")]).expect("valid");
    assert_eq!(
        s.pipeline("orders").expect("orders").names.main_queue,
        "orders_queue"
    );
}

/// Whether `key` is a field of [`PipelineConfig`]: an entry giving it a string is refused for
/// its type, or taken, but never as an unknown field.
fn is_entry_field(key: &str) -> bool {
    let text = format!(
        "name = \"p\"\ntable = \"t\"\nkey = [\"id\"]\n{key} = \"x\"\n[columns]\nid = {{ path = \"/id\", type = \"uuid\" }}\n"
    );
    match toml::from_str::<PipelineConfig>(&text) {
        Ok(_) => true,
        Err(e) => !e.to_string().contains("unknown field"),
    }
}

/// [`ENTRY_KEYS`] is exactly the entry's keys named after a setting, each a field of the entry
/// and a setting, its numbers those with an integer rule, and its `users_own` those with a
/// `users_<key>` setting: the one table the number checks and the reload's list read.
#[test]
fn the_entry_keys_table_is_every_entry_key_named_after_a_setting() {
    let settings: Vec<&str> = crate::config::setting_names().map(|(k, _)| k).collect();
    for k in ENTRY_KEYS {
        assert!(is_entry_field(k.key), "{}: not an entry key", k.key);
        assert!(settings.contains(&k.key), "{}: not a setting", k.key);
        let integer = crate::config::RULES
            .iter()
            .any(|(key, rule)| *key == k.key && matches!(rule, crate::config::Rule::Int { .. }));
        assert_eq!(k.number, integer, "{}: number", k.key);
        let own = format!("users_{}", k.key);
        assert_eq!(
            k.users_own,
            settings.contains(&own.as_str()),
            "{}: users_own",
            k.key
        );
    }
    for key in settings.iter().filter(|k| is_entry_field(k)) {
        assert!(
            ENTRY_KEYS.iter().any(|k| k.key == *key),
            "the entry key {key} is named after a setting but not in ENTRY_KEYS"
        );
    }
    assert_eq!(numbers().count(), 16);
}

/// The names `spec.rs` spells by hand as it resolves each entry key (the key, users' own
/// `users_<key>` setting, the default's setting) are those of [`ENTRY_KEYS`]: every key of
/// every pipeline's default but `retry_ttls_ms` (a list, checked apart) resolved once, none
/// other, each with users' own setting exactly when the table says it has one. A key added to
/// one place and not the other, or a misspelt name, fails here.
#[test]
fn the_names_resolve_spells_are_those_of_the_entry_keys_table() {
    use std::collections::BTreeSet;
    spec::PICKED.with(|p| p.borrow_mut().clear());
    load(ORDERS).expect("load");
    let picked: Vec<(String, Option<String>, String)> = spec::PICKED.with(|p| {
        p.borrow()
            .iter()
            .map(|(f, own, d)| (f.to_string(), own.map(str::to_string), d.to_string()))
            .collect()
    });
    let expected: BTreeSet<(String, Option<String>, String)> = ENTRY_KEYS
        .iter()
        .filter(|k| k.default_of == DefaultOf::Every && k.key != "retry_ttls_ms")
        .map(|k| {
            let own = k.users_own.then(|| format!("users_{}", k.key));
            (k.key.to_string(), own, k.key.to_string())
        })
        .collect();
    let got: BTreeSet<_> = picked.iter().cloned().collect();
    assert_eq!(got, expected);
    // Each key once per pipeline: users (the shipped default) and orders.
    assert_eq!(picked.len(), 2 * expected.len(), "{picked:?}");
}

/// Review R36g F6: a `delete.value` of another type than a string, an integer or a boolean
/// was refused in the parser's words, naming its enum.
#[test]
fn a_delete_value_of_another_type_says_what_is_taken() {
    for value in ["1.5", "[1]"] {
        let e = load(&format!(
            "\n[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"id\"]\n\
             on_conflict = \"update\"\nversion_column = \"version\"\n\
             delete = {{ field = \"/op\", value = {value} }}\n\n[pipelines.columns]\n\
             id = {{ path = \"/id\", type = \"text\" }}\n\
             version = {{ path = \"/version\", type = \"int8\" }}\n"
        ))
        .expect_err(value)
        .to_string();
        assert!(
            e.contains("a string, an integer or a boolean") && !e.contains("untagged"),
            "{value}: {e}"
        );
    }
}

/// Review R36g F2: two pipelines writing one child table (or one's child table the other's own
/// table), without deletes: one's update deleted the other's child rows, whose redelivery was
/// then parked as a conflict. Refused, naming both and the table.
#[test]
fn a_child_table_written_by_another_pipeline_is_refused_naming_both() {
    let with_items = |name: &str, table: &str| {
        format!(
            "\n[[pipelines]]\nname = \"{name}\"\ntable = \"{table}\"\nkey = [\"id\"]\n\n\
             [pipelines.columns]\nid = {{ path = \"/id\", type = \"text\" }}\n\n\
             [[pipelines.children]]\ntable = \"shop.items\"\nrows = \"/items\"\n\
             key = [\"id\", \"line\"]\n\n[pipelines.children.columns]\n\
             id = {{ parent = \"id\" }}\nline = {{ index = true }}\n"
        )
    };
    let e = load(&format!(
        "{}{}",
        with_items("orders", "shop.orders"),
        with_items("returns", "shop.returns")
    ))
    .expect_err("one child table, two pipelines");
    let text = e.to_string();
    assert!(
        text.contains("pipelines.orders.children")
            && text.contains(
                "table shop.items, a child table of pipeline orders written by pipeline returns"
            ),
        "{text}"
    );
    // The other's own table.
    let plain = "\n[[pipelines]]\nname = \"lines\"\ntable = \"shop.items\"\nkey = [\"id\"]\n\n\
                 [pipelines.columns]\nid = { path = \"/id\", type = \"text\" }\n";
    let e = load(&format!("{}{plain}", with_items("orders", "shop.orders")))
        .expect_err("a child table another pipeline's own");
    assert!(e.to_string().contains("written by pipeline lines"), "{e}");
    // Two pipelines on one parent table, without children or deletes: fine.
    load(&format!(
        "{plain}{}",
        plain.replace("\"lines\"", "\"lines2\"")
    ))
    .expect("one table, two plain pipelines");
}

/// Review R38-F10: a pipeline whose table (or child table) is one warren keeps in
/// `DATABASE_SCHEMA` is refused at load, naming it: another pipeline's tombstone table (its
/// rows made that pipeline's writes `stale`), `dead_letters`, the migrations' history.
#[test]
fn a_pipeline_on_one_of_warrens_own_tables_is_refused() {
    let entry = |name: &str, table: &str, delete: bool| {
        format!(
            r#"
[[pipelines]]
name = "{name}"
table = "{table}"
key = ["k"]
on_conflict = "update"
version_column = "v"
{}
[pipelines.columns]
k = {{ path = "/k", type = "text" }}
v = {{ path = "/v", type = "int8" }}
"#,
            if delete {
                r#"delete = { field = "/op", value = "delete" }"#
            } else {
                ""
            }
        )
    };
    for (table, what) in [
        ("tombstones_del", "pipeline del's tombstones"),
        ("public.tombstones_del", "pipeline del's tombstones"),
        ("dead_letters", "the parking table"),
        ("refinery_schema_history", "the migrations' history"),
    ] {
        let e = load(&format!(
            "{}{}",
            entry("del", "shop_del", true),
            entry("tb", table, false)
        ))
        .expect_err(table);
        let text = e.to_string();
        assert!(
            text.contains("pipelines.tb.table") || text.contains("tb"),
            "{table}: {text}"
        );
        assert!(
            text.contains(&format!("which is warren's own: {what}")),
            "{table}: {text}"
        );
    }
    // Any `tombstones_*` name in warren's schema is warren's, its pipeline in this file or not
    // (review R39-F6); in another schema it is the team's.
    let e = load(&entry("tb", "tombstones_other", false)).expect_err("reserved");
    assert!(e.to_string().contains("a name warren keeps"), "{e}");
    load(&entry("tb", "shop.tombstones_other", false)).expect("another schema");
}

/// Review R36f F11: two pipelines writing one table, one with deletes: the other's older writes
/// never saw the delete's tombstone (its pipeline's own) and brought the row back. Refused,
/// naming both and the table, whichever table they share (the parent, or a child table); two
/// pipelines on one table without deletes are fine.
#[test]
fn a_table_written_by_another_pipeline_refuses_deletes_naming_both() {
    let with_delete = |name: &str, table: &str, child: &str| {
        format!(
            r#"
[[pipelines]]
name = "{name}"
table = "{table}"
key = ["order_id"]
on_conflict = "update"
version_column = "version"
delete = {{ field = "/op", value = "delete" }}

[pipelines.columns]
order_id = {{ path = "/id", type = "uuid" }}
version = {{ path = "/version", type = "int8" }}
{child}"#
        )
    };
    let plain = |name: &str, table: &str| {
        format!(
            r#"
[[pipelines]]
name = "{name}"
table = "{table}"
key = ["order_id"]

[pipelines.columns]
order_id = {{ path = "/id", type = "uuid" }}
"#
        )
    };
    let e = load(&format!(
        "{}{}",
        with_delete("orders", "shop.orders", ""),
        plain("imports", "shop.orders")
    ))
    .expect_err("a deleted row brought back by the other pipeline");
    let text = e.to_string();
    assert!(
        text.contains("delete")
            && text.contains("table shop.orders, written by pipelines orders and imports"),
        "{text}"
    );
    // A child table of the one with deletes, written by the other as its own table.
    let items = "\n[[pipelines.children]]\ntable = \"shop.items\"\nrows = \"/items\"\n\
                 key = [\"order_id\", \"line\"]\n\n[pipelines.children.columns]\n\
                 order_id = { parent = \"order_id\" }\nline = { index = true }\n";
    let e = load(&format!(
        "{}{}",
        plain("imports", "items"),
        with_delete("orders", "shop.orders", items).replace("shop.items", "public.items")
    ))
    .expect_err("a child table written by another pipeline");
    assert!(
        e.to_string()
            .contains("table public.items, written by pipelines orders and imports"),
        "{e}"
    );
    // An unqualified name is the table of DATABASE_SCHEMA (public by default), the one warren's
    // sessions search: the same table as `public.orders`, another than `shop.orders`
    // (review R38i F1).
    assert!(
        load(&format!(
            "{}{}",
            with_delete("orders", "public.orders", ""),
            plain("imports", "orders")
        ))
        .is_err(),
        "orders and public.orders are one table"
    );
    load(&format!(
        "{}{}",
        with_delete("orders", "shop.orders", ""),
        plain("imports", "orders")
    ))
    .expect("shop.orders is another table than public.orders");
    // With DATABASE_SCHEMA = shop, `orders` is shop.orders.
    assert!(
        load(&format!(
            "database_schema = \"shop\"\n{}{}",
            with_delete("orders", "shop.orders", ""),
            plain("imports", "orders")
        ))
        .is_err(),
        "orders is shop.orders under DATABASE_SCHEMA = shop"
    );
    // Without deletes, two pipelines may share a table.
    load(&format!(
        "{}{}",
        plain("orders", "shop.orders"),
        plain("imports", "shop.orders")
    ))
    .expect("two pipelines on one table");
}
