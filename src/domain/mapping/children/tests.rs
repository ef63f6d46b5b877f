//! A child table's spec and a message's elements: what compiles, and every way an element,
//! or the array, is refused, named by its path.

use super::super::{Cell, Mapping, MappingSpec};
use crate::domain::Domain;

fn spec(extra: &str, child_extra: &str) -> MappingSpec {
    toml::from_str(&format!(
        r#"
        table = "shop.orders"
        key = ["order_id"]
        {extra}
        [columns]
        order_id = {{ path = "/order_id", type = "uuid" }}
        total    = {{ path = "/total", type = "numeric", min = 0 }}
        version  = {{ path = "/version", type = "int8" }}

        [[children]]
        table = "shop.order_items"
        rows = "/items"
        key = ["order_id", "line"]
        {child_extra}
        [children.columns]
        order_id = {{ parent = "order_id" }}
        line     = {{ index = true }}
        sku      = {{ path = "/sku", type = "text", min_len = 1 }}
        qty      = {{ path = "/qty", type = "int4", min = 1 }}
        price    = {{ path = "/price", type = "numeric", optional = true }}
        "#
    ))
    .expect("spec")
}

fn mapping(extra: &str, child_extra: &str) -> Mapping {
    Mapping::compile("orders", &spec(extra, child_extra)).expect("compiles")
}

const ID: &str = "6f1c3c1e-8a4e-4f55-9a53-2d5e0b7f1a01";

fn order(items: &str) -> Vec<u8> {
    format!(r#"{{"order_id":"{ID}","total":"12.50","version":1,"items":{items}}}"#).into_bytes()
}

#[test]
fn each_element_is_a_row_with_the_parents_key_and_its_position() {
    let m = mapping("", "");
    let row = m
        .decode(&order(
            r#"[{"sku":"A-1","qty":2,"price":1.10},{"sku":"B-2","qty":1}]"#,
        ))
        .expect("valid");
    let id: uuid::Uuid = ID.parse().unwrap();
    assert_eq!(row.1.len(), 1, "one child table");
    // Columns by name: line, order_id, price, qty, sku.
    assert_eq!(
        row.1[0],
        vec![
            vec![
                Cell::Int4(1),
                Cell::Uuid(id),
                Cell::Numeric("1.10".into()),
                Cell::Int4(2),
                Cell::Text("A-1".into()),
            ],
            vec![
                Cell::Int4(2),
                Cell::Uuid(id),
                Cell::Null,
                Cell::Int4(1),
                Cell::Text("B-2".into()),
            ],
        ]
    );
    let empty = m.decode(&order("[]")).expect("no items is valid");
    assert_eq!(empty.1, vec![Vec::<Vec<Cell>>::new()]);
}

#[test]
fn an_element_failing_a_check_refuses_the_message_naming_its_path() {
    let m = mapping("", "");
    let r = m
        .decode(&order(r#"[{"sku":"A","qty":1},{"sku":"B","qty":0}]"#))
        .unwrap_err();
    assert_eq!(r.kind.as_str(), "invalid_payload");
    assert_eq!(r.reason, "/items/1/qty: expected at least 1, found 0");
    let r = m.decode(&order(r#"[{"sku":"","qty":"2"}]"#)).unwrap_err();
    assert_eq!(
        r.reason,
        "/items/0/sku: expected at least 1 characters, found 0; \
         /items/0/qty: expected an integer (int4), found the string \"2\"",
        "every element's problem, each by its path"
    );
    let r = m.decode(&order(r#"[{"qty":1}]"#)).unwrap_err();
    assert_eq!(r.reason, "/items/0/sku: missing (a text is required)");
    // With a parent column at fault too: the parent's first.
    let body =
        format!(r#"{{"order_id":"{ID}","total":-1,"version":1,"items":[{{"sku":"A","qty":0}}]}}"#);
    let r = m.decode(body.as_bytes()).unwrap_err();
    assert_eq!(
        r.reason, "total must be at least 0, found -1; /items/0/qty: expected at least 1, found 0",
        "a parent column in the words users' tests hold, an element by its path"
    );
}

/// Found by review (R36-a): two elements of one key (the child table's key columns equal)
/// passed decode, and the database refused the message with a unique violation naming neither
/// element. Refused at decode, naming both elements and the key.
#[test]
fn two_elements_of_one_child_key_refuse_the_message_naming_both() {
    let m = Mapping::compile(
        "orders",
        &toml::from_str::<MappingSpec>(
            r#"
            table = "shop.orders"
            key = ["order_id"]
            [columns]
            order_id = { path = "/order_id", type = "uuid" }
            [[children]]
            table = "shop.order_items"
            rows = "/items"
            key = ["order_id", "sku"]
            [children.columns]
            order_id = { parent = "order_id" }
            sku      = { path = "/sku", type = "text" }
            qty      = { path = "/qty", type = "int4" }
            "#,
        )
        .expect("spec"),
    )
    .expect("compiles");
    let body = |items: &str| format!(r#"{{"order_id":"{ID}","items":{items}}}"#).into_bytes();
    let r = m
        .decode(&body(
            r#"[{"sku":"A","qty":1},{"sku":"B","qty":2},{"sku":"A","qty":3}]"#,
        ))
        .unwrap_err();
    assert_eq!(r.kind.as_str(), "invalid_payload");
    assert_eq!(
        r.reason,
        format!(
            "/items/2: the same key as /items/0, (order_id, sku) = ({ID}, A): \
             shop.order_items holds one row per key"
        )
    );
    // Keys that differ (text by its bytes: a collation's equality is the database's) are rows.
    assert!(
        m.decode(&body(r#"[{"sku":"A","qty":1},{"sku":"a","qty":1}]"#))
            .is_ok()
    );
    // A parent column refused before the key (by name, `amount` < `order_id`) leaves the key's
    // value where a child column reads it (review R36i F3: the next column's value was shown).
    let with_amount = Mapping::compile(
        "orders",
        &toml::from_str::<MappingSpec>(
            r#"
            table = "shop.orders"
            key = ["order_id"]
            [columns]
            amount   = { path = "/amount", type = "int4", min = 1 }
            order_id = { path = "/order_id", type = "uuid" }
            zone     = { path = "/zone", type = "text", optional = true }
            [[children]]
            table = "shop.order_items"
            rows = "/items"
            key = ["order_id", "sku"]
            [children.columns]
            order_id = { parent = "order_id" }
            sku      = { path = "/sku", type = "text" }
            "#,
        )
        .expect("spec"),
    )
    .expect("compiles");
    let r = with_amount
        .decode(
            format!(
                r#"{{"amount":0,"order_id":"{ID}","zone":"z9","items":[{{"sku":"A"}},{{"sku":"A"}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap_err();
    assert!(
        r.reason.contains(&format!("(order_id, sku) = ({ID}, A)")),
        "{}",
        r.reason
    );
}

#[test]
fn rows_that_are_not_an_array_or_too_many_refuse_the_message() {
    let m = mapping("", "max_rows = 2");
    let r = m.decode(&order(r#"{"sku":"A"}"#)).unwrap_err();
    assert_eq!(
        r.reason,
        "/items: expected an array (the rows of shop.order_items), found an object"
    );
    let r = m
        .decode(&order(
            r#"[{"sku":"A","qty":1},{"sku":"B","qty":1},{"sku":"C","qty":1}]"#,
        ))
        .unwrap_err();
    assert_eq!(
        r.reason,
        "/items: holds 3 elements, more than the 2 rows of shop.order_items one message may \
         give (max_rows)"
    );
    let body = format!(r#"{{"order_id":"{ID}","total":1,"version":1}}"#);
    let r = m.decode(body.as_bytes()).unwrap_err();
    assert_eq!(
        r.reason,
        "/items: missing (an array is required: the rows of shop.order_items)"
    );
    let optional = mapping("", "optional = true");
    let row = optional.decode(body.as_bytes()).expect("optional rows");
    assert!(row.1[0].is_empty());
    let r = m.decode(&order(r#"[{"sku":"A","qty":1},7]"#)).unwrap_err();
    assert_eq!(
        r.reason,
        "/items/1: expected a JSON object (the columns of shop.order_items read its fields), \
         found the number 7"
    );
}

#[test]
fn unknown_fields_of_an_element_follow_the_pipelines_policy() {
    let m = mapping("", "");
    let r = m
        .decode(&order(r#"[{"sku":"A","qty":1,"colour":"red"}]"#))
        .unwrap_err();
    assert_eq!(
        r.reason,
        "/items/0/colour: unknown field (unknown_fields = \"reject\")"
    );
    let ignore = mapping("unknown_fields = \"ignore\"", "");
    assert!(
        ignore
            .decode(&order(r#"[{"sku":"A","qty":1,"colour":"red"}]"#))
            .is_ok()
    );
    // The array's own field is read: not unknown at the top level.
    assert!(m.decode(&order(r#"[{"sku":"A","qty":1}]"#)).is_ok());
    // Every unknown field is named, the top level's and the elements' (review R36g F5: the
    // top level's alone were), with the columns' other problems.
    let body = format!(
        r#"{{"order_id":"{ID}","total":1,"version":"x","coupon":"X","items":[{{"sku":"A","qty":1,"colour":"red"}}]}}"#
    );
    let r = m.decode(body.as_bytes()).unwrap_err();
    assert_eq!(
        r.reason,
        "unknown field /coupon (unknown_fields = \"reject\"); /version: expected an integer \
         (int8), found the string \"x\"; /items/0/colour: unknown field (unknown_fields = \
         \"reject\")"
    );
    // An element's unknown field with the element's other problems (review R36h F1), and a
    // top-level field's name as a JSON Pointer (review R36h F2).
    let body = format!(
        r#"{{"order_id":"{ID}","total":1,"version":1,"c/d":1,"items":[{{"qty":"s","x":1}}]}}"#
    );
    let r = m.decode(body.as_bytes()).unwrap_err();
    assert_eq!(
        r.reason,
        "unknown field /c~1d (unknown_fields = \"reject\"); /items/0/x: unknown field \
         (unknown_fields = \"reject\"); /items/0/qty: expected an integer (int4), found the \
         string \"s\"; /items/0/sku: missing (a text is required)"
    );
    // A delete's unknown field with its other problems (review R36h F8).
    let deletes = mapping(
        "on_conflict = \"update\"\nversion_column = \"version\"\n\
         delete = { field = \"/op\", value = \"delete\" }",
        "",
    );
    let body = format!(r#"{{"order_id":"{ID}","op":"delete","version":"x","zz":1}}"#);
    let r = deletes.decode(body.as_bytes()).unwrap_err();
    assert_eq!(
        r.reason,
        "unknown field /zz (unknown_fields = \"reject\"); /version: expected an integer \
         (int8), found the string \"x\" (a delete)"
    );
}

/// Review R36f F10: two child tables filled from one array read its elements' fields between
/// them; a field one reads is not unknown to the other (every message was refused).
#[test]
fn child_tables_of_one_array_share_its_known_fields() {
    let spec: MappingSpec = toml::from_str(
        r#"
        table = "shop.orders"
        key = ["order_id"]
        [columns]
        order_id = { path = "/order_id", type = "uuid" }
        total    = { path = "/total", type = "numeric" }
        version  = { path = "/version", type = "int8" }
        [[children]]
        table = "shop.order_items"
        rows = "/items"
        key = ["order_id", "line"]
        [children.columns]
        order_id = { parent = "order_id" }
        line     = { index = true }
        qty      = { path = "/qty", type = "int4" }
        [[children]]
        table = "shop.order_skus"
        rows = "/items"
        key = ["order_id", "sku"]
        [children.columns]
        order_id = { parent = "order_id" }
        sku      = { path = "/sku", type = "text" }
        "#,
    )
    .expect("spec");
    let m = Mapping::compile("orders", &spec).expect("compiles");
    assert!(m.decode(&order(r#"[{"sku":"A","qty":1}]"#)).is_ok());
    let r = m
        .decode(&order(r#"[{"sku":"A","qty":1,"colour":"red"}]"#))
        .unwrap_err();
    assert!(
        r.reason.starts_with("/items/0/colour: unknown field"),
        "{}",
        r.reason
    );
}

#[test]
fn a_child_spec_that_cannot_work_is_refused_naming_the_table_and_column() {
    let refused = |child: &str| {
        let text = format!(
            r#"
            table = "orders"
            key = ["order_id"]
            [columns]
            order_id = {{ path = "/id", type = "uuid" }}
            [[children]]
            {child}
            "#
        );
        let spec: MappingSpec = toml::from_str(&text).expect("parses");
        Mapping::compile("orders", &spec).unwrap_err().to_string()
    };
    let base = |rows: &str, key: &str, cols: &str| {
        format!("table = \"items\"\nrows = \"{rows}\"\nkey = {key}\n[children.columns]\n{cols}")
    };
    assert_eq!(
        refused(&base("/items", "[\"line\"]", "line = { index = true }")),
        "pipeline orders: children.items: columns: no column carries the parent's key column \
         order_id (expected one such as order_id = { parent = \"order_id\" }: a message's \
         stored child rows are found by it)"
    );
    assert_eq!(
        refused(&base("", "[\"id\"]", "id = { parent = \"order_id\" }")),
        "pipeline orders: children.items: rows: expected a JSON Pointer to an array inside the \
         body (\"/items\"), not \"\" (the whole body)"
    );
    assert!(
        refused(&base(
            "/items",
            "[\"id\"]",
            "id = { parent = \"order_id\" }\nsku = { path = \"/sku\" }"
        ))
        .contains("columns.sku: type: a path, header or property column needs a type")
    );
    assert!(
        refused(&base("/items", "[\"id\"]", "id = { parent = \"nope\" }"))
            .contains("columns.id: parent \"nope\" is not among the pipeline's columns")
    );
    assert!(
        refused(&base(
            "/items",
            "[\"id\"]",
            "id = { parent = \"order_id\", index = true }"
        ))
        .contains("columns.id: give one of path")
    );
    assert!(
        refused(&base(
            "/items",
            "[\"sku\"]",
            "id = { parent = \"order_id\" }"
        ))
        .contains("key: column \"sku\" is not among the columns")
    );
    assert!(
        refused(
            &format!(
                "{}\nmax_rows = 0",
                base("/items", "[\"id\"]", "id = { parent = \"order_id\" }")
            )
            .replace(
                "\n[children.columns]\nid = { parent = \"order_id\" }\nmax_rows = 0",
                "\nmax_rows = 0\n[children.columns]\nid = { parent = \"order_id\" }"
            )
        )
        .contains("max_rows: expected 1 to 100000, found 0")
    );
    let same_table = "table = \"orders\"\nrows = \"/items\"\nkey = [\"id\"]\n[children.columns]\nid = { parent = \"order_id\" }";
    assert!(refused(same_table).contains("table orders is written twice"));
}

#[test]
fn a_child_column_takes_its_default_and_a_bad_one_names_the_child_table() {
    let with = |qty: &str| -> MappingSpec {
        let text = format!(
            "table = \"shop.orders\"\nkey = [\"order_id\"]\n\
             [columns]\norder_id = {{ path = \"/order_id\", type = \"uuid\" }}\n\
             [[children]]\ntable = \"shop.order_items\"\nrows = \"/items\"\nkey = [\"order_id\", \"line\"]\n\
             [children.columns]\norder_id = {{ parent = \"order_id\" }}\nline = {{ index = true }}\n\
             qty = {{ path = \"/qty\", type = \"int4\", min = 1, {qty} }}\n"
        );
        toml::from_str(&text).expect("parses")
    };
    let m = Mapping::compile("orders", &with("default = 1")).expect("compiles");
    let body = format!(r#"{{"order_id":"{ID}","items":[{{}},{{"qty":4}}]}}"#);
    let row = m.decode(body.as_bytes()).expect("valid");
    assert_eq!(row.1[0][0][2], Cell::Int4(1));
    assert_eq!(row.1[0][1][2], Cell::Int4(4));
    let err = Mapping::compile("orders", &with("default = 0")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "pipeline orders: children.shop.order_items: columns.qty: default: expected at least 1, \
         found 0"
    );
}

#[test]
fn an_elements_one_of_or_pattern_refusal_starts_with_its_path() {
    let spec: MappingSpec = toml::from_str(
        "table = \"shop.orders\"\nkey = [\"order_id\"]\n\
         [columns]\norder_id = { path = \"/order_id\", type = \"uuid\" }\n\
         [[children]]\ntable = \"shop.order_items\"\nrows = \"/items\"\nkey = [\"order_id\", \"line\"]\n\
         [children.columns]\norder_id = { parent = \"order_id\" }\nline = { index = true }\n\
         unit = { path = \"/unit\", type = \"text\", one_of = [\"kg\", \"pc\"] }\n\
         sku = { path = \"/sku\", type = \"text\", pattern = \"^[A-Z]+-[0-9]+$\" }\n"
    )
    .expect("parses");
    let m = Mapping::compile("orders", &spec).expect("compiles");
    let body = format!(
        r#"{{"order_id":"{ID}","items":[{{"unit":"kg","sku":"A-1"}},{{"unit":"lb","sku":"a-1"}}]}}"#
    );
    let r = m.decode(body.as_bytes()).unwrap_err();
    assert_eq!(
        r.reason,
        "/items/1/unit: expected one of kg, pc, found lb; \
         /items/1/sku: expected a match of the pattern \"^[A-Z]+-[0-9]+$\", found a-1"
    );
}

/// A child column may read a property of the message, as a parent column does: the message's,
/// the same in each element's row; absent, its default, NULL when optional, else refused
/// naming the property. Its type must fit the property.
#[test]
fn a_child_column_reads_a_property_of_the_message_for_each_element() {
    use crate::domain::Envelope;
    let with = |columns: &str| {
        let text = format!(
            r#"
            table = "shop.orders"
            key = ["order_id"]
            [columns]
            order_id = {{ path = "/order_id", type = "uuid" }}
            [[children]]
            table = "shop.order_items"
            rows = "/items"
            key = ["order_id", "line"]
            [children.columns]
            order_id = {{ parent = "order_id" }}
            line     = {{ index = true }}
            {columns}
            "#
        );
        let spec: MappingSpec = toml::from_str(&text).expect("spec");
        Mapping::compile("orders", &spec)
    };
    let m = with(
        r#"msg_id = { property = "message_id", type = "text" }
           sent = { property = "timestamp", type = "timestamptz", optional = true }
           route = { property = "routing_key", type = "text" }"#,
    )
    .expect("compiles");
    let body = format!(r#"{{"order_id":"{ID}","items":[{{}},{{}}]}}"#);
    let props = lapin::BasicProperties::default()
        .with_message_id("m-1".into())
        .with_timestamp(1_700_000_000);
    let envelope = Envelope {
        properties: &props,
        exchange: "shop",
        routing_key: "orders.eu",
    };
    let row = m
        .decode_envelope(body.as_bytes(), &envelope)
        .expect("valid");
    // Columns by name: line, msg_id, order_id, route, sent.
    let id: uuid::Uuid = ID.parse().unwrap();
    let element = |line: i32| {
        vec![
            Cell::Int4(line),
            Cell::Text("m-1".into()),
            Cell::Uuid(id),
            Cell::Text("orders.eu".into()),
            Cell::Timestamptz("2023-11-14T22:13:20Z".into()),
        ]
    };
    assert_eq!(row.1[0], vec![element(1), element(2)]);
    // Absent: the optional one NULL, the required one refused naming the property.
    let bare = lapin::BasicProperties::default();
    let envelope = Envelope {
        properties: &bare,
        exchange: "shop",
        routing_key: "orders.eu",
    };
    let refused = m
        .decode_envelope(body.as_bytes(), &envelope)
        .expect_err("no message id");
    assert!(
        refused
            .rejection
            .reason
            .contains("property message_id: missing (a text is required)"),
        "{}",
        refused.rejection.reason
    );
    // Without properties at all (decode of a body alone), as absent.
    assert!(m.decode(body.as_bytes()).is_err());
    // A type the property is not read as, or two sources, refused when it compiles.
    let e = with(r#"sent = { property = "timestamp", type = "text" }"#).unwrap_err();
    assert!(
        e.problem
            .contains("property timestamp is read as timestamptz, not text"),
        "{}",
        e.problem
    );
    let e = with(r#"x = { property = "type", path = "/x", type = "text" }"#).unwrap_err();
    assert!(e.problem.contains("give one of path"), "{}", e.problem);
}

/// Review R41b F12: a child key column mapped `optional = true` held NULLs, which a unique
/// index lets repeat: a message's rows `a, a` were taken for a copy of the stored `a, b`, acked
/// and stored nowhere. Such a key is refused where the mapping compiles, as the parent's is.
#[test]
fn an_optional_child_key_column_is_refused() {
    let spec = toml::from_str::<MappingSpec>(
        r#"
        table = "shop.orders"
        key = ["order_id"]
        [columns]
        order_id = { path = "/order_id", type = "uuid" }
        [[children]]
        table = "shop.order_items"
        rows = "/items"
        key = ["order_id", "code"]
        [children.columns]
        order_id = { parent = "order_id" }
        code     = { path = "/code", type = "text", optional = true }
        sku      = { path = "/sku", type = "text" }
        "#,
    )
    .expect("spec");
    let err = Mapping::compile("orders", &spec).unwrap_err().to_string();
    assert_eq!(
        err,
        "pipeline orders: children.shop.order_items: key: column \"code\" is optional; a key \
         is never NULL"
    );
}
