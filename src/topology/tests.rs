//! The topology's unit tests: rendering, drift and the names each pipeline declares.

use super::*;

#[test]
fn the_template_renders_the_documented_topology() {
    let t = Topology::from_settings(&Settings::defaults()).unwrap();
    let names: Vec<_> = t.exchanges.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        ["raffle_exchange", "raffle_retry_exchange", "raffle_dlx"]
    );
    assert!(t.exchanges.iter().all(|e| e.kind == "direct"));
    let main = &t.queues[0];
    assert_eq!(main.name, "raffle_queue");
    assert_eq!(
        main.arguments["x-dead-letter-exchange"],
        Arg::Str("raffle_dlx".into())
    );
    assert_eq!(
        main.arguments["x-dead-letter-routing-key"],
        Arg::Str("raffle_dlq".into())
    );
    let retry = &t.queues[1];
    assert_eq!(retry.name, "raffle_retry_10s");
    assert_eq!(retry.arguments["x-message-ttl"], Arg::Int(10_000));
    assert_eq!(
        retry.arguments["x-dead-letter-exchange"],
        Arg::Str("raffle_exchange".into())
    );
    assert_eq!(
        retry.arguments["x-dead-letter-routing-key"],
        Arg::Str("raffle_queue".into())
    );
    assert_eq!(t.queues[2].name, "raffle_dlq");
    assert!(t.queues[2].arguments.is_empty());
    assert_eq!(t.bindings.len(), 3);
    assert!(t.bindings.iter().all(|b| b.key() == b.queue));
}

/// Every resolved pipeline's objects, each with its own names and tiers: the built-in users
/// pipeline's from the settings, a file's from its entry (derived from its name).
#[test]
fn every_pipeline_renders_its_own_names_and_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.toml");
    std::fs::write(
        &path,
        "[[pipelines]]\nname = \"orders\"\ntable = \"orders\"\nkey = [\"id\"]\n\
         retry_ttls_ms = [1000, 60000]\n[pipelines.columns]\n\
         id = { path = \"/id\", type = \"uuid\" }\n",
    )
    .unwrap();
    let sources = crate::config::Sources {
        file: Some(path),
        use_env: false,
        ..Default::default()
    }
    .with_override("queue_type", "quorum");
    let s = Settings::load(&sources).unwrap();
    let t = Topology::from_settings(&s).unwrap();
    let queues: Vec<_> = t.queues.iter().map(|q| q.name.as_str()).collect();
    assert_eq!(
        queues,
        [
            "raffle_queue",
            "raffle_retry_10s",
            "raffle_dlq",
            "orders_queue",
            "orders_retry_1s",
            "orders_retry_1m",
            "orders_dlq"
        ]
    );
    assert!(t.queues.iter().all(|q| q.queue_type() == "quorum"));
    let orders = &t.queues[4];
    assert_eq!(orders.arguments["x-message-ttl"], Arg::Int(1000));
    assert_eq!(
        orders.arguments["x-dead-letter-routing-key"],
        Arg::Str("orders_queue".into())
    );
    assert_eq!(t.exchanges.len(), 6);
    assert_eq!(t.bindings.len(), 3 + 4);
    // A drift of a file's pipeline is advised in its entry's own keys, not the users
    // pipeline's settings (review R35e F9); users' queues keep theirs.
    let d = drift_of(orders, "x-message-ttl", "5000", "1000");
    assert!(
        d.hint.contains("pipelines.orders.retry_queue")
            && d.hint.contains("pipelines.orders.retry_ttls_ms")
            && !d.hint.contains("set RETRY_TTL_MS")
            && !d.hint.contains("give RETRY_QUEUE"),
        "{}",
        d.hint
    );
    let d = drift_of(
        &t.queues[3],
        "x-dead-letter-exchange",
        "elsewhere",
        "orders_dlx",
    );
    assert!(
        d.hint.contains("pipelines.orders.main_queue") && !d.hint.contains("*_QUEUE"),
        "{}",
        d.hint
    );
    let d = drift_of(&t.queues[1], "x-message-ttl", "5000", "10000");
    assert!(d.hint.contains("set RETRY_TTL_MS"), "{}", d.hint);
    // One pipeline alone, as `warren run --pipelines orders` declares it.
    let orders = s.pipeline("orders").unwrap();
    let alone = Topology::of(orders, Queues::of(&s)).unwrap();
    assert_eq!(alone.queues.len(), 4);
    assert_eq!(alone.exchanges[0].name, "orders_exchange");
}

#[test]
fn names_with_quotes_stay_inside_their_strings() {
    let t = Topology::from_settings(&with(&[("main_queue", "we\"ird\\q")])).unwrap();
    assert_eq!(t.queues[0].name, "we\"ird\\q");
}

#[test]
fn rabbitmq_drift_messages_are_read() {
    let text = "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received the value '10000' of type 'signedint' but current is the value '5000' of type 'signedint'";
    assert_eq!(
        parse_inequivalent(text).unwrap(),
        ("x-message-ttl".into(), "10000".into(), "5000".into())
    );
    let text = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received the value 'dlx' of type 'longstr' but current is none";
    assert_eq!(parse_inequivalent(text).unwrap().2, "(not set)");
    // Quorum queues (RabbitMQ 3.10): a delivery limit is shown bare, a missing argument as none.
    let text = "PRECONDITION_FAILED - inequivalent arg 'x-delivery-limit' for queue 'q' in vhost '/': received '5' but current is '20'";
    assert_eq!(
        parse_inequivalent(text).unwrap(),
        ("x-delivery-limit".into(), "5".into(), "20".into())
    );
    let text = "PRECONDITION_FAILED - inequivalent arg 'x-dead-letter-strategy' for queue 'q' in vhost '/': received none but current is the value 'at-least-once' of type 'longstr'";
    assert_eq!(
        parse_inequivalent(text).unwrap(),
        (
            "x-dead-letter-strategy".into(),
            NOT_SET.into(),
            "at-least-once".into()
        )
    );
    let text = "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'e' in vhost '/': received 'direct' but current is 'fanout'";
    assert_eq!(
        parse_inequivalent(text).unwrap(),
        ("type".into(), "direct".into(), "fanout".into())
    );
}

/// The settings of the defaults with `pairs` set (no environment).
pub(super) fn with(pairs: &[(&str, &str)]) -> Settings {
    let mut sources = crate::config::Sources {
        use_env: false,
        ..Default::default()
    };
    for (k, v) in pairs {
        sources = sources.with_override(k, *v);
    }
    Settings::load(&sources).unwrap()
}

fn args(q: &Queue) -> Vec<(String, String)> {
    q.arguments
        .iter()
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect()
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v: Vec<_> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    v.sort();
    v
}

#[test]
fn classic_queues_carry_no_quorum_argument() {
    let t = Topology::from_settings(&Settings::defaults()).unwrap();
    for q in &t.queues {
        assert_eq!(q.queue_type(), "classic");
        for arg in [
            "x-queue-type",
            "x-overflow",
            "x-dead-letter-strategy",
            "x-delivery-limit",
        ] {
            assert!(!q.arguments.contains_key(arg), "{q:?}");
        }
    }
    assert_eq!(
        describe_queue(&t.queues[2]),
        "queue raffle_dlq (classic, durable)"
    );
}

#[test]
fn the_quorum_topology() {
    let t = Topology::from_settings(&with(&[("queue_type", "quorum"), ("delivery_limit", "7")]))
        .unwrap();
    let names: Vec<_> = t.queues.iter().map(|q| q.name.as_str()).collect();
    assert_eq!(names, ["raffle_queue", "raffle_retry_10s", "raffle_dlq"]);
    assert!(t.queues.iter().all(|q| q.queue_type() == "quorum"));
    assert_eq!(
        args(&t.queues[0]),
        owned(&[
            ("x-dead-letter-exchange", "raffle_dlx"),
            ("x-dead-letter-routing-key", "raffle_dlq"),
            ("x-dead-letter-strategy", "at-least-once"),
            ("x-delivery-limit", "7"),
            ("x-overflow", "reject-publish"),
            ("x-queue-type", "quorum"),
        ])
    );
    assert_eq!(t.queues[0].arguments["x-delivery-limit"], Arg::Int(7));
    assert_eq!(
        args(&t.queues[1]),
        owned(&[
            ("x-dead-letter-exchange", "raffle_exchange"),
            ("x-dead-letter-routing-key", "raffle_queue"),
            ("x-dead-letter-strategy", "at-least-once"),
            ("x-message-ttl", "10000"),
            ("x-overflow", "reject-publish"),
            ("x-queue-type", "quorum"),
        ])
    );
    // The DLQ declares its own delivery limit (RabbitMQ 4 would otherwise give it 20).
    assert_eq!(
        args(&t.queues[2]),
        owned(&[("x-delivery-limit", "1000000"), ("x-queue-type", "quorum")])
    );
    assert_eq!(
        describe_queue(&t.queues[2]),
        "queue raffle_dlq (quorum, durable, x-delivery-limit=1000000)"
    );
    // 0 declares none.
    let t = Topology::from_settings(&with(&[
        ("queue_type", "quorum"),
        ("dlq_delivery_limit", "0"),
    ]))
    .unwrap();
    assert_eq!(args(&t.queues[2]), owned(&[("x-queue-type", "quorum")]));
    assert!(describe_queue(&t.queues[0]).starts_with("queue raffle_queue (quorum, durable, "));
}

#[test]
fn retry_tiers_are_one_queue_and_binding_each() {
    let t = Topology::from_settings(&with(&[("retry_ttls_ms", "1000,10000,60000")])).unwrap();
    let queues: Vec<_> = t
        .queues
        .iter()
        .map(|q| (q.name.as_str(), q.arguments.get("x-message-ttl").cloned()))
        .collect();
    assert_eq!(
        queues,
        [
            ("raffle_queue", None),
            ("raffle_retry_1s", Some(Arg::Int(1000))),
            ("raffle_retry_10s", Some(Arg::Int(10_000))),
            ("raffle_retry_1m", Some(Arg::Int(60_000))),
            ("raffle_dlq", None),
        ]
    );
    for q in &t.queues[1..4] {
        assert_eq!(
            q.arguments["x-dead-letter-exchange"],
            Arg::Str("raffle_exchange".into())
        );
        assert_eq!(
            q.arguments["x-dead-letter-routing-key"],
            Arg::Str("raffle_queue".into())
        );
    }
    let bindings: Vec<_> = t
        .bindings
        .iter()
        .map(|b| (b.exchange.as_str(), b.queue.as_str(), b.key()))
        .collect();
    assert_eq!(
        bindings,
        [
            ("raffle_exchange", "raffle_queue", "raffle_queue"),
            (
                "raffle_retry_exchange",
                "raffle_retry_1s",
                "raffle_retry_1s"
            ),
            (
                "raffle_retry_exchange",
                "raffle_retry_10s",
                "raffle_retry_10s"
            ),
            (
                "raffle_retry_exchange",
                "raffle_retry_1m",
                "raffle_retry_1m"
            ),
            ("raffle_dlx", "raffle_dlq", "raffle_dlq"),
        ]
    );
    // Quorum tiers get the quorum arguments, each.
    let t = Topology::from_settings(&with(&[
        ("retry_ttls_ms", "300,600"),
        ("queue_type", "quorum"),
    ]))
    .unwrap();
    assert_eq!(t.queues.len(), 4);
    for q in &t.queues[1..3] {
        assert_eq!(q.queue_type(), "quorum");
        assert_eq!(
            q.arguments["x-dead-letter-strategy"],
            Arg::Str("at-least-once".into())
        );
        assert!(!q.arguments.contains_key("x-delivery-limit"));
    }
}

fn drift_of(q: &Queue, argument: &str, existing: &str, wanted: &str) -> Drift {
    let mut d = Drift {
        object: format!("queue {}", q.name),
        argument: argument.into(),
        existing: existing.into(),
        wanted: wanted.into(),
        note: String::new(),
        hint: String::new(),
        delete_cmd: "rabbitmqctl delete_queue q".into(),
    };
    advise_queue(q, &mut d);
    d
}

#[test]
fn a_queue_of_the_other_type_is_named_as_such() {
    let quorum = Topology::from_settings(&with(&[("queue_type", "quorum")])).unwrap();
    let classic = Topology::from_settings(&Settings::defaults()).unwrap();
    // What RabbitMQ 3.10 reports for warren's main queue and DLQ of the other type.
    let d = drift_of(&quorum.queues[0], "x-overflow", NOT_SET, "reject-publish");
    assert!(
        d.note
            .starts_with("It looks like a classic queue, and QUEUE_TYPE=quorum"),
        "{}",
        d.note
    );
    assert_eq!(d.hint, "set QUEUE_TYPE=classic");
    let d = drift_of(
        &classic.queues[0],
        "x-dead-letter-strategy",
        "at-least-once",
        NOT_SET,
    );
    assert!(
        d.note
            .starts_with("It looks like a quorum queue, and QUEUE_TYPE=classic"),
        "{}",
        d.note
    );
    assert_eq!(d.hint, "set QUEUE_TYPE=quorum");
    let d = drift_of(&quorum.queues[2], "x-queue-type", NOT_SET, "quorum");
    assert!(d.note.starts_with("It is a classic queue"), "{}", d.note);
    let d = drift_of(&classic.queues[2], "x-queue-type", "quorum", NOT_SET);
    assert!(d.note.starts_with("It is a quorum queue"), "{}", d.note);
    let text = TopologyError::Drift(Box::new(d)).to_string();
    assert!(
        text.starts_with(
            "queue raffle_dlq exists with x-queue-type = quorum, but warren declares \
             x-queue-type = (not set).\nIt is a quorum queue, and QUEUE_TYPE=classic declares \
             classic queues: RabbitMQ never changes the type of an existing queue.\n\
             warren never deletes or changes an existing object."
        ),
        "{text}"
    );
    assert!(text.contains("(set QUEUE_TYPE=quorum)"), "{text}");
    // A quorum DLQ declared before warren declared its delivery limit.
    let d = drift_of(&quorum.queues[2], "x-delivery-limit", NOT_SET, "1000000");
    assert!(
        d.note
            .starts_with("warren declares a quorum DLQ with its delivery limit")
    );
    assert!(d.hint.contains("DLQ_DELIVERY_LIMIT=0"), "{}", d.hint);
    let d = drift_of(&quorum.queues[2], "x-delivery-limit", "50", "1000000");
    assert_eq!(d.hint, "set DLQ_DELIVERY_LIMIT to the existing value");
    // Same type, other values: the plain advice.
    let d = drift_of(&quorum.queues[0], "x-delivery-limit", "20", "7");
    assert_eq!(d.note, "");
    assert_eq!(d.hint, "set DELIVERY_LIMIT to the existing value");
    // A TTL on the main queue: no retry setting makes it match (review R35h F7).
    let d = drift_of(&classic.queues[0], "x-message-ttl", "1000", NOT_SET);
    assert!(
        d.hint
            .starts_with("warren declares no TTL on this queue (only its retry queues"),
        "{}",
        d.hint
    );
    let d = drift_of(&classic.queues[1], "x-message-ttl", "5000", "10000");
    assert_eq!(d.note, "");
    assert!(
        d.hint.contains("set RETRY_TTL_MS to the existing value"),
        "{}",
        d.hint
    );
}
