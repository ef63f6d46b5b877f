//! Which processor and which batcher each delivery goes to: a batch's worth to one batcher before
//! the next one's turn (so batches fill one at a time), each chunk to the next processor. One
//! exception: when the current batcher's sink has been inserting for longer than [`PACE`] and
//! another batcher's sink is free, the turn passes to the free one at once, so a table slower
//! than the load (triggers, many indexes, a slow disk) gets its second insert in flight without
//! waiting for a whole batch's worth of deliveries (found by review: p99 2.9 s at 360 msg/s on a
//! table one sink could not keep up with, 0.54 s with the turn passed). Chosen at the wiring
//! (`pipeline::start`), applied by the consumer as deliveries arrive.

use std::sync::Arc;
#[cfg(test)]
use std::time::Duration;
use std::time::Instant;

use actix::prelude::*;

use super::batcher::{PACE, SinkStates};
use super::message::{Chunk, Delivery, Flush};

/// One processor, as the consumer feeds it: its chunks, and the flush of a batcher taken out.
#[derive(Clone)]
pub struct Feed {
    pub chunks: Recipient<Chunk>,
    pub flushes: Recipient<Flush>,
}

/// The dispatch policy and where it stands.
pub struct Dispatch {
    /// Processors, fed a chunk each, round-robin (`warren ctl scale` replaces them).
    processors: Vec<Feed>,
    next_processor: usize,
    /// Where the next deliveries go among the batchers in use.
    fill: Fill,
    /// The batchers that exist (the most a balanced pipeline may use); the first
    /// `fill.batchers` of them are in use.
    batchers: usize,
}

/// Cuts deliveries into chunks of at most a batch's worth per batcher, in turn.
#[derive(Debug, Clone)]
struct Fill {
    batchers: usize,
    batch_size: usize,
    /// The batcher the current chunk goes to, and how many it got so far.
    current: usize,
    filled: usize,
    /// The batchers' sinks, to pass the turn to a free one.
    sinks: Arc<SinkStates>,
}

impl Fill {
    /// Every batcher's batch was flushed: the next deliveries start a whole batch's worth for
    /// the current batcher. Without it, the count of a flushed partial batch stayed: its
    /// batcher got only the rest of a batch's worth, so each batcher's batches straddled two
    /// turns, the oldest deliveries waited a whole round in a batcher for their batch to fill,
    /// and the acks behind them waited too (the balance bench: 0.83 of a fixed concurrency
    /// after a change of concurrency).
    fn restart(&mut self) {
        self.filled = 0;
    }

    /// When the current batcher's sink has been inserting for longer than [`PACE`] at `now`,
    /// the turn passes to the first batcher in use whose sink is free (a whole batch's worth
    /// for it). Inserts shorter than the pace never pass it: at light load one batcher gathers
    /// what arrives during its sink's insert, as natural batching wants.
    fn pass_turn_if_stuck(&mut self, now: Instant) {
        if self.batchers < 2
            || self
                .sinks
                .busy_for(self.current, now)
                .is_none_or(|d| d <= PACE)
        {
            return;
        }
        let free = (1..self.batchers)
            .map(|k| (self.current + k) % self.batchers)
            .find(|&b| self.sinks.busy_for(b, now).is_none());
        if let Some(b) = free {
            self.current = b;
            self.filled = 0;
        }
    }

    /// Cuts `items` into `(batcher, part)` in order.
    fn cut<T>(&mut self, mut items: Vec<T>) -> Vec<(usize, Vec<T>)> {
        self.pass_turn_if_stuck(Instant::now());
        let mut out = Vec::new();
        while !items.is_empty() {
            let room = self.batch_size - self.filled;
            let rest = if items.len() > room {
                items.split_off(room)
            } else {
                Vec::new()
            };
            self.filled += items.len();
            let batcher = self.current;
            if self.filled >= self.batch_size {
                self.filled = 0;
                self.current = (self.current + 1) % self.batchers;
            }
            out.push((batcher, items));
            items = rest;
        }
        out
    }
}

impl Dispatch {
    /// Chunks for the first `in_use` of `batchers` batchers of `batch_size`, over `processors`
    /// (at least one); `sinks` is what the batchers say of their sinks.
    pub fn new(
        processors: Vec<Feed>,
        batchers: usize,
        in_use: usize,
        batch_size: usize,
        sinks: Arc<SinkStates>,
    ) -> Self {
        let batchers = batchers.max(1);
        Self {
            processors,
            next_processor: 0,
            fill: Fill {
                batchers: in_use.clamp(1, batchers),
                batch_size: batch_size.max(1),
                current: 0,
                filled: 0,
                sinks,
            },
            batchers,
        }
    }

    /// Fills the first `n` batchers from now on (at least one, at most those that exist), and
    /// answers how many that is. Each batcher taken out gets a `Flush` through every processor,
    /// after what each holds for it: its partial batch goes to its sink at once, and nothing
    /// new reaches it.
    pub fn set_batchers(&mut self, n: usize) -> usize {
        let n = n.clamp(1, self.batchers);
        let before = self.fill.batchers;
        self.fill.batchers = n;
        if self.fill.current >= n {
            self.fill.current = 0;
            self.fill.filled = 0;
        }
        for batcher in n..before {
            for p in &self.processors {
                p.flushes.do_send(Flush { batcher });
            }
        }
        n
    }

    /// A `Flush` to every batcher in use, through every processor (after what each holds):
    /// what they hold goes to the sinks at once.
    pub fn flush_all(&mut self) {
        self.fill.restart();
        for batcher in 0..self.fill.batchers {
            for p in &self.processors {
                p.flushes.do_send(Flush { batcher });
            }
        }
    }

    /// The batch size it cuts deliveries by.
    pub fn batch_size(&self) -> usize {
        self.fill.batch_size
    }

    /// How many batchers it fills.
    pub fn batchers(&self) -> usize {
        self.fill.batchers
    }

    /// Hands `deliveries` onwards, in chunks.
    pub fn hand_on(&mut self, deliveries: Vec<Delivery>) {
        for (batcher, deliveries) in self.fill.cut(deliveries) {
            let processor = &self.processors[self.next_processor];
            self.next_processor = (self.next_processor + 1) % self.processors.len();
            processor.chunks.do_send(Chunk {
                batcher,
                deliveries,
            });
        }
    }

    /// Feeds `processors` from now on; an empty list changes nothing (false).
    pub fn set_processors(&mut self, processors: Vec<Feed>) -> bool {
        if processors.is_empty() {
            return false;
        }
        self.processors = processors;
        self.next_processor = 0;
        true
    }

    /// How many processors it feeds.
    pub fn processors(&self) -> usize {
        self.processors.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(batchers: usize, batch_size: usize) -> Fill {
        Fill {
            batchers,
            batch_size,
            current: 0,
            filled: 0,
            sinks: SinkStates::new(batchers),
        }
    }

    #[test]
    fn a_sink_busy_past_the_pace_passes_the_turn_to_a_free_one() {
        let mut f = fill(3, 100);
        assert_eq!(f.cut(vec![0, 1]), vec![(0, vec![0, 1])]);
        // Batcher 0's sink takes a batch: a short insert keeps the turn with batcher 0 (natural
        // batching: what arrives meanwhile is its next batch).
        f.sinks.busy(0);
        assert_eq!(f.cut(vec![2]), vec![(0, vec![2])]);
        // Past the pace, the next free sink's batcher takes the turn, a whole batch's worth.
        f.sinks.busy(1);
        let later = Instant::now() + PACE + Duration::from_millis(5);
        f.pass_turn_if_stuck(later);
        assert_eq!((f.current, f.filled), (2, 0));
        // Every sink busy past the pace: the turn stays where it is.
        f.sinks.busy(2);
        f.pass_turn_if_stuck(later + PACE * 2);
        assert_eq!(f.current, 2);
        // Batcher 0's sink answered: it is free again, and takes the turn from a stuck one.
        f.sinks.free(0);
        f.pass_turn_if_stuck(later + PACE * 2);
        assert_eq!((f.current, f.filled), (0, 0));
        // A single batcher never passes its turn.
        let mut one = fill(1, 10);
        one.sinks.busy(0);
        one.pass_turn_if_stuck(later);
        assert_eq!(one.current, 0);
    }

    #[test]
    fn a_batch_s_worth_goes_to_one_batcher_before_the_next_ones_turn() {
        let mut f = fill(2, 3);
        let cut = f.cut((0..8).collect());
        assert_eq!(
            cut,
            vec![(0, vec![0, 1, 2]), (1, vec![3, 4, 5]), (0, vec![6, 7])]
        );
        // The next deliveries fill the batch under way first.
        assert_eq!(f.cut(vec![8, 9]), vec![(0, vec![8]), (1, vec![9])]);
        assert_eq!(f.cut(Vec::<u8>::new()), vec![]);
    }

    #[test]
    fn after_a_flush_the_current_batcher_gets_a_whole_batch_s_worth() {
        let mut f = fill(2, 4);
        assert_eq!(f.cut(vec![0, 1, 2]), vec![(0, vec![0, 1, 2])]);
        // Batcher 0 flushed its 3: the next 4 are one whole batch for it, then batcher 1's turn.
        f.restart();
        assert_eq!(
            f.cut(vec![3, 4, 5, 6, 7]),
            vec![(0, vec![3, 4, 5, 6]), (1, vec![7])]
        );
    }

    #[test]
    fn every_delivery_is_cut_once_in_order() {
        let mut f = fill(3, 7);
        let mut seen = Vec::new();
        for n in [1, 50, 6, 7, 0, 13] {
            let start = seen.len();
            for (batcher, part) in f.cut((start..start + n).collect::<Vec<_>>()) {
                assert!(batcher < 3 && !part.is_empty() && part.len() <= 7);
                seen.extend(part);
            }
        }
        assert_eq!(seen, (0..77).collect::<Vec<_>>());
    }
}
