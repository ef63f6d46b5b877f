//! The checks across pipelines, after the one resolution step (`spec.rs`): names of exchanges
//! and queues no two pipelines share, child tables no other pipeline writes, tables a
//! pipeline with deletes shares with none, and none of warren's own tables written.

use std::collections::HashMap;

use super::spec::{PipelineSpec, on_entry};
use crate::config::{ConfigError, Settings};

/// No child table of a pipeline is written by another (below), and no table a pipeline with
/// deletes writes (its own or a child table) is written by another pipeline: a delete's tombstone is its pipeline's own (`tombstones_<pipeline>`), and the
/// other pipeline's writes never look there, so an older write of a deleted key through it
/// brought the row back, the delete lost (review R36f F11). Both sources can feed one pipeline
/// instead (bind both to its queue). Tables are told apart by their names, an unqualified
/// one taken in `DATABASE_SCHEMA` (the search path of warren's sessions).
pub(super) fn check_shared_tables(
    settings: &Settings,
    specs: &[PipelineSpec],
) -> Result<(), ConfigError> {
    // An unqualified name is the table of that name in `DATABASE_SCHEMA`, the one schema
    // warren's sessions search (review R38i F1: `orders` beside `shop.orders` with
    // `DATABASE_SCHEMA=shop` passed the check, and a deleted row came back).
    let normal = |t: &str| match t.contains('.') {
        true => t.to_string(),
        false => format!("{}.{t}", settings.database_schema),
    };
    let writes = |spec: &PipelineSpec| -> Vec<String> {
        std::iter::once(&spec.mapping.table)
            .chain(spec.mapping.children.iter().map(|c| &c.table))
            .map(|t| normal(t))
            .collect()
    };
    // The first table of `mine` another pipeline than `spec` writes, and that pipeline.
    let shared = |spec: &PipelineSpec, mine: &[String]| {
        specs
            .iter()
            .filter(|o| o.name != spec.name)
            .find_map(|o| Some((o, writes(o).into_iter().find(|t| mine.contains(t))?)))
    };
    // warren's own tables in `DATABASE_SCHEMA`: a pipeline that writes one corrupts what warren
    // keeps there (review R38-F10: a pipeline on another's tombstone table made that one's
    // writes `stale`, acked and never stored).
    let schema = &settings.database_schema;
    let mut own: Vec<(String, String)> = vec![
        (
            format!("{schema}.dead_letters"),
            "the parking table".to_string(),
        ),
        (
            format!("{schema}.refinery_schema_history"),
            "the migrations' history".to_string(),
        ),
    ];
    own.extend(
        specs
            .iter()
            .filter(|s| s.mapping.delete.is_some())
            .map(|s| {
                (
                    format!("{schema}.tombstones_{}", s.name),
                    format!("pipeline {}'s tombstones", s.name),
                )
            }),
    );
    // Every `tombstones_*` name there is warren's, a pipeline of this file or not (review
    // R39-F6: a file without pipeline P could write P's tombstones).
    let reserved = format!("{schema}.tombstones_");
    for spec in specs.iter().filter(|s| !s.builtin) {
        let mine = writes(spec);
        let found = own
            .iter()
            .find(|(t, _)| mine.contains(t))
            .cloned()
            .or_else(|| {
                mine.iter().find(|t| t.starts_with(&reserved)).map(|t| {
                    (
                        t.clone(),
                        "a name warren keeps for the tombstones of a pipeline with deletes"
                            .to_string(),
                    )
                })
            });
        if let Some((table, what)) = found {
            let error = ConfigError::Invalid {
                setting: format!("pipelines.{}.table", spec.name),
                expected: "tables of the pipeline's own, not one warren keeps in \
                           DATABASE_SCHEMA (dead_letters, refinery_schema_history, \
                           tombstones_<pipeline>)"
                    .to_string(),
                got: format!("table {table}, which is warren's own: {what}"),
            };
            return Err(at_entry(settings, spec, "table", error));
        }
    }
    for spec in specs.iter().filter(|s| s.mapping.delete.is_some()) {
        if let Some((other, table)) = shared(spec, &writes(spec)) {
            let error = ConfigError::Invalid {
                setting: format!("pipelines.{}.delete", spec.name),
                expected: format!(
                    "deletes in a pipeline whose tables no other pipeline writes: its tombstones \
                     are its own, and pipeline {}'s writes would not see them (an older write of \
                     a deleted key would bring its row back); feed both sources to one pipeline \
                     (bind them to its queue)",
                    other.name
                ),
                got: format!(
                    "table {table}, written by pipelines {} and {}",
                    spec.name, other.name
                ),
            };
            return Err(at_entry(settings, spec, "delete", error));
        }
    }
    // A child table is its pipeline's alone: an update replaces a key's child rows (another
    // pipeline's among them), and a copy's children are compared with what its key holds
    // (another pipeline's rows make it a conflict) (review R36g F2: two pipelines on one child
    // table, one's update deleted the other's rows, whose redelivery was parked).
    for spec in specs {
        let children: Vec<String> = spec
            .mapping
            .children
            .iter()
            .map(|c| normal(&c.table))
            .collect();
        if let Some((other, table)) = shared(spec, &children) {
            let error = ConfigError::Invalid {
                setting: format!("pipelines.{}.children", spec.name),
                expected: format!(
                    "child tables no other pipeline writes: a pipeline replaces and compares \
                     its keys' child rows, and pipeline {}'s rows there would be deleted or \
                     taken for a conflict",
                    other.name
                ),
                got: format!(
                    "table {table}, a child table of pipeline {} written by pipeline {}",
                    spec.name, other.name
                ),
            };
            return Err(at_entry(settings, spec, "children", error));
        }
    }
    Ok(())
}

/// No exchange or queue is used by two pipelines, or twice within one (exchanges and queues are
/// two name spaces of the broker). Of the two uses, the error blames the name someone wrote: a
/// key of a file's entry first, then a users naming setting given (`MAIN_QUEUE`, ...: the
/// loader names its file line, variable or flag), then a name derived from the pipeline's
/// (review R35h F2, R35i F2: a clash made by `WARREN_MAIN_QUEUE` was blamed on the first line
/// of an entry that writes no `main_queue`).
pub(super) fn check_shared_names(
    settings: &Settings,
    specs: &[PipelineSpec],
) -> Result<(), ConfigError> {
    let mut owner: HashMap<(bool, &str), (&PipelineSpec, &'static str)> = HashMap::new();
    for spec in specs {
        for (what, name) in spec.names.all() {
            let key = (what.ends_with("exchange"), name);
            if let Some(&(other, other_what)) = owner.get(&key)
                && (other.name != spec.name || other_what != what)
            {
                let this = (spec, what);
                let that = (other, other_what);
                let (blamed, also) = if written(settings, that) > written(settings, this) {
                    (that, this)
                } else {
                    (this, that)
                };
                return Err(clash(settings, name, blamed, also));
            }
            owner.insert(key, (spec, what));
        }
    }
    Ok(())
}

/// Who wrote a pipeline's name of an exchange or queue, in the order of blame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Written {
    /// Derived from the pipeline's name (`<name>_queue`), or a users naming setting left at
    /// its shipped value.
    Derived,
    /// A users naming setting given another value (a file's key, a variable, `--set`).
    Setting,
    /// A key of the pipeline's entry in a file.
    Entry,
}

/// Who wrote `field` (`main_queue`, ...) of `spec`.
fn written(settings: &Settings, (spec, field): (&PipelineSpec, &str)) -> Written {
    let entry = settings
        .pipelines
        .iter()
        .find(|p| p.name == spec.name && !spec.builtin);
    let in_entry = entry.is_some_and(|entry| match field {
        "main_exchange" => entry.main_exchange.is_some(),
        "main_queue" => entry.main_queue.is_some(),
        "retry_exchange" => entry.retry_exchange.is_some(),
        "retry_queue" => entry.retry_queue.is_some(),
        "dlx_exchange" => entry.dlx_exchange.is_some(),
        "dlq_queue" => entry.dlq_queue.is_some(),
        _ => false,
    });
    if in_entry {
        return Written::Entry;
    }
    // The users pipeline takes the naming settings for what its entry does not write.
    let shipped = crate::config::default_settings_toml()
        .parse::<toml::Table>()
        .ok()
        .and_then(|t| t.get(field).and_then(|v| v.as_str()).map(String::from));
    if spec.name == "users" && users_setting(settings, field) != shipped.as_deref() {
        return Written::Setting;
    }
    Written::Derived
}

/// The users naming setting `field` (`main_queue`, ...), as set now.
fn users_setting<'a>(settings: &'a Settings, field: &str) -> Option<&'a str> {
    Some(match field {
        "main_exchange" => &settings.main_exchange,
        "main_queue" => &settings.main_queue,
        "retry_exchange" => &settings.retry_exchange,
        "retry_queue" => &settings.retry_queue,
        "dlx_exchange" => &settings.dlx_exchange,
        "dlq_queue" => &settings.dlq_queue,
        _ => return None,
    })
}

/// The error of `name` used as `blamed` and as `also`, placed where `blamed` was written.
fn clash(
    settings: &Settings,
    name: &str,
    blamed: (&PipelineSpec, &'static str),
    also: (&PipelineSpec, &'static str),
) -> ConfigError {
    let ((spec, what), (other, other_what)) = (blamed, also);
    let (expected, got) = if other.name == spec.name {
        (
            "a name of its own, used by no other exchange or queue of a pipeline",
            format!("{name:?}, also its {other_what}"),
        )
    } else {
        (
            "a name no other pipeline uses for its exchanges and queues",
            format!("{name:?}, also the {other_what} of pipeline {}", other.name),
        )
    };
    if written(settings, blamed) == Written::Setting {
        // The users naming setting itself: the loader says where it was given.
        return ConfigError::Invalid {
            setting: what.to_string(),
            expected: expected.into(),
            got,
        };
    }
    let error = ConfigError::Invalid {
        setting: format!("pipelines.{}.{what}", spec.name),
        expected: expected.into(),
        got,
    };
    at_entry(settings, spec, what, error)
}

/// `error` about `spec`'s `field`, placed at its entry of the file when a file declares it (the
/// loader adds the file and the line), as it is for the built-in users pipeline.
fn at_entry(
    settings: &Settings,
    spec: &PipelineSpec,
    field: &str,
    error: ConfigError,
) -> ConfigError {
    match settings.pipelines.iter().position(|p| p.name == spec.name) {
        Some(index) if !spec.builtin => on_entry(index, field, error),
        _ => error,
    }
}
