//! The tools around a configured pipeline, against the real broker and database: `warren
//! publish --pipeline NAME` (JSON lines from a file or standard input to the pipeline's
//! exchange with its routing key, confirmed, each message's id its key; a line that is no JSON
//! object named and skipped; exit 1 when a publish is not confirmed, 2 for an unknown
//! pipeline), and what the pipeline then makes of them; `warren pipelines test NAME --db`,
//! which tries each message's rows against the live tables and leaves nothing in them.

mod common;

use std::io::Write as _;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use uuid::Uuid;

/// `warren --config FILE ARGS` fed `stdin`: (exit code, stdout, stderr).
async fn with_stdin(env: &TestEnv, args: &[&str], stdin: &[u8]) -> (i32, String, String) {
    let mut child = env
        .command(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start warren");
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(stdin).expect("write stdin");
    drop(input);
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .expect("join")
        .expect("warren");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `publish --pipeline orders --file F` sends the file's orders to the orders queue (not
/// users'), each with its `order_id` as its message id, names the lines that are not JSON
/// objects; standard input works the same; the pipeline then stores each order with its items.
#[tokio::test(flavor = "multi_thread")]
async fn publish_pipeline_sends_json_lines_to_the_pipelines_queue() {
    let env = TestEnv::new("tools_publish").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    create_nested_tables(&env).await;
    let file = ConfigFile::new(&nested_toml(&names, ""));
    declare_file(&env, &file).await;

    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let dir = tempfile::tempdir().expect("temp dir");
    let lines = dir.path().join("orders.jsonl");
    let mut text = Vec::new();
    text.extend(nested_order(a, 1, &[("A-1", 2), ("B-2", 1)]));
    text.extend(b"\nnot json\n");
    text.extend(nested_order(b, 1, &[("C-3", 5)]));
    text.extend(b"\n[1, 2]\n");
    std::fs::write(&lines, text).expect("write the lines");
    let (code, out, err) = env
        .run_async(&[
            "--config",
            file.at(),
            "publish",
            "--pipeline",
            "orders",
            "--file",
            lines.to_str().expect("utf-8"),
        ])
        .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("published 2 messages"), "{out}");
    assert!(out.contains(", 0 failed"), "{out}");
    assert!(err.contains("line 2: not JSON"), "{err}");
    assert!(err.contains("line 4: expected a JSON object"), "{err}");
    assert_eq!(env.ready(&env.main_queue).await, 0, "nothing to users");
    let queued = env.peek(&names.queue, 10).await;
    let ids: Vec<String> = queued.iter().map(message_id).collect();
    assert_eq!(ids, [a.to_string(), b.to_string()]);

    // Standard input, when there is no --file.
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "publish", "--pipeline", "orders"],
        &nested_order(c, 1, &[("D-4", 1)]),
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("published 1 messages"), "{out}");

    // The pipeline stores what was published: each order once, with its items.
    let warren = env.start(&["--config", file.at(), "--roles", "consumer,dlq"]);
    let _logs = LogsOnPanic(vec![warren.log.clone()]);
    wait_until("the three orders", Duration::from_secs(60), || async {
        count_of(&env, "SELECT count(*) FROM order_items").await == 4
    })
    .await;
    assert_eq!(
        nested_items(&env, a).await,
        [(1, "A-1".to_string(), 2), (2, "B-2".to_string(), 1)]
    );
    assert_eq!(nested_items(&env, c).await, [(1, "D-4".to_string(), 1)]);
    assert_eq!(count_of(&env, "SELECT count(*) FROM orders").await, 3);
}

/// Found by review (R36-b): a line whose key is too long for an AMQP message id (over 255
/// bytes) was skipped, and the command still exited 0 with the message never sent. It is sent,
/// with a new UUID as its message id, and standard error names the line and that id.
#[tokio::test(flavor = "multi_thread")]
async fn publish_pipeline_sends_a_line_whose_key_is_too_long_for_a_message_id() {
    let env = TestEnv::new("tools_publish_long").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    create_nested_tables(&env).await;
    let file = ConfigFile::new(&nested_toml(&names, ""));
    declare_file(&env, &file).await;
    let long = "k".repeat(300);
    let line = format!(r#"{{"order_id":"{long}","total":"1","version":1,"items":[]}}"#);
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "publish", "--pipeline", "orders"],
        line.as_bytes(),
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("published 1 messages"), "{out}");
    let queued = env.peek(&names.queue, 10).await;
    assert_eq!(queued.len(), 1, "the line was not sent: {err}");
    let id = message_id(&queued[0]);
    assert!(id.parse::<Uuid>().is_ok(), "{id}");
    assert_eq!(
        queued[0].delivery.data,
        line.as_bytes(),
        "the body as written"
    );
    assert!(
        err.contains(&format!(
            "line 1: \"order_id\": at most 255 bytes, found 300 (an AMQP message id), sent with \
             message id {id}"
        )),
        "{err}"
    );
}

/// An unknown pipeline is a usage error naming the known ones (exit 2); a publish the broker
/// does not confirm (here: the pipeline's topology never declared, so its exchange is missing)
/// names the line and exits 1, as the other modes do.
#[tokio::test(flavor = "multi_thread")]
async fn publish_pipeline_exits_by_what_was_confirmed() {
    let env = TestEnv::new("tools_publish_fail").await;
    let names = PipelineNames::of(&env, "orders");
    let _cleanup = names.cleanup();
    let file = ConfigFile::new(&nested_toml(&names, ""));
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "publish", "--pipeline", "order"],
        b"",
    )
    .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains(
            "--pipeline: no pipeline \"order\" (did you mean orders?); this configuration has: \
             users, orders"
        ),
        "{err}"
    );

    let id = Uuid::new_v4();
    let (code, out, err) = with_stdin(
        &env,
        &[
            "--config",
            file.at(),
            "--set",
            "PUBLISH_TIMEOUT_MS=3000",
            "publish",
            "--pipeline",
            "orders",
        ],
        &nested_order(id, 1, &[("A", 1)]),
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("published 0 messages"), "{out}");
    assert!(out.contains("1 failed"), "{out}");
    assert!(
        err.contains(&format!("line 1 (id {id}) not confirmed")),
        "{err}"
    );
}

/// `pipelines test orders FILE --db`: each accepted order's rows are written into the live
/// tables and rolled back: a child row's CHECK, a child's foreign key to another table, a
/// parent's CHECK and a value too long for a `varchar(5)` each show up on their line as
/// `db_permanent` in PostgreSQL's words naming the table (and constraint); a key already
/// stored is not tried; a message the mapping refuses is refused offline as before. Exit 1,
/// and the tables hold exactly what they held before; with good lines only, exit 0, and still
/// nothing stays.
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_names_what_the_tables_refuse_and_leaves_nothing() {
    let env = TestEnv::new("tools_test_db").await;
    let names = PipelineNames::of(&env, "orders");
    create_nested_tables(&env).await;
    env.db
        .batch_execute(
            "CREATE TABLE skus (sku text PRIMARY KEY);
             INSERT INTO skus VALUES ('A-1'), ('B-2'), ('LONGER');
             ALTER TABLE order_items ALTER sku TYPE varchar(5),
                 ADD FOREIGN KEY (sku) REFERENCES skus;
             ALTER TABLE orders ADD CONSTRAINT orders_total_check CHECK (total < 1000)",
        )
        .await
        .expect("the constraints");
    let file = ConfigFile::new(&nested_toml(&names, ""));
    let stored = Uuid::new_v4();
    env.db
        .batch_execute(&format!(
            "INSERT INTO orders VALUES ('{stored}', 1, 1);
             INSERT INTO order_items VALUES ('{stored}', 1, 'A-1', 1)"
        ))
        .await
        .expect("a stored order");
    let good = Uuid::new_v4();
    let order = |items: &[(&str, i64)]| {
        String::from_utf8(nested_order(Uuid::new_v4(), 1, items)).expect("utf-8")
    };
    let lines = [
        String::from_utf8(nested_order(good, 1, &[("A-1", 2), ("B-2", 1)])).expect("utf-8"),
        order(&[("A-1", 1), ("B-2", 100)]),
        order(&[("A-1", 1), ("Z-9", 1)]),
        order(&[("A-1", 1)]).replace(r#""total":"12.50""#, r#""total":5000"#),
        order(&[("LONGER", 1)]),
        order(&[("A-1", 0)]),
        String::from_utf8(nested_order(stored, 1, &[("B-2", 1)])).expect("utf-8"),
    ];
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("orders.jsonl");
    std::fs::write(&path, lines.join("\n")).expect("write the lines");
    let path = path.to_str().expect("utf-8");
    let (code, out, err) = env
        .run_async(&[
            "--config",
            file.at(),
            "pipelines",
            "test",
            "orders",
            path,
            "--db",
        ])
        .await;
    assert_eq!(code, 1, "{out}{err}");
    let line = |n: usize| -> String {
        out.lines()
            .find(|l| l.starts_with(&format!("{n}: ")))
            .unwrap_or_else(|| panic!("no line {n}:\n{out}"))
            .to_string()
    };
    assert!(line(1).starts_with("1: ok "), "{out}");
    assert!(
        out.contains("db: ok, the parent row and 2 child rows written and rolled back"),
        "{out}"
    );
    for (n, words) in [
        (
            2,
            "db_permanent the database refuses it: 23514 new row for relation \"order_items\" \
             violates check constraint \"order_items_qty_check\" (table order_items, \
             constraint order_items_qty_check)",
        ),
        (
            3,
            "db_permanent the database refuses it: 23503 insert or update on table \
             \"order_items\" violates foreign key constraint \"order_items_sku_fkey\" (table \
             order_items, constraint order_items_sku_fkey): Key (sku)=(Z-9) is not present in \
             table \"skus\".",
        ),
        (
            4,
            "db_permanent the database refuses it: 23514 new row for relation \"orders\" \
             violates check constraint \"orders_total_check\" (table orders, constraint \
             orders_total_check)",
        ),
        (
            5,
            "db_permanent the database refuses it: 22001 value too long for type character \
             varying(5)",
        ),
        (
            6,
            "invalid_payload /items/0/qty: expected at least 1, found 0",
        ),
    ] {
        assert!(
            line(n).starts_with(&format!("{n}: {words}")),
            "line {n}:\n{out}"
        );
    }
    assert!(line(7).starts_with("7: ok "), "{out}");
    assert!(
        out.contains("db: not tried: its key is stored already"),
        "{out}"
    );
    assert!(out.contains("2 accepted, 5 refused"), "{out}");
    let held = || async {
        (
            count_of(&env, "SELECT count(*) FROM orders").await,
            count_of(&env, "SELECT count(*) FROM order_items").await,
            count_of(&env, "SELECT count(*) FROM skus").await,
        )
    };
    assert_eq!(held().await, (1, 1, 3), "the trial left rows behind");

    // Good lines only: exit 0, and still nothing stays.
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        lines[0].as_bytes(),
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("1 accepted, 0 refused"), "{out}");
    assert_eq!(held().await, (1, 1, 3), "the trial left rows behind");
}

/// What the run's commit refuses, the trial refuses (review R36h F10, R36i F1): a foreign key
/// and a constraint trigger `DEFERRABLE INITIALLY DEFERRED` (checked at a commit, which a trial
/// never makes), and a child table's BEFORE INSERT trigger that discards a row (the run parks
/// the message whole). Each was "ok" before; a good order still is.
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_refuses_what_deferred_constraints_and_discarding_triggers_refuse() {
    let env = TestEnv::new("tools_test_deferred").await;
    let names = PipelineNames::of(&env, "orders");
    create_nested_tables(&env).await;
    env.db
        .batch_execute(
            "CREATE TABLE skus (sku text PRIMARY KEY);
             INSERT INTO skus VALUES ('A-1'), ('B-2');
             ALTER TABLE order_items ADD FOREIGN KEY (sku) REFERENCES skus
                 DEFERRABLE INITIALLY DEFERRED;
             CREATE FUNCTION discard_14() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN IF NEW.qty = 14 THEN RETURN NULL; END IF; RETURN NEW; END $$;
             CREATE TRIGGER discard_14 BEFORE INSERT ON order_items
                 FOR EACH ROW EXECUTE FUNCTION discard_14();
             CREATE FUNCTION refuse_15() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN IF NEW.qty = 15 THEN
                     RAISE EXCEPTION 'deferred refusal of qty 15' USING ERRCODE = '23514';
                 END IF; RETURN NULL; END $$;
             CREATE CONSTRAINT TRIGGER refuse_15 AFTER INSERT ON order_items
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_15();",
        )
        .await
        .expect("the deferred constraints and triggers");
    let file = ConfigFile::new(&nested_toml(&names, ""));
    let order = |items: &[(&str, i64)]| {
        String::from_utf8(nested_order(Uuid::new_v4(), 1, items)).expect("utf-8")
    };
    let lines = [
        order(&[("A-1", 2), ("B-2", 1)]),
        order(&[("A-1", 1), ("Z-9", 1)]),
        order(&[("A-1", 14)]),
        order(&[("B-2", 15)]),
    ];
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        lines.join("\n").as_bytes(),
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    let line = |n: usize| -> String {
        out.lines()
            .find(|l| l.starts_with(&format!("{n}: ")))
            .unwrap_or_else(|| panic!("no line {n}:\n{out}"))
            .to_string()
    };
    assert!(line(1).starts_with("1: ok "), "{out}");
    for (n, words) in [
        (
            2,
            "db_permanent the database refuses it: 23503 insert or update on table \
             \"order_items\" violates foreign key constraint \"order_items_sku_fkey\"",
        ),
        (
            3,
            "db_permanent the database refuses it: 23000 a trigger of order_items discarded 1 \
             of the 1 child rows written",
        ),
        (
            4,
            "db_permanent the database refuses it: 23514 deferred refusal of qty 15",
        ),
    ] {
        assert!(
            line(n).starts_with(&format!("{n}: {words}")),
            "line {n}:\n{out}"
        );
    }
    assert!(out.contains("1 accepted, 3 refused"), "{out}");
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM orders").await,
        0,
        "the trial left rows behind"
    );
}

/// Review R41b F7: with `on_conflict = "update"`, the pipeline deletes the child rows a key
/// holds before it writes the message's (rows left without their order, on a table no foreign
/// key guards); a child table's guard that keeps a shipped line (a BEFORE DELETE trigger
/// returning NULL) makes the run park the message whole, and `pipelines test --db` says so in
/// the run's words, naming how many rows the trigger kept; an order whose lines may go is ok.
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_refuses_an_order_whose_old_items_a_guard_keeps() {
    let env = TestEnv::new("tools_test_kept").await;
    let names = PipelineNames::of(&env, "orders");
    create_nested_tables(&env).await;
    let (shipped, open) = (Uuid::new_v4(), Uuid::new_v4());
    env.db
        .batch_execute(&format!(
            "ALTER TABLE order_items DROP CONSTRAINT order_items_order_id_fkey;
             CREATE FUNCTION keep_shipped() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN IF OLD.sku = 'SHIPPED' THEN RETURN NULL; END IF; RETURN OLD; END $$;
             CREATE TRIGGER keep_shipped BEFORE DELETE ON order_items
                 FOR EACH ROW EXECUTE FUNCTION keep_shipped();
             INSERT INTO order_items (order_id, line, sku, qty) VALUES
                 ('{shipped}', 1, 'A-1', 1), ('{shipped}', 2, 'SHIPPED', 1),
                 ('{open}', 1, 'A-1', 1);"
        ))
        .await
        .expect("the guard and the rows left behind");
    let file = ConfigFile::new(&nested_toml(
        &names,
        "on_conflict = \"update\"\nversion_column = \"version\"",
    ));
    let order = |id: Uuid| String::from_utf8(nested_order(id, 2, &[("B-2", 1)])).expect("utf-8");
    let lines = [order(shipped), order(open)];
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        lines.join("\n").as_bytes(),
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.lines().any(|l| l.starts_with(
            "1: db_permanent the database refuses it: 23000 a trigger or rule of order_items kept 1 of \
             the 2 rows the message removes"
        )),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("2: ok ")), "{out}");
    assert_eq!(
        nested_items(&env, open).await,
        vec![(1, "A-1".to_string(), 1)],
        "the trial left its rows behind"
    );
}

/// Review R41b F14: with `update` and a BEFORE INSERT trigger that folds the key
/// (`lower(email)`), `pipelines test --db` refused a message whose key as sent was not stored
/// but whose folded key was (the plain insert's unique violation), and refused a new key's
/// message as "a BEFORE trigger rewrote its key", where the run stores a newer version, finds an
/// older one stale and writes a new key. Now a stored folded key is "not tried: its key is
/// stored already", and a new key is ok.
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_takes_a_key_a_trigger_folds_as_the_run_does() {
    let env = TestEnv::new("tools_test_folded").await;
    let names = PipelineNames::of(&env, "people");
    env.db
        .batch_execute(
            "CREATE TABLE people (email text PRIMARY KEY, v int8 NOT NULL, name text NOT NULL);
             CREATE FUNCTION fold_email() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN NEW.email := lower(NEW.email); RETURN NEW; END $$;
             CREATE TRIGGER fold_email BEFORE INSERT ON people
               FOR EACH ROW EXECUTE FUNCTION fold_email();
             INSERT INTO people VALUES ('ann@x.org', 2, 'Ann');",
        )
        .await
        .expect("the table, its trigger and a stored row");
    let file = ConfigFile::new(&format!(
        "[[pipelines]]\nname = \"people\"\ntable = \"people\"\nkey = [\"email\"]\n\
         on_conflict = \"update\"\nversion_column = \"v\"\nretry_ttls_ms = [1000]\n{}\
         [pipelines.columns]\nemail = {{ path = \"/email\", type = \"text\" }}\n\
         v = {{ path = \"/v\", type = \"int8\" }}\nname = {{ path = \"/name\", type = \"text\" }}\n",
        names.toml()
    ));
    let lines = [
        r#"{"email":"Ann@X.org","v":1,"name":"Old"}"#,
        r#"{"email":"Ann@X.org","v":3,"name":"New"}"#,
        r#"{"email":"Bob@X.org","v":1,"name":"Bob"}"#,
    ];
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "people", "--db"],
        lines.join("\n").as_bytes(),
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("3 accepted, 0 refused"), "{out}");
    assert_eq!(
        out.matches("not tried: its key is stored already").count(),
        2,
        "{out}"
    );
    assert!(out.contains("db: ok"), "{out}");
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM people").await,
        1,
        "the trial left rows behind"
    );
}

/// Review R42a F2: a trigger that refuses a row with a plain `RAISE EXCEPTION` (P0001, a code
/// warren cannot class) is retried by the run, in place and through the retry queue, and then
/// parked `retries_exhausted`; `pipelines test --db` said `db_permanent`. It says what the run
/// does; a refusal of a known class (23514) is still `db_permanent`.
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_names_a_raise_as_the_run_parks_it() {
    let env = TestEnv::new("tools_test_raise").await;
    let names = PipelineNames::of(&env, "orders");
    create_nested_tables(&env).await;
    env.db
        .batch_execute(
            "CREATE FUNCTION refuse_qty() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                   IF NEW.qty = 66 THEN RAISE EXCEPTION 'no 66'; END IF;
                   IF NEW.qty = 67 THEN
                     RAISE EXCEPTION 'no 67' USING ERRCODE = '23514';
                   END IF;
                   RETURN NEW;
                 END $$;
             CREATE TRIGGER refuse_qty BEFORE INSERT ON order_items
                 FOR EACH ROW EXECUTE FUNCTION refuse_qty();",
        )
        .await
        .expect("the trigger");
    let file = ConfigFile::new(&nested_toml(&names, ""));
    let order = |qty: i64| {
        String::from_utf8(nested_order(Uuid::new_v4(), 1, &[("A-1", qty)])).expect("utf-8")
    };
    let lines = [order(66), order(67), order(1)];
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        lines.join("\n").as_bytes(),
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.lines().any(|l| l
            .starts_with("1: retries_exhausted the database refuses it: P0001 no 66")
            && l.contains("a code warren retries")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("2: db_permanent the database refuses it: 23514 no 67")),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("3: ok ")), "{out}");
}

/// Review R40b F4: a parent table's BEFORE trigger that writes the row into an inheritance
/// child itself and returns NULL (classic trigger partitioning) stores the row where the table
/// shows it, as the run finds it; `pipelines test --db` said it was discarded (and the API's
/// pre-check answered 422 for every new key). A row the trigger drops is still refused.
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_takes_a_row_a_trigger_routes_into_an_inheritance_child() {
    let env = TestEnv::new("tools_test_routed").await;
    let names = PipelineNames::of(&env, "orders");
    env.db
        .batch_execute(
            "CREATE TABLE orders (order_id uuid PRIMARY KEY, total numeric NOT NULL,
                 version int8 NOT NULL);
             CREATE TABLE order_items (order_id uuid NOT NULL, line int4 NOT NULL,
                 sku text NOT NULL, qty int4 NOT NULL, PRIMARY KEY (order_id, line));
             CREATE TABLE orders_big (PRIMARY KEY (order_id)) INHERITS (orders);
             CREATE FUNCTION route_big() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                     IF NEW.total >= 1000 THEN RETURN NULL; END IF;
                     IF NEW.total >= 100 THEN
                         INSERT INTO orders_big VALUES (NEW.*); RETURN NULL;
                     END IF;
                     RETURN NEW;
                 END $$;
             CREATE TRIGGER route_big BEFORE INSERT ON orders
                 FOR EACH ROW EXECUTE FUNCTION route_big();",
        )
        .await
        .expect("the routed tables");
    let file = ConfigFile::new(&nested_toml(&names, ""));
    let order = |total: &str| {
        format!(
            r#"{{"order_id":"{}","total":"{total}","version":1,"items":[{{"sku":"A-1","qty":2}}]}}"#,
            Uuid::new_v4()
        )
    };
    let lines = [order("12.50"), order("500"), order("5000")];
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        lines.join("\n").as_bytes(),
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    let line = |n: usize| -> String {
        out.lines()
            .find(|l| l.starts_with(&format!("{n}: ")))
            .unwrap_or_else(|| panic!("no line {n}:\n{out}"))
            .to_string()
    };
    assert!(line(1).starts_with("1: ok "), "{out}");
    assert!(line(2).starts_with("2: ok "), "{out}");
    assert!(
        line(3).contains("discarded"),
        "a row the trigger drops is refused:\n{out}"
    );
    assert!(out.contains("2 accepted, 1 refused"), "{out}");
    assert_eq!(
        count_of(&env, "SELECT count(*) FROM orders").await,
        0,
        "the trial left rows behind"
    );
}

/// Review R38-F4: a parent table's BEFORE trigger that rewrites the key, with `on_conflict =
/// "update"` and child tables: the run refuses such a message whole, "a BEFORE trigger of
/// orders rewrote its key"; `pipelines test --db` said `ok` for an order without items, and
/// named the child table for one with items. Both are refused now in the run's words.
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_refuses_a_rewritten_key_in_the_runs_words() {
    let env = TestEnv::new("tools_test_rekey").await;
    let names = PipelineNames::of(&env, "orders");
    create_nested_tables(&env).await;
    env.db
        .batch_execute(
            "CREATE FUNCTION rekey() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN NEW.order_id := gen_random_uuid(); RETURN NEW; END $$;
             CREATE TRIGGER rekey BEFORE INSERT ON orders
                 FOR EACH ROW WHEN (NEW.total = 99) EXECUTE FUNCTION rekey();",
        )
        .await
        .expect("the trigger");
    let file = ConfigFile::new(&nested_toml(
        &names,
        "on_conflict = \"update\"\nversion_column = \"version\"",
    ));
    let order = |total: &str, items: &str| {
        format!(
            r#"{{"order_id":"{}","total":"{total}","version":1,"items":[{items}]}}"#,
            Uuid::new_v4()
        )
    };
    let lines = [
        order("12.50", r#"{"sku":"A-1","qty":1}"#),
        order("99", ""),
        order("99", r#"{"sku":"A-1","qty":1}"#),
    ];
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        lines.join("\n").as_bytes(),
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    let line = |n: usize| -> String {
        out.lines()
            .find(|l| l.starts_with(&format!("{n}: ")))
            .unwrap_or_else(|| panic!("no line {n}:\n{out}"))
            .to_string()
    };
    assert!(line(1).starts_with("1: ok "), "{out}");
    for n in [2, 3] {
        assert!(
            line(n).starts_with(&format!(
                "{n}: db_permanent the database refuses it: 23000 the row its write stored is \
                 not under the key it sends"
            )) && line(n).contains("a BEFORE trigger of orders rewrote its key"),
            "line {n}:\n{out}"
        );
    }
    assert!(out.contains("1 accepted, 2 refused"), "{out}");
    assert_eq!(count_of(&env, "SELECT count(*) FROM orders").await, 0);
}

/// What `warren run` refuses at its start, `pipelines test --db` refuses first, in the same
/// words and exit code (review R37x F3: with a DEFERRABLE primary key, which ON CONFLICT cannot
/// take, every line was "ok", and the run then exited 2).
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_refuses_a_table_the_run_refuses() {
    let env = TestEnv::new("tools_test_deferrable").await;
    let names = PipelineNames::of(&env, "orders");
    env.db
        .batch_execute(
            "CREATE TABLE orders (
                order_id uuid PRIMARY KEY DEFERRABLE,
                total numeric NOT NULL,
                version int8 NOT NULL
            );
            CREATE TABLE order_items (
                order_id uuid NOT NULL,
                line int4 NOT NULL,
                sku text NOT NULL,
                qty int4 NOT NULL,
                PRIMARY KEY (order_id, line)
            )",
        )
        .await
        .expect("the tables");
    let file = ConfigFile::new(&nested_toml(&names, ""));
    let line = String::from_utf8(nested_order(Uuid::new_v4(), 1, &[("A-1", 2)])).expect("utf-8");
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        line.as_bytes(),
    )
    .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("neither partial, DEFERRABLE nor invalid"),
        "the run's words:\n{out}{err}"
    );
    assert!(!out.contains("1: ok"), "{out}");
    let run = env
        .command(&["--config", file.at(), "run", "--roles", "consumer"])
        .output()
        .expect("run");
    let run_err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{run_err}");
    assert!(
        run_err.contains("neither partial, DEFERRABLE nor invalid"),
        "{run_err}"
    );
    // The index there is named, with why it cannot serve (review R40b F12: "found: none").
    assert!(
        run_err.contains("(found: none); expected")
            && run_err.contains("unusable: orders_pkey (order_id), DEFERRABLE"),
        "{run_err}"
    );
}

/// Review R39-F13 and F11: a key covered only by an invalid unique index (left by a failed
/// `CREATE UNIQUE INDEX CONCURRENTLY`: it enforces nothing, and every copy was stored again),
/// and a materialized view as the table (the run held on a systemic error), are refused by the
/// start's check, so by `--db` and `run` alike (exit 2).
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_refuses_an_invalid_key_index_and_a_materialized_view() {
    let env = TestEnv::new("tools_test_invalid").await;
    let names = PipelineNames::of(&env, "orders");
    env.db
        .batch_execute(
            "CREATE TABLE orders (order_id uuid, total numeric NOT NULL, version int8 NOT NULL);
             CREATE TABLE order_items (order_id uuid NOT NULL, line int4 NOT NULL,
                 sku text NOT NULL, qty int4 NOT NULL, PRIMARY KEY (order_id, line));
             INSERT INTO orders VALUES ('00000000-0000-0000-0000-000000000001', 1, 1),
                                       ('00000000-0000-0000-0000-000000000001', 1, 1);",
        )
        .await
        .expect("the tables");
    let failed = env
        .db
        .batch_execute("CREATE UNIQUE INDEX CONCURRENTLY orders_id ON orders (order_id)")
        .await;
    assert!(failed.is_err(), "the duplicate makes the index invalid");
    env.db
        .batch_execute("DELETE FROM orders")
        .await
        .expect("emptied");
    let file = ConfigFile::new(&nested_toml(&names, ""));
    let line = String::from_utf8(nested_order(Uuid::new_v4(), 1, &[("A-1", 2)])).expect("utf-8");
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        line.as_bytes(),
    )
    .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("nor invalid"), "{out}{err}");

    env.db
        .batch_execute(
            "DROP TABLE orders;
             CREATE TABLE orders_src (order_id uuid PRIMARY KEY, total numeric, version int8);
             CREATE MATERIALIZED VIEW orders AS SELECT * FROM orders_src;
             CREATE UNIQUE INDEX ON orders (order_id);",
        )
        .await
        .expect("the materialized view");
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        line.as_bytes(),
    )
    .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("orders is a materialized view"), "{out}{err}");

    // A rule ON INSERT on a child table (R39-F10's rule variant: ON CONFLICT cannot run
    // through it, and DO INSTEAD takes the rows unseen): refused by --db and run alike.
    env.db
        .batch_execute(
            "DROP MATERIALIZED VIEW orders;
             CREATE TABLE orders (order_id uuid PRIMARY KEY, total numeric NOT NULL,
                 version int8 NOT NULL);
             CREATE TABLE items_elsewhere (LIKE order_items);
             CREATE RULE items_away AS ON INSERT TO order_items
                 DO INSTEAD INSERT INTO items_elsewhere VALUES (NEW.*);",
        )
        .await
        .expect("the rule");
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        line.as_bytes(),
    )
    .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("order_items has the rule \"items_away\" ON INSERT"),
        "{out}{err}"
    );
    let run = env
        .command(&["--config", file.at(), "run", "--roles", "consumer"])
        .output()
        .expect("run");
    let run_err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{run_err}");
    assert!(run_err.contains("ON INSERT"), "{run_err}");
}

/// Found by review (R36-e): with `on_conflict = "update"`, `pipelines test --db` of a newer
/// version of a stored key wrote it (the upsert updated the live row and the delete took its
/// child rows, rolled back after): for the length of the trial it held the rows the running
/// pipeline writes to, and passed them to their UPDATE and DELETE triggers. A stored key is
/// now only read: here a lock on the stored row (a writer of the pipeline's, mid-transaction)
/// does not hold the trial up, the line says it was not tried, and the rows are as they were.
#[tokio::test(flavor = "multi_thread")]
async fn pipelines_test_db_only_reads_a_stored_key() {
    let env = TestEnv::new("tools_test_db_ro").await;
    let names = PipelineNames::of(&env, "orders");
    create_nested_tables(&env).await;
    let file = ConfigFile::new(&nested_toml(
        &names,
        "on_conflict = \"update\"\nversion_column = \"version\"",
    ));
    let stored = Uuid::new_v4();
    env.db
        .batch_execute(&format!(
            "INSERT INTO orders VALUES ('{stored}', 1, 1);
             INSERT INTO order_items VALUES ('{stored}', 1, 'A-1', 1)"
        ))
        .await
        .expect("a stored order");
    // Another writer holds the stored order's row, as the pipeline's transaction would.
    let (writer, connection) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .expect("a second connection");
    tokio::spawn(connection);
    writer
        .batch_execute(&format!(
            "SET search_path TO {}; BEGIN; \
             SELECT 1 FROM orders WHERE order_id = '{stored}' FOR NO KEY UPDATE",
            env.schema
        ))
        .await
        .expect("lock the stored row");
    let newer = String::from_utf8(nested_order(stored, 2, &[("B-2", 1)])).expect("utf-8");
    let started = std::time::Instant::now();
    let (code, out, err) = with_stdin(
        &env,
        &["--config", file.at(), "pipelines", "test", "orders", "--db"],
        newer.as_bytes(),
    )
    .await;
    let took = started.elapsed();
    writer.batch_execute("ROLLBACK").await.expect("unlock");
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(
            "db: not tried: its key is stored already (--db writes no row of a stored key)"
        ),
        "{out}"
    );
    assert!(took < Duration::from_secs(4), "waited {took:?} on the lock");
    assert_eq!(
        nested_items(&env, stored).await,
        [(1, "A-1".to_string(), 1)]
    );
}
