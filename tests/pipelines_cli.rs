//! `warren pipelines` and `warren pipelines test`, with no broker and no database: the listing
//! shows each pipeline's queues, table and mapping; `test` prints the row each JSON line would
//! become or the rejection with its kind and reason (exit 0 when all are accepted, 1 otherwise),
//! `unknown_fields` both ways, headers read by `header` columns; a mistake in a `[[pipelines]]`
//! entry stops every subcommand with exit 2 naming the pipeline and the field.

mod common;

use std::io::Write as _;
use std::process::{Command, Stdio};

use common::bin as warren_bin;

const ORDERS: &str = r#"
[[pipelines]]
name = "orders"
table = "shop.orders"
key = ["order_id"]
unknown_fields = "reject"

[pipelines.columns]
order_id  = { path = "/id", type = "uuid" }
email     = { path = "/customer/email", type = "text", format = "email", max_len = 320 }
total     = { path = "/total", type = "numeric", min = 0 }
quantity  = { path = "/qty", type = "int4", min = 1, max = 1000 }
placed_at = { path = "/placed_at", type = "timestamptz" }
note      = { path = "/note", type = "text", optional = true }
tenant    = { header = "x-tenant", type = "text", optional = true }
doc       = { path = "", type = "jsonb" }
"#;

const GOOD: &str = r#"{"id":"6f1c3c1e-8a4e-4f55-9a53-2d5e0b7f1a01","customer":{"email":"a@b.co"},"total":"12.50","qty":2,"placed_at":"2026-11-24T10:00:00Z"}"#;

/// `warren --config FILE(text) ARGS` with `stdin`: (exit code, stdout, stderr).
fn warren(config: &str, args: &[&str], stdin: &str) -> (i32, String, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("warren.toml");
    std::fs::write(&path, config).expect("write the config");
    let mut child = Command::new(warren_bin())
        .arg("--config")
        .arg(&path)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("output");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_listing_shows_users_and_the_files_pipelines() {
    let (code, out, err) = warren(ORDERS, &["pipelines"], "");
    assert_eq!(code, 0, "{err}");
    for expected in [
        "users (built-in)",
        "raffle_exchange -> raffle_queue",
        "orders\n",
        "orders_exchange -> orders_queue",
        "orders_retry_exchange -> orders_retry_10s",
        "orders_dlx -> orders_dlq",
        "shop.orders, key order_id, on_conflict keep, unknown_fields reject",
        "header x-tenant",
        "(whole body)",
        "min 1, max 1000",
    ] {
        assert!(out.contains(expected), "{expected:?} missing:\n{out}");
    }
}

#[test]
fn test_prints_each_row_or_rejection_and_exits_by_the_verdict() {
    let bad_uuid = GOOD.replace("6f1c3c1e-8a4e-4f55-9a53-2d5e0b7f1a01", "x");
    let unknown = GOOD.replace(r#""qty":2"#, r#""qty":2,"coupon":"X""#);
    let out_of_range = GOOD.replace(r#""qty":2"#, r#""qty":1001"#);
    let negative = GOOD.replace(r#""12.50""#, "-1");
    let no_email = GOOD.replace(r#""customer":{"email":"a@b.co"},"#, "");
    let input = [
        GOOD,
        "",
        &bad_uuid,
        &unknown,
        &out_of_range,
        &negative,
        &no_email,
        "{not json",
    ]
    .join("\n");
    let (code, out, err) = warren(ORDERS, &["pipelines", "test", "orders"], &input);
    assert_eq!(code, 1, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("1: ok {"), "{out}");
    assert!(
        lines[0].contains(r#""total":"12.50""#),
        "numeric as written: {out}"
    );
    assert!(
        lines[0].contains(r#""note":null"#),
        "optional absent is NULL: {out}"
    );
    for (line, expected) in [
        ("3: invalid_payload", "/id"),
        ("4: invalid_payload", "/coupon"),
        ("5: invalid_payload", "qty must be at most 1000"),
        ("6: invalid_payload", "total must be at least 0"),
        ("7: invalid_payload", "/customer/email"),
        ("8: invalid_json", "not JSON"),
    ] {
        let found = lines
            .iter()
            .find(|l| l.starts_with(line))
            .unwrap_or_else(|| panic!("no {line:?}:\n{out}"));
        assert!(found.contains(expected), "{found} lacks {expected:?}");
    }
    assert!(out.ends_with("1 accepted, 6 refused\n"), "{out}");

    // unknown_fields = "ignore": the extra field is dropped.
    let ignoring = ORDERS.replace(
        r#"unknown_fields = "reject""#,
        r#"unknown_fields = "ignore""#,
    );
    let (code, out, err) = warren(&ignoring, &["pipelines", "test", "orders"], &unknown);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("1: ok {"), "{out}");

    // Headers: a line carries them with --headers; the header column reads them.
    let line = format!(r#"{{"headers":{{"x-tenant":"acme"}},"body":{GOOD}}}"#);
    let (code, out, err) = warren(ORDERS, &["pipelines", "test", "orders", "--headers"], &line);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(r#""tenant":"acme""#), "{out}");
    // A null header is AMQP's void field, read as null (it ended the command, found by the
    // review): the optional column is NULL, and the next line is checked too.
    let lines = format!(
        "{{\"headers\":{{\"x-tenant\":null}},\"body\":{GOOD}}}\n\
         {{\"headers\":{{\"x-tenant\":\"acme\"}},\"body\":{GOOD}}}\n"
    );
    let (code, out, err) = warren(
        ORDERS,
        &["pipelines", "test", "orders", "--headers"],
        &lines,
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(r#"1: ok {"#) && out.contains(r#""tenant":null"#),
        "{out}"
    );
    assert!(
        out.contains("2: ok {") && out.contains("2 accepted, 0 refused"),
        "{out}"
    );

    // The built-in users pipeline, and a pipeline that does not exist.
    let user = r#"{"id":"6f1c3c1e-8a4e-4f55-9a53-2d5e0b7f1a01","name":"A","email":"a@b.co"}"#;
    let (code, out, err) = warren("", &["pipelines", "test", "users"], user);
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = warren(ORDERS, &["pipelines", "test", "nope"], "");
    assert_ne!(code, 0);
    assert!(
        err.contains("no pipeline \"nope\"") && err.contains("users, orders"),
        "{err}"
    );
}

#[test]
fn a_mistake_in_a_pipeline_stops_warren_with_exit_2_naming_it() {
    for (from, to, expected) in [
        (
            r#"type = "int4""#,
            r#"type = "int3""#,
            r#"pipelines.orders.columns.quantity.type: expected one of text, uuid, int4, int8"#,
        ),
        (
            r#"type = "int4""#,
            r#"type = "int3""#,
            "(did you mean int4?)",
        ),
        (
            r#"path = "/qty""#,
            r#"path = "qty""#,
            "pipeline orders: columns.quantity",
        ),
        (
            r#"key = ["order_id"]"#,
            r#"key = ["order_id"]
on_conflict = "update""#,
            "version_column",
        ),
        (
            r#"name = "orders""#,
            r#"name = "orders"
main_queue = "raffle_queue""#,
            "also the main_queue of pipeline users",
        ),
    ] {
        let config = ORDERS.replacen(from, to, 1);
        for args in [&["config"][..], &["pipelines"], &["run"]] {
            let (code, out, err) = warren(&config, args, "");
            assert_eq!(code, 2, "warren {args:?} with {to}:\n{out}{err}");
            assert!(err.contains(expected), "warren {args:?}: {err}");
        }
    }
}

/// Reviews R36e F14, R35e F3: `pipelines test` of a name the configuration does not have
/// exited 1, as for a refused line, and no command said which name was meant. Now it is a usage
/// error (exit 2) naming the closest pipeline; a name close to none gets the list alone.
#[test]
fn an_unknown_pipeline_name_is_exit_2_with_the_closest_name() {
    let (code, out, err) = warren(ORDERS, &["pipelines", "test", "order"], GOOD);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains(
            "no pipeline \"order\" (did you mean orders?); this configuration has: \
             users, orders"
        ),
        "{err}"
    );
    let (code, out, err) = warren(ORDERS, &["pipelines", "test", "zzzzzz"], GOOD);
    assert_eq!(code, 2, "{out}{err}");
    assert!(!err.contains("did you mean"), "{err}");
}

/// Found by the review: a line that is not UTF-8 stopped `pipelines test` ("cannot read the
/// input"), the lines after it never checked, where the pipeline parks such a body as
/// `invalid_json`. Now it is that line's verdict and the next lines are checked.
#[test]
fn a_line_that_is_not_utf8_is_its_own_verdict_and_the_next_lines_are_checked() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("warren.toml");
    std::fs::write(&config, ORDERS).expect("write the config");
    let input = dir.path().join("lines.jsonl");
    let mut bytes = Vec::new();
    bytes.extend_from_slice(GOOD.as_bytes());
    bytes.extend_from_slice(b"\n{\"id\":\"a\xff\"}\r\n");
    bytes.extend_from_slice(GOOD.as_bytes());
    bytes.push(b'\n');
    std::fs::write(&input, bytes).expect("write the input");
    let out = Command::new(warren_bin())
        .arg("--config")
        .arg(&config)
        .args(["pipelines", "test", "orders"])
        .arg(&input)
        .output()
        .expect("run warren");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1: ok "), "{stdout}");
    assert!(stdout.contains("2: invalid_json "), "{stdout}");
    assert!(stdout.contains("3: ok "), "{stdout}");
    assert!(stdout.contains("2 accepted, 1 refused"), "{stdout}");
}

/// Found by the second review: `pipelines test` said "ok" to a body over `MAX_MESSAGE_BYTES`,
/// which the pipeline refuses unread. It says what the pipeline would.
#[test]
fn a_body_over_max_message_bytes_is_refused_as_the_pipeline_refuses_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("warren.toml");
    std::fs::write(&config, format!("max_message_bytes = 100\n{ORDERS}")).expect("config");
    let input = dir.path().join("lines.jsonl");
    std::fs::write(&input, format!("{GOOD}\n")).expect("input");
    let out = Command::new(warren_bin())
        .arg("--config")
        .arg(&config)
        .args(["pipelines", "test", "orders"])
        .arg(&input)
        .output()
        .expect("run warren");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("1: invalid_payload body of")
            && stdout.contains("exceeds MAX_MESSAGE_BYTES (100)"),
        "{stdout}"
    );
}

/// Each pipeline is resolved on its own: `USERS_BATCH_SIZE` is the users pipeline's alone, the
/// bare `BATCH_SIZE` every pipeline's default (an entry's own key would win over both);
/// `warren config` ends with each pipeline's effective prefetch window (batch size x batch
/// concurrency x 2).
#[test]
fn users_own_settings_reach_users_alone_and_the_defaults_every_pipeline() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("warren.toml");
    std::fs::write(&path, ORDERS).expect("write the config");
    let windows = |vars: &[(&str, &str)]| {
        let out = Command::new(warren_bin())
            .env_clear()
            .envs(vars.iter().copied())
            .arg("--config")
            .arg(&path)
            .arg("config")
            .output()
            .expect("run warren");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{vars:?}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("# effective prefetch: "))
            .unwrap_or_else(|| panic!("{vars:?}: no effective prefetch line:\n{stdout}"))
            .to_string()
    };
    assert_eq!(windows(&[]), "4000 (users), 4000 (orders)");
    assert_eq!(
        windows(&[("USERS_BATCH_SIZE", "100")]),
        "400 (users), 4000 (orders)"
    );
    assert_eq!(
        windows(&[("BATCH_SIZE", "100")]),
        "400 (users), 400 (orders)"
    );
    assert_eq!(
        windows(&[("WARREN_BATCH_SIZE", "100"), ("USERS_BATCH_SIZE", "300")]),
        "1200 (users), 400 (orders)"
    );
    let with_own = ORDERS.replace("unknown_fields", "batch_size = 50\nunknown_fields");
    std::fs::write(&path, with_own).expect("write the config");
    assert_eq!(
        windows(&[("BATCH_SIZE", "100"), ("USERS_BATCH_SIZE", "300")]),
        "1200 (users), 200 (orders)"
    );
}

const NESTED: &str = r#"
[[pipelines]]
name = "orders"
table = "shop.orders"
key = ["order_id"]

[pipelines.columns]
order_id = { path = "/order_id", type = "uuid" }
total    = { path = "/total", type = "numeric", min = 0 }

[[pipelines.children]]
table = "shop.order_items"
rows = "/items"
key = ["order_id", "line"]
max_rows = 3

[pipelines.children.columns]
order_id = { parent = "order_id" }
line     = { index = true }
sku      = { path = "/sku", type = "text", min_len = 1 }
qty      = { path = "/qty", type = "int4", min = 1 }
"#;

/// A pipeline with a child table: the listing shows it, `test` prints each child row under
/// its parent, and a refused element is named by its path.
#[test]
fn test_prints_the_child_rows_and_names_an_elements_path() {
    let (code, out, err) = warren(NESTED, &["pipelines"], "");
    assert_eq!(code, 0, "{err}");
    for expected in [
        "child   shop.order_items from /items, key order_id+line, max_rows 3",
        "order_id  parent order_id     uuid",
        "(position, from 1)",
    ] {
        assert!(out.contains(expected), "{expected:?} in:\n{out}");
    }
    let id = "6f1c3c1e-8a4e-4f55-9a53-2d5e0b7f1a01";
    let input = format!(
        "{{\"order_id\":\"{id}\",\"total\":\"12.50\",\"items\":[{{\"sku\":\"A-1\",\"qty\":2}},{{\"sku\":\"B-2\",\"qty\":1}}]}}\n\
         {{\"order_id\":\"{id}\",\"total\":1,\"items\":[{{\"sku\":\"A\",\"qty\":1}},{{\"sku\":\"B\",\"qty\":0}}]}}\n\
         {{\"order_id\":\"{id}\",\"total\":1,\"items\":[{{}},{{}},{{}},{{}}]}}\n"
    );
    let (code, out, err) = warren(NESTED, &["pipelines", "test", "orders"], &input);
    assert_eq!(code, 1, "{err}");
    assert_eq!(
        out,
        format!(
            "1: ok {{\"order_id\":\"{id}\",\"total\":12.50}}\n   \
             + shop.order_items {{\"line\":1,\"order_id\":\"{id}\",\"qty\":2,\"sku\":\"A-1\"}}\n   \
             + shop.order_items {{\"line\":2,\"order_id\":\"{id}\",\"qty\":1,\"sku\":\"B-2\"}}\n\
             2: invalid_payload /items/1/qty: expected at least 1, found 0\n\
             3: invalid_payload /items: holds 4 elements, more than the 3 rows of \
             shop.order_items one message may give (max_rows)\n\
             1 accepted, 2 refused\n"
        )
    );
}

/// A pipeline with deletes: the listing names the delete's field and value and the tombstone
/// table; `test` prints a delete as its key and version (`delete {...}`), a message whose field
/// holds another value as a row; a delete without `on_conflict = "update"`, or reading the
/// key's own field, stops warren with exit 2 naming `delete`.
#[test]
fn deletes_are_listed_tested_and_refused_where_they_make_no_sense() {
    let config = ORDERS
        .replace(
            "key = [\"order_id\"]\n",
            "key = [\"order_id\"]\non_conflict = \"update\"\nversion_column = \"quantity\"\n\
             delete = { field = \"/op\", value = \"delete\" }\n",
        )
        .replace("doc       = { path = \"\", type = \"jsonb\" }\n", "");
    let (code, out, err) = warren(&config, &["pipelines"], "");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("delete when /op = \"delete\" (tombstones_orders)"),
        "{out}"
    );
    let delete = r#"{"op":"delete","id":"6f1c3c1e-8a4e-4f55-9a53-2d5e0b7f1a01","qty":3}"#;
    let upsert = GOOD.replace("{\"id\"", "{\"op\":\"upsert\",\"id\"");
    let input = format!("{delete}\n{upsert}\n");
    let (code, out, err) = warren(&config, &["pipelines", "test", "orders"], &input);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(
            r#"1: delete {"order_id":"6f1c3c1e-8a4e-4f55-9a53-2d5e0b7f1a01","quantity":3}"#
        ),
        "{out}"
    );
    assert!(out.contains("2: ok {"), "{out}");
    for (edit, expected) in [
        (
            config.replace(
                "on_conflict = \"update\"\nversion_column = \"quantity\"\n",
                "",
            ),
            "delete needs on_conflict = \"update\"",
        ),
        (
            config.replace("field = \"/op\"", "field = \"/id\""),
            "delete.field \"/id\" is read by column order_id",
        ),
    ] {
        let (code, out, err) = warren(&edit, &["pipelines"], "");
        assert_eq!(code, 2, "{out}{err}");
        assert!(err.contains(expected), "{err}");
    }
}

/// Found by review (R36-f): a `--headers` line whose properties gave no exchange or routing key
/// showed them as `""` in the row, values no delivery of the pipeline carries (a delivery
/// always has both; `""` is the default exchange). Such a line has the pipeline's own, where
/// `publish --pipeline` and the API publish; an empty one given is `""`. A line without
/// properties leaves the other property columns absent, and has the pipeline's exchange and
/// routing key too (review R36g F3: it had none, and a required `routing_key` column refused
/// every line `run` stores).
#[test]
fn test_headers_gives_a_line_without_exchange_the_pipelines_own() {
    const PROPS: &str = r#"
[[pipelines]]
name = "p"
table = "t"
key = ["k"]

[pipelines.columns]
k   = { path = "/k", type = "int4" }
ex  = { property = "exchange", type = "text", optional = true }
rk  = { property = "routing_key", type = "text", optional = true }
mid = { property = "message_id", type = "text", optional = true }
"#;
    let lines = [
        r#"{"properties":{"message_id":"m-1"},"body":{"k":1}}"#,
        r#"{"properties":{"exchange":"","routing_key":"eu"},"body":{"k":2}}"#,
        r#"{"body":{"k":3}}"#,
    ]
    .join("\n");
    let (code, out, err) = warren(PROPS, &["pipelines", "test", "p", "--headers"], &lines);
    assert_eq!(code, 0, "{out}{err}");
    for expected in [
        r#"1: ok {"ex":"p_exchange","k":1,"mid":"m-1","rk":"p_queue"}"#,
        r#"2: ok {"ex":"","k":2,"mid":null,"rk":"eu"}"#,
        r#"3: ok {"ex":"p_exchange","k":3,"mid":null,"rk":"p_queue"}"#,
    ] {
        assert!(out.contains(expected), "{expected} missing:\n{out}");
    }
    // Without --headers, a required routing_key column takes the pipeline's own, as `run`.
    let required = PROPS.replace(
        r#"rk  = { property = "routing_key", type = "text", optional = true }"#,
        r#"rk  = { property = "routing_key", type = "text" }"#,
    );
    let (code, out, err) = warren(&required, &["pipelines", "test", "p"], r#"{"k":4}"#);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(r#""rk":"p_queue""#), "{out}{err}");
    // A property AMQP cannot carry (over 255 bytes) refuses the line, naming it.
    let long = format!(
        r#"{{"properties":{{"message_id":"{}"}},"body":{{"k":5}}}}"#,
        "m".repeat(256)
    );
    let (code, out, err) = warren(PROPS, &["pipelines", "test", "p", "--headers"], &long);
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("property message_id: at most 255 bytes, found 256"),
        "{out}{err}"
    );
}
