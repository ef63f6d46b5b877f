//! The one resolution step: a pipeline's `[[pipelines]]` entry plus the defaults (and, for the
//! pipeline named users, its own `USERS_*` settings) become, once, when the configuration loads,
//! its complete and checked [`PipelineSpec`]. Every rule that spans fields or pipelines lives
//! here: the ranges of an entry's numbers, min <= max concurrency, the batch's minimum wait
//! within its timeout, auto's thresholds, the
//! prefetch and its cap, the rate against the consumer timeout, the retry queues' names, names
//! and tables shared by two pipelines (`shared.rs`, after this step: [`super::resolve`]), and
//! the inserts the pipelines that run always hold against the
//! budget ([`check_budget`], after `warren run --pipelines` kept the ones that run).

use std::collections::HashMap;
use std::time::Duration;

use super::{ApiKey, Names, PipelineConfig};

#[cfg(test)]
thread_local! {
    /// Each `(field, users' own setting, default setting)` [`Resolver::pick`] resolved on this
    /// thread: the test that ties the names spelt in `resolve` to `ENTRY_KEYS` reads them.
    pub(super) static PICKED: std::cell::RefCell<
        Vec<(&'static str, Option<&'static str>, &'static str)>,
    > = const { std::cell::RefCell::new(Vec::new()) };
}
use crate::config::{Balance, ConfigError, Origin, Rule, Settings, window_outlasts};
use crate::domain::mapping::{Mapping, MappingSpec, OnConflict};

/// A pipeline's HTTP API (docs/api.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Api {
    /// `api = true`: `POST /api/v1/<name>`, `PUT` and `GET /api/v1/<name>/<key>` are served.
    pub enabled: bool,
    /// Who gives a `POST` its key: the body, or the API.
    pub key: ApiKey,
    /// Whether the API asks the table before publishing.
    pub check: bool,
}

/// How a pipeline batches its inserts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batching {
    /// The largest batch (a free sink takes whatever waits, up to this many).
    pub size: usize,
    /// The longest a partial batch is held back for more messages: caps `min_wait`.
    pub timeout: Duration,
    /// How long a partial batch is held for more messages before a free sink takes it (zero:
    /// at once); at most `timeout`.
    pub min_wait: Duration,
    /// Processor actors (decode): one runs on the pipeline's thread; more on threads of their own.
    pub processors: usize,
    /// Batcher actors: the batch inserts in flight of a stage that is not balanced (the DLQ
    /// stage always), and the batchers a main stage has at least.
    pub concurrency: usize,
}

/// How a pipeline's batch inserts in flight follow its backlog (docs/balancing.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Balancing {
    /// `off` (fixed at the batch concurrency), `simple` or `auto`.
    pub strategy: Balance,
    /// The fewest batch inserts in flight when balanced (where `auto` starts).
    pub min: usize,
    /// The most batch inserts in flight when balanced.
    pub max: usize,
    /// Time between two decisions, so the concurrency never flaps.
    pub cooldown: Duration,
    /// `auto`: the most inserts in flight one decision adds or takes away.
    pub max_shift: usize,
    /// `simple`: messages of backlog per insert in flight.
    pub threshold: u64,
    /// `auto`: above this backlog per insert in flight, more is asked for.
    pub up_threshold: u64,
    /// `auto`: below this backlog per insert in flight (twice in a row), less.
    pub down_threshold: u64,
}

/// One pipeline, resolved: everything its stages, its topology, its API and the tools need,
/// each value taken once from its entry, the users pipeline's own settings or the defaults, and
/// checked. Nothing else reads a pipeline's settings. Compared whole by a reload to tell the
/// pipelines that changed.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineSpec {
    /// `users`, `orders`: the `pipeline` label of logs and metrics, what `--pipeline` names, what
    /// its parked rows are filed under.
    pub name: String,
    /// The built-in users pipeline (its entry from the shipped defaults, its names the
    /// `MAIN_QUEUE`, ... settings), not one of the file's.
    pub builtin: bool,
    /// The table, its key and its columns: what the mapping compiles.
    pub mapping: MappingSpec,
    /// Its HTTP API.
    pub api: Api,
    /// Its exchanges and queues, retry tiers included.
    pub names: Names,
    pub batching: Batching,
    pub balance: Balancing,
    /// The prefetch window of a stage at its batch concurrency (the DLQ stage; the main stage
    /// when not balanced): `prefetch`, or batch size x batch concurrency x 2, within
    /// `window_cap`.
    pub prefetch: u16,
    /// The main stage's window at start: [`Self::prefetch`], or when balanced batch size x
    /// min_concurrency x 2 within `window_cap` (it follows the concurrency from there).
    pub start_prefetch: u16,
    /// The most the window may be: `prefetch` when set, and what the byte budget holds of
    /// bodies of the largest accepted size (`MAX_INFLIGHT_BYTES / MAX_MESSAGE_BYTES`).
    pub window_cap: u16,
    /// The largest window the main stage uses on its own: [`Self::prefetch`] when not
    /// balanced; balanced, its window at its most inserts in flight ([`Self::most_inserts`]:
    /// batch size x that x 2, within `window_cap`), where the balancer takes it under backlog.
    /// What the rate is checked against and what `warren config` prints.
    pub most_prefetch: u16,
    /// Retries through the retry queue before a transient failure is dead-lettered.
    pub max_retries: u32,
    /// Attempts of the DLQ stage at a message the database keeps refusing before it parks it.
    pub dlq_max_attempts: u32,
    /// Messages taken per second at start (0: no limit); `warren ctl rate` changes it live.
    pub rate_limit_per_s: u32,
    /// Consecutive failing batches that open the main stage's breaker.
    pub breaker_failures: u32,
    /// Largest accepted body; larger ones are parked unread where they were refused.
    pub max_message_bytes: usize,
    /// Bytes of messages the pipeline holds at once, delivered and not yet settled.
    pub max_inflight_bytes: u64,
    /// How long a transient failure is retried in place.
    pub db_retry_window: Duration,
}

impl PipelineSpec {
    /// The table its rows go to.
    pub fn table(&self) -> &str {
        &self.mapping.table
    }

    /// The compiled mapping (it compiled when the configuration was resolved).
    pub fn mapping(&self) -> Result<Mapping, ConfigError> {
        Mapping::compile(&self.name, &self.mapping)
            .map_err(|e| ConfigError::Pipeline(e.to_string()))
    }

    /// The batch inserts in flight its main stage always holds: its batch concurrency when
    /// fixed, its minimum when balanced.
    pub fn held_inserts(&self) -> usize {
        match self.balance.strategy {
            Balance::Off => self.batching.concurrency,
            _ => self.balance.min,
        }
    }

    /// The most batch inserts in flight its main stage can have: the batchers it has
    /// (balanced up to `max_concurrency`, or moved there by an operator's bounds).
    pub fn most_inserts(&self) -> usize {
        self.batching.concurrency.max(self.balance.max)
    }

    /// At `per_s` messages a second (0 = no limit), whether the last delivery of its largest
    /// window ([`Self::most_prefetch`]) would wait in the rate limiter as long as `hand_back` (see
    /// [`crate::config::hand_back_after`]) or longer; that time if so. An error at load, a
    /// warning on `warren ctl rate`.
    pub fn window_outlasts(&self, per_s: u32, hand_back: Option<Duration>) -> Option<Duration> {
        window_outlasts(self.most_prefetch, per_s, hand_back)
    }
}

/// The pool `pipelines` need: `at_least` (`DATABASE_POOL_SIZE`), raised to a connection for
/// each insert that can be in flight (the main stages' most, within the process's `budget`,
/// and the DLQ stages' batch concurrency) and one more.
pub fn pool_size(pipelines: &[PipelineSpec], at_least: usize, budget: usize) -> usize {
    let most: usize = pipelines.iter().map(PipelineSpec::most_inserts).sum();
    let dlq: usize = pipelines.iter().map(|p| p.batching.concurrency).sum();
    at_least.max(most.min(budget) + dlq + 1)
}

/// Every pipeline `settings` runs, resolved and checked: the built-in users pipeline first
/// (unless a file's pipeline named users replaces it), then the file's, in its order. An error
/// names the pipeline and the field: an entry's key (the loader adds the file and line), or the
/// setting the value came from (the loader adds where it was given). `timeout_at` is where
/// `AMQP_CONSUMER_TIMEOUT_MS` was given, which an error about a batch timeout names.
pub fn resolve(settings: &Settings, timeout_at: &Origin) -> Result<Vec<PipelineSpec>, ConfigError> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (index, p) in settings.pipelines.iter().enumerate() {
        let invalid = |expected: &str, got: String| {
            on_entry(
                index,
                "name",
                ConfigError::Invalid {
                    setting: format!("pipelines[{index}].name"),
                    expected: expected.into(),
                    got,
                },
            )
        };
        if !is_name(&p.name) {
            return Err(invalid(
                "a name of a lower-case letter then up to 39 lower-case letters, digits or _",
                format!("{:?}", p.name),
            ));
        }
        if let Some(first) = seen.insert(&p.name, index) {
            return Err(invalid(
                "a name no other pipeline has",
                format!("{:?}, as pipelines[{first}]", p.name),
            ));
        }
    }
    let mut specs = Vec::new();
    if !seen.contains_key("users") {
        let users = super::users()?;
        specs.push(Entry::new(settings, &users, None, timeout_at).resolve()?);
    }
    for (index, p) in settings.pipelines.iter().enumerate() {
        specs.push(Entry::new(settings, p, Some(index), timeout_at).resolve()?);
    }
    Ok(specs)
}

/// The batch inserts `specs` always hold fit in `max_inserts_in_flight` (0: no such budget):
/// checked for the pipelines that run ([`Settings::check_inserts_budget`]).
pub fn check_budget(
    specs: &[PipelineSpec],
    max_inserts_in_flight: usize,
) -> Result<(), ConfigError> {
    let held: usize = specs.iter().map(PipelineSpec::held_inserts).sum();
    if max_inserts_in_flight > 0 && max_inserts_in_flight < held {
        let names: Vec<&str> = specs.iter().map(|p| p.name.as_str()).collect();
        return Err(ConfigError::Invalid {
            setting: "MAX_INSERTS_IN_FLIGHT".into(),
            expected: format!(
                "0 or at least the {held} batch inserts the pipelines that run ({}) always hold \
                 (each pipeline's batch concurrency, or its min_concurrency when balanced)",
                names.join(", ")
            ),
            got: max_inserts_in_flight.to_string(),
        });
    }
    Ok(())
}

/// An error about the `index`-th entry's `field` (a path in the entry, dot-separated; empty:
/// the entry as a whole): the loader adds the file and the line.
pub(super) fn on_entry(index: usize, field: &str, error: ConfigError) -> ConfigError {
    ConfigError::Entry {
        index,
        field: field
            .split('.')
            .filter(|f| !f.is_empty())
            .map(Into::into)
            .collect(),
        error: Box::new(error),
    }
}

/// Whether `name` is a pipeline name: `[a-z][a-z0-9_]{0,39}`.
fn is_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && name.len() <= 40
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// The range a setting of integers accepts.
fn range_of(key: &str) -> Option<(u64, u64)> {
    crate::config::RULES
        .iter()
        .find_map(|(k, rule)| match rule {
            Rule::Int { min, max } if *k == key => Some((*min, *max)),
            _ => None,
        })
}

/// Where a resolved value came from, so that a rule's error points there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// The pipeline's entry, under the key of the field.
    Entry,
    /// A setting: the users pipeline's own (`users_batch_size`) or the default (`batch_size`).
    Setting(&'static str),
}

/// A resolved value, the entry's key it stands for, and where it came from.
#[derive(Debug, Clone, Copy)]
struct Picked<T> {
    value: T,
    field: &'static str,
    source: Source,
}

/// One entry being resolved against the settings.
struct Entry<'a> {
    settings: &'a Settings,
    p: &'a PipelineConfig,
    /// Its place in the file's `[[pipelines]]`; `None` for the built-in users pipeline.
    index: Option<usize>,
    /// Where `AMQP_CONSUMER_TIMEOUT_MS` was given (an error about the batch timeout names it).
    timeout_at: &'a Origin,
}

impl<'a> Entry<'a> {
    fn new(
        settings: &'a Settings,
        p: &'a PipelineConfig,
        index: Option<usize>,
        timeout_at: &'a Origin,
    ) -> Self {
        Self {
            settings,
            p,
            index,
            timeout_at,
        }
    }

    /// How an error names the value's field: the entry's key, or the setting in upper case (the
    /// pipeline named after a default, which every pipeline shares).
    fn label<T>(&self, picked: &Picked<T>) -> String {
        match picked.source {
            Source::Entry => picked.field.to_string(),
            Source::Setting(key) => key.to_ascii_uppercase(),
        }
    }

    /// An error about `picked`: at the entry's key (`pipelines.orders.min_concurrency`), or at
    /// the setting it came from (`MIN_CONCURRENCY (pipeline orders)`, `USERS_MIN_CONCURRENCY`).
    fn refuse<T: ToString>(&self, picked: &Picked<T>, expected: String) -> ConfigError {
        self.refuse_with(
            picked.field,
            picked.source,
            expected,
            picked.value.to_string(),
        )
    }

    fn refuse_with(
        &self,
        field: &str,
        source: Source,
        expected: String,
        got: String,
    ) -> ConfigError {
        let name = &self.p.name;
        match source {
            Source::Entry => {
                let error = ConfigError::Invalid {
                    setting: format!("pipelines.{name}.{field}"),
                    expected,
                    got,
                };
                match self.index {
                    Some(index) => on_entry(index, field, error),
                    None => error,
                }
            }
            Source::Setting(key) => {
                let setting = key.to_ascii_uppercase();
                let own = key.starts_with("users_") && name == "users";
                ConfigError::Invalid {
                    setting: if own {
                        setting
                    } else {
                        format!("{setting} (pipeline {name})")
                    },
                    expected,
                    got,
                }
            }
        }
    }

    /// The value of `field`: the entry's, else the users pipeline's own setting `own` (for the
    /// pipeline named users), else the default `default`. The names given here are the third
    /// place the entry keys are spelt; a unit test holds them to [`super::ENTRY_KEYS`]
    /// ([`PICKED`]).
    fn pick<T: Copy>(
        &self,
        field: &'static str,
        given: Option<T>,
        own: Option<(&'static str, Option<T>)>,
        default: (&'static str, T),
    ) -> Picked<T> {
        #[cfg(test)]
        PICKED.with(|p| {
            p.borrow_mut()
                .push((field, own.as_ref().map(|o| o.0), default.0))
        });
        let (value, source) = match (given, own.filter(|_| self.p.name == "users")) {
            (Some(v), _) => (v, Source::Entry),
            (None, Some((key, Some(v)))) => (v, Source::Setting(key)),
            _ => (default.1, Source::Setting(default.0)),
        };
        Picked {
            value,
            field,
            source,
        }
    }

    /// An entry's number, checked against the range of the default it stands for.
    fn number(
        &self,
        field: &'static str,
        given: Option<u64>,
        own: Option<(&'static str, Option<u64>)>,
        default: (&'static str, u64),
    ) -> Result<Picked<u64>, ConfigError> {
        if let (Some(v), Some((min, max))) = (given, range_of(default.0))
            && (v < min || v > max)
        {
            return Err(self.refuse_with(
                field,
                Source::Entry,
                format!("an integer from {min} to {max}"),
                v.to_string(),
            ));
        }
        Ok(self.pick(field, given, own, default))
    }

    fn resolve(&self) -> Result<PipelineSpec, ConfigError> {
        let (s, p) = (self.settings, self.p);
        let wide = |v: usize| v as u64;
        let own = |key: &'static str, v: Option<usize>| Some((key, v.map(wide)));
        let size = self.number(
            "batch_size",
            p.batch_size,
            own("users_batch_size", s.users_batch_size),
            ("batch_size", wide(s.batch_size)),
        )?;
        let timeout = self.number(
            "batch_timeout_ms",
            p.batch_timeout_ms,
            Some(("users_batch_timeout_ms", s.users_batch_timeout_ms)),
            ("batch_timeout_ms", s.batch_timeout_ms),
        )?;
        let min_wait = self.number(
            "batch_min_wait_ms",
            p.batch_min_wait_ms,
            Some(("users_batch_min_wait_ms", s.users_batch_min_wait_ms)),
            ("batch_min_wait_ms", s.batch_min_wait_ms),
        )?;
        let processors = self.number(
            "proc_concurrency",
            p.proc_concurrency,
            own("users_proc_concurrency", s.users_proc_concurrency),
            ("proc_concurrency", wide(s.proc_concurrency)),
        )?;
        let concurrency = self.number(
            "batch_concurrency",
            p.batch_concurrency,
            own("users_batch_concurrency", s.users_batch_concurrency),
            ("batch_concurrency", wide(s.batch_concurrency)),
        )?;
        let strategy = self.pick(
            "balance",
            p.balance,
            Some(("users_balance", s.users_balance)),
            ("balance", s.balance),
        );
        let min = self.number(
            "min_concurrency",
            p.min_concurrency,
            own("users_min_concurrency", s.users_min_concurrency),
            ("min_concurrency", wide(s.min_concurrency)),
        )?;
        let max = self.number(
            "max_concurrency",
            p.max_concurrency,
            own("users_max_concurrency", s.users_max_concurrency),
            ("max_concurrency", wide(s.max_concurrency)),
        )?;
        let cooldown = self.number(
            "balance_cooldown_ms",
            p.balance_cooldown_ms,
            Some(("users_balance_cooldown_ms", s.users_balance_cooldown_ms)),
            ("balance_cooldown_ms", s.balance_cooldown_ms),
        )?;
        let max_shift = self.number(
            "balance_max_shift",
            p.balance_max_shift,
            own("users_balance_max_shift", s.users_balance_max_shift),
            ("balance_max_shift", wide(s.balance_max_shift)),
        )?;
        let threshold = self.number(
            "scale_threshold",
            p.scale_threshold,
            Some(("users_scale_threshold", s.users_scale_threshold)),
            ("scale_threshold", s.scale_threshold),
        )?;
        let up = self.number(
            "scale_up_threshold",
            p.scale_up_threshold,
            Some(("users_scale_up_threshold", s.users_scale_up_threshold)),
            ("scale_up_threshold", s.scale_up_threshold),
        )?;
        let down = self.number(
            "scale_down_threshold",
            p.scale_down_threshold,
            Some(("users_scale_down_threshold", s.users_scale_down_threshold)),
            ("scale_down_threshold", s.scale_down_threshold),
        )?;
        let prefetch = self.number(
            "prefetch",
            p.prefetch,
            None,
            ("prefetch", s.prefetch.into()),
        )?;
        let max_retries = self.number(
            "max_retries",
            p.max_retries,
            None,
            ("max_retries", s.max_retries.into()),
        )?;
        let dlq_max_attempts = self.number(
            "dlq_max_attempts",
            p.dlq_max_attempts,
            None,
            ("dlq_max_attempts", s.dlq_max_attempts.into()),
        )?;
        let rate = self.number(
            "rate_limit_per_s",
            p.rate_limit_per_s,
            None,
            ("rate_limit_per_s", s.rate_limit_per_s.into()),
        )?;
        if let Some(ttls) = &p.retry_ttls_ms {
            let (min, max) = range_of("retry_ttl_ms").unwrap_or((1, u64::MAX));
            // As RETRY_TTLS_MS (review R35h F1: equal TTLs planned one queue twice, and 300
            // tiers were taken).
            let most = crate::config::MAX_RETRY_TIERS;
            if ttls.is_empty()
                || ttls.len() > most
                || ttls.iter().any(|t| *t < min || *t > max)
                || ttls.windows(2).any(|w| w[0] >= w[1])
            {
                return Err(self.refuse_with(
                    "retry_ttls_ms",
                    Source::Entry,
                    format!(
                        "a non-empty list of at most {most} increasing TTLs (no two equal), each \
                         from {min} to {max} ms"
                    ),
                    format!("{ttls:?}"),
                ));
            }
        }
        self.check_mapping()?;

        if min.value > max.value {
            return Err(self.refuse(
                &min,
                format!("at most {} ({})", self.label(&max), max.value),
            ));
        }
        if min_wait.value > timeout.value {
            return Err(self.refuse(
                &min_wait,
                format!(
                    "at most {} ({}): the batch timeout is the longest a partial batch is held",
                    self.label(&timeout),
                    timeout.value
                ),
            ));
        }
        // A partial batch is held at most its timeout before a sink takes it; its deliveries
        // must still be inserted and acked before the hand-back time (80% of the consumer
        // timeout), so the timeout is at most half of that (the minimum wait is within it).
        if let Some(hand_back) = s.hand_back_after() {
            let most = u64::try_from(hand_back.as_millis() / 2).unwrap_or(u64::MAX);
            if timeout.value > most {
                return Err(self.refuse(
                    &timeout,
                    format!(
                        "at most {most} ms: half of 80% of AMQP_CONSUMER_TIMEOUT_MS ({} ms, from \
                         {}), so that a partial batch held this long is still inserted and acked \
                         before warren hands its deliveries back (lower it, or set \
                         AMQP_CONSUMER_TIMEOUT_MS to the broker's larger consumer_timeout)",
                        s.amqp_consumer_timeout_ms, self.timeout_at
                    ),
                ));
            }
        }
        if strategy.value == Balance::Auto && down.value >= up.value {
            return Err(self.refuse(
                &down,
                format!(
                    "below {} ({}), or auto would step down and up again at every decision",
                    self.label(&up),
                    up.value
                ),
            ));
        }
        let names = self.names()?;

        // Every number was checked against a range that fits its type.
        let small = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let narrow = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        let (size_n, concurrency_n, min_n) = (
            small(size.value),
            small(concurrency.value),
            small(min.value),
        );
        // The window never exceeds what the byte budget holds of the largest accepted bodies.
        let bodies = (s.max_inflight_bytes / (s.max_message_bytes as u64).max(1))
            .clamp(1, u64::from(u16::MAX)) as u16;
        let window_cap = match prefetch.value {
            0 => u16::MAX,
            n => n.min(u64::from(u16::MAX)) as u16,
        }
        .min(bodies);
        // Two batches per batcher: each fills its next batch while its sink inserts the last,
        // so the broker keeps delivering while every sink is busy (docs/performance.md).
        let two_batches = |batchers: usize| {
            let n = size_n.saturating_mul(batchers).saturating_mul(2);
            (n.clamp(1, usize::from(u16::MAX)) as u16).min(window_cap)
        };
        let fixed = match prefetch.value {
            0 => two_batches(concurrency_n),
            _ => window_cap,
        };
        let (start, most) = match strategy.value {
            Balance::Off => (fixed, fixed),
            _ => (
                two_batches(min_n),
                two_batches(concurrency_n.max(small(max.value))),
            ),
        };
        let spec = PipelineSpec {
            name: p.name.clone(),
            builtin: self.index.is_none(),
            mapping: p.mapping_spec(),
            api: Api {
                enabled: p.api,
                key: p.api_key,
                check: p.api_check,
            },
            names,
            batching: Batching {
                size: size_n,
                timeout: Duration::from_millis(timeout.value),
                min_wait: Duration::from_millis(min_wait.value),
                processors: small(processors.value),
                concurrency: concurrency_n,
            },
            balance: Balancing {
                strategy: strategy.value,
                min: min_n,
                max: small(max.value),
                cooldown: Duration::from_millis(cooldown.value),
                max_shift: small(max_shift.value),
                threshold: threshold.value,
                up_threshold: up.value,
                down_threshold: down.value,
            },
            prefetch: fixed,
            start_prefetch: start,
            window_cap,
            most_prefetch: most,
            max_retries: narrow(max_retries.value),
            dlq_max_attempts: narrow(dlq_max_attempts.value),
            rate_limit_per_s: narrow(rate.value),
            breaker_failures: s.breaker_failures,
            max_message_bytes: s.max_message_bytes,
            max_inflight_bytes: s.max_inflight_bytes,
            db_retry_window: Duration::from_millis(s.db_retry_window_ms),
        };
        // A rate set at start cannot keep a full window waiting past the hand-back time (the
        // last of `prefetch` deliveries waits `prefetch / rate` seconds in the consumer): the
        // largest window the stage takes, a balanced one's at its most inserts in flight.
        if let Some(give_back) = spec.window_outlasts(spec.rate_limit_per_s, s.hand_back_after()) {
            return Err(self.refuse(
                &rate,
                format!(
                    "a rate at which one prefetch window ({} deliveries{}) is handed on within {} \
                     ms (80% of AMQP_CONSUMER_TIMEOUT_MS): raise the rate, lower PREFETCH, or \
                     set AMQP_CONSUMER_TIMEOUT_MS to the broker's larger consumer_timeout",
                    spec.most_prefetch,
                    match strategy.value {
                        Balance::Off => String::new(),
                        _ => format!(
                            ", balanced at its most: {} inserts in flight",
                            spec.most_inserts()
                        ),
                    },
                    give_back.as_millis()
                ),
            ));
        }
        Ok(spec)
    }

    /// The mapping compiles, and the API's options fit it: a one-column key; `api_key =
    /// "chosen"` a uuid key read from a top-level field (the API writes it there); `api_check`
    /// `on_conflict = "keep"` (a stored key with other content is a conflict only then).
    fn check_mapping(&self) -> Result<(), ConfigError> {
        let p = self.p;
        Mapping::compile(&p.name, &p.mapping_spec()).map_err(|e| {
            let error = ConfigError::Pipeline(e.to_string());
            match self.index {
                // Placed at the key at fault (its path in the entry), not the entry's start.
                Some(index) => ConfigError::Entry {
                    index,
                    field: e.field,
                    error: Box::new(error),
                },
                None => error,
            }
        })?;
        let refuse = |field: &str, expected: &str, got: &str| {
            self.refuse_with(field, Source::Entry, expected.into(), got.into())
        };
        self.check_bounds()?;
        if p.api && p.key.len() != 1 {
            return Err(refuse(
                "api",
                "false, or a one-column key (PUT and GET /api/v1/<name>/<key> address a row by it)",
                &format!("true with key {:?}", p.key),
            ));
        }
        if p.api_check && !p.children.is_empty() {
            return Err(refuse(
                "api_check",
                "false for a pipeline with child tables (the API does not compare child rows \
                 before publishing; the pipeline does: other rows under a stored key are \
                 id_conflict)",
                "true",
            ));
        }
        let child_properties = p.children.iter().flat_map(|child| {
            child
                .columns
                .iter()
                .filter(|(_, c)| c.property.is_some())
                .map(move |(name, c)| (format!("{}.{name}", child.table), c.property))
        });
        if p.api
            && let Some((name, property)) = p
                .columns
                .iter()
                .filter(|(_, c)| c.property.is_some())
                .map(|(name, c)| (name.clone(), c.property))
                .chain(child_properties)
                .next()
        {
            return Err(refuse(
                "api",
                &format!(
                    "false for a pipeline with a property column ({name} reads the AMQP property \
                     {}: an API request has none, and the API's own publish would give it \
                     warren's, not the client's; read it from the body instead)",
                    property.map(|p| p.as_str()).unwrap_or_default()
                ),
                "true",
            ));
        }
        if p.api {
            // A GET answers each child table's rows under its array's name, beside the
            // parent's columns.
            let mut names: Vec<&str> = p.columns.keys().map(String::as_str).collect();
            for child in &p.children {
                let name = child.rows.rsplit('/').next().unwrap_or_default();
                if names.contains(&name) {
                    return Err(refuse(
                        "api",
                        &format!(
                            "false, or child tables whose arrays' names are neither a column \
                             of the pipeline nor another child table's (a GET answers the rows \
                             of {} under \"{name}\")",
                            child.table
                        ),
                        "true",
                    ));
                }
                names.push(name);
            }
        }
        if !p.api && (p.api_key != ApiKey::Body || p.api_check) {
            let (field, got) = if p.api_check {
                ("api_check", "true")
            } else {
                ("api_key", "\"chosen\"")
            };
            return Err(refuse(
                field,
                "api = true first (it is an option of the API)",
                got,
            ));
        }
        if p.api_key == ApiKey::Chosen {
            let key = p.key.first().and_then(|k| p.columns.get(k));
            let top_level = key.and_then(|c| c.path.as_deref()).is_some_and(|path| {
                path.len() > 1 && path[1..].chars().all(|c| c != '/' && c != '~')
            });
            if !key.is_some_and(|c| c.ty == crate::domain::mapping::ColType::Uuid) || !top_level {
                return Err(refuse(
                    "api_key",
                    "\"body\", or \"chosen\" with a uuid key column read from a top-level field \
                     (path = \"/<field>\"), which the API fills",
                    "\"chosen\"",
                ));
            }
        }
        if p.api_check && p.on_conflict != OnConflict::Keep {
            return Err(refuse(
                "api_check",
                "false with on_conflict = \"update\" (a newer version is no conflict)",
                "true",
            ));
        }
        Ok(())
    }

    /// A column's `min` and `max` are finite numbers its type can hold: `nan` would turn the
    /// check off (every comparison with it is false), and `1e20` on an `int4` column can never
    /// be reached. The error names the pipeline, the column and the key, at its line.
    fn check_bounds(&self) -> Result<(), ConfigError> {
        use crate::domain::mapping::ColType;
        let parent = self.p.columns.iter().map(|(column, spec)| {
            (
                format!("columns.{column}"),
                None,
                spec.min,
                spec.max,
                Some(spec.ty),
            )
        });
        // A child table's columns too, named with their child table (review R35e F6: an int4
        // child column's `max = 1e11` was accepted).
        let children = self.p.children.iter().enumerate().flat_map(|(i, child)| {
            child.columns.iter().map(move |(column, spec)| {
                (
                    format!("children.{i}.columns.{column}"),
                    Some(child.table.as_str()),
                    spec.min,
                    spec.max,
                    spec.ty,
                )
            })
        });
        for (at, child, min, max, ty) in parent.chain(children) {
            for (key, bound) in [("min", min), ("max", max)] {
                let Some(bound) = bound else { continue };
                let range = match ty {
                    Some(ColType::Int4) => Some((f64::from(i32::MIN), f64::from(i32::MAX), "int4")),
                    Some(ColType::Int8) => Some((i64::MIN as f64, i64::MAX as f64, "int8")),
                    _ => None,
                };
                let expected = if !bound.is_finite() {
                    Some("a finite number (nan or inf would turn the check off)".to_string())
                } else if let Some((lo, hi, ty)) = range
                    && (bound < lo || bound > hi)
                {
                    Some(format!(
                        "a number an {ty} column can hold ({} to {})",
                        lo as i64, hi as i64
                    ))
                } else {
                    None
                };
                let Some(expected) = expected else { continue };
                let field = format!("{at}.{key}");
                let got = format!("{bound}");
                let Some(table) = child else {
                    return Err(self.refuse_with(&field, Source::Entry, expected, got));
                };
                let error = ConfigError::Invalid {
                    setting: format!("pipelines.{}.{field} (child table {table})", self.p.name),
                    expected,
                    got,
                };
                return Err(match self.index {
                    Some(index) => on_entry(index, &field, error),
                    None => error,
                });
            }
        }
        Ok(())
    }

    /// Its exchanges and queues: the built-in users pipeline's are the settings `MAIN_QUEUE`,
    /// ... (their retry tiers named from `RETRY_QUEUE`), a file's pipeline's its own or derived
    /// from its name. Each a name the broker takes, and no queue twice within the pipeline.
    fn names(&self) -> Result<Names, ConfigError> {
        let s = self.settings;
        if self.index.is_some() {
            let names = self.p.names(s);
            for (what, name) in names.all() {
                if !is_broker_name(name) {
                    return Err(self.refuse_with(
                        what,
                        Source::Entry,
                        "a name of 1 to 255 bytes, without control characters, not starting \
                         with amq. (reserved by the broker)"
                            .into(),
                        format!("{name:?}"),
                    ));
                }
            }
            return Ok(names);
        }
        let names = Names::users(s);
        if let Some(t) = names.retry_tiers.iter().find(|t| t.queue.len() > 255) {
            return Err(ConfigError::Invalid {
                setting: "RETRY_QUEUE".into(),
                expected: "a base name short enough for the retry tier queues' names (255 at most)"
                    .into(),
                got: format!("{:?}", t.queue),
            });
        }
        // With tiers, the tier queues take the retry queue's place (RETRY_QUEUE is their base).
        let retry_setting = if s.retry_ttls_ms.0.is_empty() {
            "retry_queue"
        } else {
            "retry_ttls_ms"
        };
        let mut queues = vec![("main_queue", &names.main_queue)];
        queues.extend(names.retry_tiers.iter().map(|t| (retry_setting, &t.queue)));
        queues.push(("dlq_queue", &names.dlq_queue));
        for (i, (a, va)) in queues.iter().enumerate() {
            if let Some((b, vb)) = queues.iter().skip(i + 1).find(|(_, vb)| vb == va) {
                return Err(ConfigError::Invalid {
                    setting: b.to_ascii_uppercase(),
                    expected: format!("a queue name different from {}", a.to_ascii_uppercase()),
                    got: format!("{vb:?}"),
                });
            }
        }
        Ok(names)
    }
}

/// Whether the broker takes `name` for an exchange or a queue warren declares.
fn is_broker_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && !name.starts_with("amq.")
        && !name.chars().any(char::is_control)
}
