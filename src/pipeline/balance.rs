//! Balancing: how many batch inserts each pipeline has in flight (its batchers in use, and the
//! prefetch window that follows them), decided every cooldown from its backlog
//! (`balance = "simple" | "auto"`, docs/balancing.md), within the process-wide budget
//! `MAX_INSERTS_IN_FLIGHT` that every pipeline shares.
//!
//! - [`Concurrency`]: one main stage's concurrency and bounds, shared by the stage (which
//!   applies a change: `consumer::SetConcurrency`), the balancer and remote control
//!   (`warren ctl scale --min/--max`).
//! - [`simple`] and [`Auto`]: the two strategies, pure functions of what was measured.
//! - [`run`]: the one balancer task of the process, which measures, decides, applies, and
//!   reports each change (metric, log line, event, `warren ctl history`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::consumer::SetConcurrency;
use crate::amqp::monitor::Depths;
use crate::config::Balance;
use crate::metrics::StageStats;

/// A step up that did not make the pipeline this much faster (rows/s) did not help (a rate
/// counted over one cooldown moves by a few percent on its own).
const GAIN: f64 = 1.10;
/// A step up did not help either when the batch insert's latency rose by more than this share
/// of the step: from `n` to `m` inserts in flight, by more than `LATENCY_SHARE * (m - n) / n`.
/// Where the database is the wall, latency rises as fast as the concurrency (Little's law: the
/// same rows/s with more in flight means each waits longer); where it is not, it stays flat.
const LATENCY_SHARE: f64 = 0.75;
/// Decisions after a step that did not help before `auto` tries that step again (the database
/// may have become faster).
const PROBE_AFTER: u32 = 10;
/// Decisions in a row with the backlog below the scale-down threshold before `auto` gives back.
const LOW_FOR: u32 = 2;

/// A pipeline's balancing settings: its resolved spec's `balance`, as the configuration
/// resolved it (one struct, not a copy).
pub use crate::config::pipelines::Balancing as Policy;

/// `simple`: `min(max, max(min, ceil(backlog / threshold)))`.
pub fn simple(backlog: u64, threshold: u64, min: usize, max: usize) -> usize {
    let wanted = backlog.div_ceil(threshold.max(1));
    usize::try_from(wanted)
        .unwrap_or(usize::MAX)
        .clamp(min, max.max(min))
}

/// What `auto` measured over the last cooldown.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    /// Messages ready in the main queue.
    pub backlog: u64,
    /// Rows committed per second.
    pub rate: f64,
    /// Mean time of a batch insert, in ms (0 when none finished).
    pub latency_ms: f64,
}

/// `auto`'s memory between decisions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Auto {
    /// The backlog the last decision saw.
    last_backlog: Option<u64>,
    /// Decisions in a row that saw the backlog below the scale-down threshold.
    low_for: u32,
    /// The last step up, awaiting its verdict: from how many, at what rate and latency.
    step: Option<(usize, f64, f64)>,
    /// A step to this many did not help: not tried again for this many decisions.
    ceiling: Option<(usize, u32)>,
}

impl Auto {
    /// The concurrency `auto` wants now, at `current` within `[min, max]`, and why.
    pub fn decide(
        &mut self,
        policy: &Policy,
        (min, max): (usize, usize),
        current: usize,
        m: Measured,
    ) -> (usize, &'static str) {
        let per_insert = m.backlog / current.max(1) as u64;
        let grows = self.last_backlog.is_some_and(|b| m.backlog > b);
        self.last_backlog = Some(m.backlog);
        if let Some((_, left)) = &mut self.ceiling {
            *left = left.saturating_sub(1);
            if *left == 0 {
                self.ceiling = None;
            }
        }
        let pressed = per_insert > policy.up_threshold
            || (grows && per_insert > policy.down_threshold && m.backlog > 0);
        // The verdict on the last step up, measured over the cooldown after it.
        if let Some((from, rate, latency)) = self.step.take() {
            let faster = m.rate > 0.0 && m.rate >= rate * GAIN;
            let step = current.saturating_sub(from) as f64 / from.max(1) as f64;
            let bounded = latency <= 0.0 || m.latency_ms <= latency * (1.0 + LATENCY_SHARE * step);
            if pressed && !(faster && bounded) && from < current {
                self.ceiling = Some((current, PROBE_AFTER));
                return (from.max(min), "no_gain");
            }
        }
        if per_insert < policy.down_threshold && !grows {
            self.low_for += 1;
        } else {
            self.low_for = 0;
        }
        // A pipeline that committed nothing (paused, held by the breaker, waiting on its
        // window) would not go faster with more inserts in flight: it holds.
        if pressed && current < max && m.rate > 0.0 {
            let mut to = (current + policy.max_shift).min(max);
            if let Some((ceiling, _)) = self.ceiling {
                to = to.min(ceiling.saturating_sub(1).max(current));
            }
            if to > current {
                self.step = Some((current, m.rate, m.latency_ms));
                return (to, "backlog");
            }
            return (current, "hold");
        }
        if self.low_for >= LOW_FOR && current > min {
            self.low_for = 0;
            let reason = if m.backlog == 0 { "idle" } else { "backlog" };
            return (current.saturating_sub(policy.max_shift).max(min), reason);
        }
        (current.clamp(min, max), "hold")
    }
}

/// One main stage's concurrency: what it is, its bounds, and how a change reaches the stage.
pub struct Concurrency {
    /// The pipeline (`users`, `orders`) and its stage (always main): the labels of the
    /// gauge, the decisions and the logs.
    pub stage: crate::metrics::StageId,
    pub policy: Policy,
    /// The main queue, whose backlog it follows.
    pub queue: String,
    consumer: Recipient<SetConcurrency>,
    current: AtomicUsize,
    min: AtomicUsize,
    max: AtomicUsize,
    /// The batchers that exist: the most it can be set to.
    created: usize,
    batch_size: usize,
    /// The prefetch window's cap: `PREFETCH` when set, and what the byte budget holds.
    window_cap: u16,
}

impl Concurrency {
    /// Applies nothing: the stage starts at `current` with its window.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        stage: crate::metrics::StageId,
        policy: Policy,
        queue: String,
        consumer: Recipient<SetConcurrency>,
        current: usize,
        created: usize,
        batch_size: usize,
        window_cap: u16,
    ) -> Self {
        let (min, max) = match policy.strategy {
            Balance::Off => (1, created),
            _ => (policy.min, policy.max),
        };
        crate::metrics::concurrency(&stage, current, "start");
        Self {
            stage,
            policy,
            queue,
            consumer,
            current: AtomicUsize::new(current),
            min: AtomicUsize::new(min),
            max: AtomicUsize::new(max),
            created,
            batch_size,
            window_cap,
        }
    }

    /// Batch inserts in flight at most, now.
    pub fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// The bounds the balancer keeps it within (an operator's, `warren ctl scale --min/--max`).
    pub fn bounds(&self) -> (usize, usize) {
        (
            self.min.load(Ordering::Relaxed),
            self.max.load(Ordering::Relaxed),
        )
    }

    /// Whether a balancer moves it.
    pub fn balanced(&self) -> bool {
        self.policy.strategy != Balance::Off
    }

    /// The prefetch window for `n` inserts in flight: two batches each, within the cap.
    pub fn window(&self, n: usize) -> u16 {
        let two_batches = self.batch_size.saturating_mul(n).saturating_mul(2);
        (two_batches.clamp(1, usize::from(u16::MAX)) as u16).min(self.window_cap)
    }

    /// Sets it to `to` (within 1 and the batchers that exist) for `reason`: the stage's
    /// batchers and window, the gauge, the decision counter and the `scaled` event. Answers
    /// what it was and what it is.
    pub fn set(&self, to: usize, reason: &'static str) -> (usize, usize) {
        let to = to.clamp(1, self.created);
        let from = self.current.swap(to, Ordering::Relaxed);
        if from != to {
            self.consumer.do_send(SetConcurrency {
                batchers: to,
                prefetch: self.window(to),
            });
            crate::metrics::concurrency(&self.stage, to, reason);
            crate::events::emit(
                Some(self.stage.pipeline()),
                crate::events::Kind::Scaled {
                    what: "concurrency".into(),
                    from,
                    to,
                    reason: reason.into(),
                },
            );
        }
        (from, to)
    }

    /// Sets new bounds (`warren ctl scale --min/--max`) that [`Concurrency::check_bounds`]
    /// answered, and moves the concurrency into them at once. For several stages, each is
    /// checked with what the others will hold, and only then are all applied (all or nothing).
    pub fn apply_bounds(&self, min: usize, max: usize) {
        self.min.store(min, Ordering::Relaxed);
        self.max.store(max, Ordering::Relaxed);
        let current = self.current();
        let to = current.clamp(min, max);
        if to != current {
            self.set(to, "operator");
            info!(
                pipeline = self.stage.pipeline(),
                from = current,
                to,
                min,
                max,
                "concurrency moved into the bounds an operator set"
            );
        }
    }

    /// The bounds `min`/`max` (absent: unchanged) make, checked against the batchers that exist
    /// and, with `others` what the rest of the process will hold, against `budget` (the
    /// process-wide budget); or why not.
    pub fn check_bounds(
        &self,
        min: Option<usize>,
        max: Option<usize>,
        others: usize,
        budget: usize,
    ) -> Result<(usize, usize), BoundsError> {
        let (old_min, old_max) = self.bounds();
        let (min, max) = (min.unwrap_or(old_min), max.unwrap_or(old_max));
        if min < 1 || max > self.created || min > max {
            return Err(BoundsError::Range {
                pipeline: self.stage.pipeline().to_string(),
                batchers: self.created,
                min,
                max,
            });
        }
        let held = self.held_within(min, max);
        if others + held > budget {
            return Err(BoundsError::Budget {
                pipeline: self.stage.pipeline().to_string(),
                min,
                others,
                budget,
            });
        }
        Ok((min, max))
    }

    /// What it always holds of the budget: its minimum when balanced, else what it is.
    pub fn held(&self) -> usize {
        if self.balanced() {
            self.bounds().0
        } else {
            self.current()
        }
    }

    /// What it would hold of the budget within the bounds `min`..=`max`.
    pub fn held_within(&self, min: usize, max: usize) -> usize {
        if self.balanced() {
            min
        } else {
            self.current().clamp(min, max)
        }
    }
}

/// Why bounds of batch inserts in flight (`warren ctl scale --min/--max`) cannot be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BoundsError {
    /// Outside 1 <= min <= max <= the batchers the pipeline has.
    #[error(
        "pipeline {pipeline}: expected 1 <= min <= max <= {batchers} (its batchers: the larger of \
         its batch_concurrency and max_concurrency), got min {min}, max {max}"
    )]
    Range {
        pipeline: String,
        batchers: usize,
        min: usize,
        max: usize,
    },
    /// With what the other pipelines hold, over the process-wide budget.
    #[error(
        "pipeline {pipeline}: min {min} with the {others} inserts the other pipelines would hold \
         exceeds MAX_INSERTS_IN_FLIGHT ({budget})"
    )]
    Budget {
        pipeline: String,
        min: usize,
        others: usize,
        budget: usize,
    },
}

/// A change of a pipeline's concurrency, for `warren ctl history`.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub pipeline: String,
    pub from: usize,
    pub to: usize,
    pub reason: &'static str,
    /// The inputs it used, as `key=value` pairs.
    pub inputs: String,
}

/// One balanced stage as the balancer tracks it.
struct Tracked {
    c: Arc<Concurrency>,
    stats: Arc<StageStats>,
    next_at: Instant,
    /// Rows committed, batches and their insert time, at the last decision, and when.
    last: (Instant, u64, u64, u64),
    auto: Auto,
    /// The backlog the last decision saw (for sharing the budget).
    backlog: u64,
    /// After a change: when to take the counters again, so the next decision measures the new
    /// concurrency, not the change itself (the old window settling, the new one filling).
    resample_at: Option<Instant>,
}

/// The balancer: every balanced stage of `all` decided every cooldown, each change applied
/// and sent to `history`, until `stopping`. `budget` is `MAX_INSERTS_IN_FLIGHT`.
pub async fn run(
    all: Vec<Arc<Concurrency>>,
    budget: usize,
    depths: Depths,
    history: mpsc::UnboundedSender<Decision>,
    stopping: CancellationToken,
) {
    let now = Instant::now();
    let mut tracked: Vec<Tracked> = all
        .iter()
        .filter(|c| c.balanced())
        .map(|c| {
            let stats = crate::metrics::stage(&c.stage);
            let last = sample(&stats, now);
            Tracked {
                c: c.clone(),
                stats,
                // The first decision comes after a quarter of the cooldown: the cooldown is
                // between changes, and starting at the minimum is no reason to sit there a
                // whole cooldown in front of a deep backlog.
                next_at: now + c.policy.cooldown / 4,
                last,
                auto: Auto::default(),
                backlog: 0,
                resample_at: None,
            }
        })
        .collect();
    if tracked.is_empty() {
        return;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopping.cancelled() => return,
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        for i in 0..tracked.len() {
            if tracked[i].resample_at.is_some_and(|at| at <= now) {
                tracked[i].last = sample(&tracked[i].stats, now);
                tracked[i].resample_at = None;
            }
            if tracked[i].next_at > now {
                continue;
            }
            let t = &mut tracked[i];
            t.next_at = now + t.c.policy.cooldown;
            let Some(backlog) = depths.get(&t.c.queue).map(u64::from) else {
                debug!(
                    pipeline = t.c.stage.pipeline(),
                    "no fresh depth of the queue: balancing holds"
                );
                // Asked again soon rather than a cooldown later (the monitor's first poll).
                t.next_at = now + t.c.policy.cooldown.min(Duration::from_millis(200));
                continue;
            };
            let (at, rows, batches, insert_us) = t.last;
            let next = sample(&t.stats, now);
            t.last = next;
            let secs = now.duration_since(at).as_secs_f64().max(0.001);
            let done = next.2.saturating_sub(batches);
            let m = Measured {
                backlog,
                rate: next.1.saturating_sub(rows) as f64 / secs,
                latency_ms: if done == 0 {
                    0.0
                } else {
                    next.3.saturating_sub(insert_us) as f64 / done as f64 / 1000.0
                },
            };
            t.backlog = backlog;
            let (min, max) = t.c.bounds();
            let current = t.c.current();
            let (wanted, mut reason) = match t.c.policy.strategy {
                Balance::Simple => {
                    let to = simple(backlog, t.c.policy.threshold, min, max);
                    (to, if backlog == 0 { "idle" } else { "backlog" })
                }
                _ => t.auto.decide(&t.c.policy, (min, max), current, m),
            };
            // The process-wide budget: never what the others hold now, and while it is
            // contended, no more than this pipeline's share by backlog.
            let others: usize = all
                .iter()
                .filter(|o| !Arc::ptr_eq(o, &tracked[i].c))
                .map(|o| o.current())
                .sum();
            let granted = if others + wanted <= budget {
                wanted
            } else {
                let share = fair_share(&tracked, i, &all, budget);
                wanted
                    .min(share)
                    .min(budget.saturating_sub(others))
                    .max(min)
            };
            let t = &mut tracked[i];
            if granted < wanted {
                reason = "budget";
            }
            let inputs = format!(
                "backlog={backlog} rate={:.0}/s insert_ms={:.1} min={min} max={max} \
                 budget={budget} others={others}",
                m.rate, m.latency_ms
            );
            if granted == current {
                debug!(pipeline = t.c.stage.pipeline(), concurrency = current, wanted, %inputs, "balance: hold");
                continue;
            }
            let (from, to) = t.c.set(granted, reason);
            if from == to {
                continue;
            }
            t.resample_at = Some(now + t.c.policy.cooldown / 5);
            info!(pipeline = t.c.stage.pipeline(), strategy = %t.c.policy.strategy, from, to, reason,
                backlog, rate = m.rate as u64, insert_ms = m.latency_ms, min, max, budget,
                "balance: concurrency changed");
            let _ = history.send(Decision {
                pipeline: t.c.stage.pipeline().to_string(),
                from,
                to,
                reason,
                inputs,
            });
        }
    }
}

/// A stage's counters now: (when, rows committed, batches, insert microseconds).
fn sample(stats: &StageStats, now: Instant) -> (Instant, u64, u64, u64) {
    (
        now,
        stats.inserted.load(Ordering::Relaxed),
        stats.batches.load(Ordering::Relaxed),
        stats.insert_us.load(Ordering::Relaxed),
    )
}

/// Tracked stage `i`'s share of the budget: its minimum, plus what the budget holds beyond
/// every stage's held inserts, in proportion to its backlog among the balanced stages (evenly
/// when none has one); what rounding leaves goes to the largest backlog.
fn fair_share(tracked: &[Tracked], i: usize, all: &[Arc<Concurrency>], budget: usize) -> usize {
    let held: usize = all.iter().map(|c| c.held()).sum();
    let spare = budget.saturating_sub(held) as u64;
    let total: u64 = tracked.iter().map(|t| t.backlog).sum();
    let weight = |t: &Tracked| if total == 0 { 1 } else { t.backlog };
    let weights: u64 = tracked.iter().map(weight).sum::<u64>().max(1);
    let part = |t: &Tracked| spare.saturating_mul(weight(t)) / weights;
    let rest = spare - tracked.iter().map(part).sum::<u64>().min(spare);
    let largest = (0..tracked.len()).max_by_key(|&j| (weight(&tracked[j]), std::cmp::Reverse(j)));
    let extra = part(&tracked[i]) + if largest == Some(i) { rest } else { 0 };
    usize::try_from(tracked[i].c.bounds().0 as u64 + extra).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            strategy: Balance::Auto,
            min: 1,
            max: 6,
            cooldown: Duration::from_secs(1),
            max_shift: 2,
            threshold: 1000,
            up_threshold: 1000,
            down_threshold: 100,
        }
    }

    fn m(backlog: u64, rate: f64, latency_ms: f64) -> Measured {
        Measured {
            backlog,
            rate,
            latency_ms,
        }
    }

    #[test]
    fn simple_is_the_formula_within_the_bounds() {
        assert_eq!(simple(0, 1000, 1, 8), 1);
        assert_eq!(simple(1, 1000, 1, 8), 1);
        assert_eq!(simple(1001, 1000, 1, 8), 2);
        assert_eq!(simple(5000, 1000, 1, 8), 5);
        assert_eq!(simple(1_000_000, 1000, 2, 8), 8);
        assert_eq!(simple(0, 1000, 2, 8), 2);
        assert_eq!(simple(u64::MAX, 1, 1, 64), 64);
    }

    #[test]
    fn auto_steps_up_by_at_most_max_shift_while_each_step_helps() {
        let (p, mut a) = (policy(), Auto::default());
        assert_eq!(
            a.decide(&p, (1, 6), 1, m(50_000, 1000.0, 10.0)),
            (3, "backlog")
        );
        // Faster: another step, never past max.
        assert_eq!(
            a.decide(&p, (1, 6), 3, m(40_000, 2000.0, 12.0)),
            (5, "backlog")
        );
        assert_eq!(
            a.decide(&p, (1, 6), 5, m(30_000, 2500.0, 13.0)),
            (6, "backlog")
        );
        assert_eq!(a.decide(&p, (1, 6), 6, m(20_000, 3000.0, 14.0)).0, 6);
    }

    #[test]
    fn auto_takes_back_a_step_that_did_not_help_and_does_not_retry_it_at_once() {
        let (p, mut a) = (policy(), Auto::default());
        assert_eq!(a.decide(&p, (1, 6), 1, m(50_000, 1000.0, 10.0)).0, 3);
        // Not faster: back to where it was.
        assert_eq!(
            a.decide(&p, (1, 6), 3, m(49_000, 1010.0, 30.0)),
            (1, "no_gain")
        );
        // Still a backlog: up, but not to the step that did not help.
        for _ in 0..5 {
            let (to, _) = a.decide(&p, (1, 6), 1, m(48_000, 1000.0, 10.0));
            assert!(to <= 2, "{to}");
            if to == 2 {
                // One below the ceiling: a verdict on it, then it holds there.
                let (to, _) = a.decide(&p, (1, 6), 2, m(47_000, 1000.0, 10.0));
                assert!(to <= 2);
                break;
            }
        }
        // Slower with the same rate but a latency far past the bound is no gain either.
        let mut a = Auto::default();
        assert_eq!(a.decide(&p, (1, 6), 2, m(50_000, 1000.0, 10.0)).0, 4);
        assert_eq!(
            a.decide(&p, (1, 6), 4, m(50_000, 1200.0, 25.0)),
            (2, "no_gain")
        );
    }

    #[test]
    fn auto_does_not_climb_while_nothing_commits() {
        let (p, mut a) = (policy(), Auto::default());
        // Paused or stalled: a backlog, no rows.
        assert_eq!(a.decide(&p, (1, 6), 1, m(50_000, 0.0, 0.0)), (1, "hold"));
        assert_eq!(a.decide(&p, (1, 6), 1, m(50_000, 0.0, 0.0)), (1, "hold"));
        // Committing again: a step, and a step after which nothing commits did not help.
        assert_eq!(a.decide(&p, (1, 6), 1, m(50_000, 500.0, 9.0)).0, 3);
        assert_eq!(a.decide(&p, (1, 6), 3, m(50_000, 0.0, 0.0)), (1, "no_gain"));
    }

    #[test]
    fn auto_gives_back_when_the_backlog_stays_low_and_never_leaves_the_bounds() {
        let (p, mut a) = (policy(), Auto::default());
        assert_eq!(a.decide(&p, (1, 6), 5, m(10, 100.0, 5.0)), (5, "hold"));
        assert_eq!(a.decide(&p, (1, 6), 5, m(0, 100.0, 5.0)), (3, "idle"));
        assert_eq!(a.decide(&p, (1, 6), 3, m(0, 0.0, 0.0)).0, 3);
        assert_eq!(a.decide(&p, (1, 6), 3, m(0, 0.0, 0.0)), (1, "idle"));
        for _ in 0..4 {
            assert_eq!(a.decide(&p, (1, 6), 1, m(0, 0.0, 0.0)).0, 1);
        }
        // Bounds raised by an operator: the minimum is kept.
        assert_eq!(a.decide(&p, (2, 6), 1, m(0, 0.0, 0.0)).0, 2);
    }

    #[test]
    fn a_lone_backlog_gets_the_whole_spare_budget_and_two_share_it_by_backlog() {
        let share = |backlogs: &[u64], i: usize| {
            let mut tracked = Vec::new();
            let mut all = Vec::new();
            for (n, b) in backlogs.iter().enumerate() {
                let c = Arc::new(Concurrency {
                    stage: crate::metrics::StageId::new(
                        &format!("p{n}"),
                        crate::metrics::Stage::Main,
                    ),
                    policy: policy(),
                    queue: String::new(),
                    consumer: probe(),
                    current: AtomicUsize::new(1),
                    min: AtomicUsize::new(1),
                    max: AtomicUsize::new(6),
                    created: 6,
                    batch_size: 10,
                    window_cap: u16::MAX,
                });
                all.push(c.clone());
                tracked.push(Tracked {
                    c,
                    stats: Arc::default(),
                    next_at: Instant::now(),
                    last: (Instant::now(), 0, 0, 0),
                    auto: Auto::default(),
                    backlog: *b,
                    resample_at: None,
                });
            }
            fair_share(&tracked, i, &all, 8)
        };
        assert_eq!(share(&[5000], 0), 8);
        // 6 spare: 4.5 and 1.5, the half to the larger backlog.
        assert_eq!(share(&[3000, 1000], 0), 1 + 5);
        assert_eq!(share(&[3000, 1000], 1), 1 + 1);
        assert_eq!(share(&[0, 0], 1), 1 + 3);
        assert_eq!(share(&[0, 7], 0), 1);
    }

    /// A recipient that drops what it gets.
    fn probe() -> Recipient<SetConcurrency> {
        struct Sink;
        impl Actor for Sink {
            type Context = Context<Self>;
        }
        impl Handler<SetConcurrency> for Sink {
            type Result = ();
            fn handle(&mut self, _: SetConcurrency, _: &mut Self::Context) {}
        }
        let system = actix::System::new();
        system.block_on(async { Sink.start().recipient() })
    }
}
