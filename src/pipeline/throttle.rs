//! The consumer's rate limit (`RATE_LIMIT_PER_S`, `warren ctl rate`): a `governor` limiter
//! decides when each delivery may be handed onwards; deliveries that arrive faster wait here,
//! oldest first. They stay unacked, so the prefetch window bounds them and the broker, seeing the
//! window full, keeps the rest in the queue. Pure bookkeeping: the consumer owns the timer.

use std::collections::VecDeque;
use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::Clock;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use super::message::Delivery;

/// What [`Throttle::take`] gives back.
pub struct Release {
    /// May go onwards now, in order.
    pub ready: Vec<Delivery>,
    /// Deliveries of an older channel generation, dropped (the broker requeued them when their
    /// channel closed).
    pub dropped: usize,
    /// The bodies' bytes of the dropped deliveries.
    pub dropped_bytes: u64,
    /// How long until the next held delivery may go; `None` when nothing waits.
    pub wait: Option<Duration>,
}

/// The limiter and the deliveries it holds back.
pub struct Throttle {
    /// `None` = no limit.
    limiter: Option<DefaultDirectRateLimiter>,
    /// Taken from the broker but not yet handed onwards, oldest first.
    held: VecDeque<Delivery>,
}

impl Throttle {
    /// At most `per_s` deliveries per second; 0 = no limit.
    pub fn new(per_s: u32) -> Self {
        Self {
            limiter: limiter(per_s),
            held: VecDeque::new(),
        }
    }

    /// A new rate from now on (0 removes the limit); what is held stays, in order.
    pub fn set_rate(&mut self, per_s: u32) {
        self.limiter = limiter(per_s);
    }

    /// Whether deliveries can skip the throttle: no limit and nothing held before them.
    pub fn is_open(&self) -> bool {
        self.limiter.is_none() && self.held.is_empty()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Holds `deliveries` behind what is already held.
    pub fn hold(&mut self, deliveries: Vec<Delivery>) {
        self.held.extend(deliveries);
    }

    /// Forgets everything held (the channel closed: the broker requeued it all); returns how many
    /// and their bodies' bytes.
    pub fn clear(&mut self) -> (usize, u64) {
        let n = self.held.len();
        let bytes = self.held.iter().map(|d| d.held_bytes).sum();
        self.held.clear();
        (n, bytes)
    }

    /// Takes, in order, what may go now: everything with `all` (stopping) or without a limit,
    /// else as many as the limiter allows. Deliveries not of `generation` are dropped.
    pub fn take(&mut self, generation: u64, all: bool) -> Release {
        let mut release = Release {
            ready: Vec::new(),
            dropped: 0,
            dropped_bytes: 0,
            wait: None,
        };
        while let Some(front) = self.held.front() {
            if front.generation != generation {
                release.dropped_bytes += front.held_bytes;
                self.held.pop_front();
                release.dropped += 1;
                continue;
            }
            if let Some(l) = self.limiter.as_ref().filter(|_| !all)
                && let Err(not_until) = l.check()
            {
                release.wait = Some(not_until.wait_time_from(l.clock().now()));
                break;
            }
            release.ready.extend(self.held.pop_front());
        }
        release
    }
}

/// The limiter for `per_s` messages per second, none for 0. Its burst is a twentieth of a
/// second's worth (at least 1): smooth, yet one timer wake-up releases a chunk even at high rates.
fn limiter(per_s: u32) -> Option<DefaultDirectRateLimiter> {
    let rate = NonZeroU32::new(per_s)?;
    let burst = NonZeroU32::new(per_s / 20).unwrap_or(NonZeroU32::MIN);
    Some(RateLimiter::direct(
        Quota::per_second(rate).allow_burst(burst),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deliveries(generation: u64, tags: std::ops::Range<u64>) -> Vec<Delivery> {
        tags.map(|tag| Delivery {
            generation,
            tag,
            redelivered: false,
            received_at: std::time::Instant::now(),
            body: Default::default(),
            properties: Default::default(),
            published_ms: None,
            exchange: Default::default(),
            routing_key: Default::default(),
            held_bytes: 0,
            decoded: Default::default(),
        })
        .collect()
    }

    fn tags(r: &Release) -> Vec<u64> {
        r.ready.iter().map(|d| d.tag).collect()
    }

    #[test]
    fn without_a_limit_everything_goes_in_order_and_old_generations_are_dropped() {
        let mut t = Throttle::new(0);
        assert!(t.is_open());
        t.hold(deliveries(1, 1..3));
        t.hold(deliveries(2, 1..4));
        let r = t.take(2, false);
        assert_eq!((tags(&r), r.dropped, r.wait), (vec![1, 2, 3], 2, None));
        assert!(t.is_empty());
    }

    #[test]
    fn a_limit_releases_its_burst_then_names_the_wait_and_stopping_takes_all() {
        // 100 per second: a burst of 5, then one every 10 ms.
        let mut t = Throttle::new(100);
        assert!(!t.is_open());
        t.hold(deliveries(1, 1..21));
        let r = t.take(1, false);
        assert_eq!(tags(&r), vec![1, 2, 3, 4, 5]);
        let wait = r.wait.expect("the rest waits");
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(10),
            "{wait:?}"
        );
        let r = t.take(1, true);
        assert_eq!(tags(&r), (6..21).collect::<Vec<_>>());
        assert_eq!(r.wait, None);
        t.set_rate(0);
        assert!(t.is_open());
    }
}
