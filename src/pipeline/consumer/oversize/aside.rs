//! Deliveries over `MAX_MESSAGE_BYTES` a stage holds aside (unacked, unread) while it waits for
//! the process's permit or holds another such body, and the order of their turns: by the
//! bodies' failed parks, told by [`identity`] (a delivery tag changes at every delivery).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::ASIDE_MAX;

/// What tells one body over the limit from another while it is held aside (its delivery tag
/// changes at every delivery): its message id, correlation id, timestamp and size, hashed.
/// Two bodies alike in all four share their failed parks' count, nothing more.
pub(in crate::pipeline::consumer) fn identity(
    properties: &lapin::BasicProperties,
    size: u64,
) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    properties
        .message_id()
        .as_ref()
        .map(|s| s.as_str())
        .hash(&mut h);
    properties
        .correlation_id()
        .as_ref()
        .map(|s| s.as_str())
        .hash(&mut h);
    properties.timestamp().hash(&mut h);
    size.hash(&mut h);
    h.finish()
}

/// Deliveries over the limit held aside, of the current channel: unacked, nothing of them
/// stored.
#[derive(Debug, Default)]
pub(in crate::pipeline::consumer) struct Aside {
    /// Each delivery's tag and its body's identity ([`identity`]).
    tags: std::collections::VecDeque<(u64, u64)>,
    /// When the first of them was held aside.
    since: Option<Instant>,
}

impl Aside {
    pub(super) fn push(&mut self, tag: u64, identity: u64) {
        self.since.get_or_insert_with(Instant::now);
        self.tags.push_back((tag, identity));
    }

    pub(super) fn room(&self) -> bool {
        self.tags.len() < ASIDE_MAX
    }

    pub(super) fn take(&mut self) -> Vec<u64> {
        self.since = None;
        std::mem::take(&mut self.tags)
            .into_iter()
            .map(|(tag, _)| tag)
            .collect()
    }

    /// The next to take its turn, taken alone: of those whose parks failed the fewest times
    /// (`failed`, by identity), the oldest held aside; the clock of the others goes on. By
    /// identity, not by place: a give-back (`aside_aged`), a lost link or a stop puts every
    /// body back at the queue's head in its first order, and a rotation by place began again
    /// there, at the bodies parking always refuses (review R38f F2: 5 bodies parking would
    /// take never tried in 4 minutes).
    /// Bodies alike in all that tells them apart share their count: among them, each failed park
    /// moves the turn to the next in order (review R38g F3: the oldest of one id and size took
    /// every turn of all of them).
    pub(super) fn take_next(&mut self, failed: &HashMap<u64, u32>) -> Option<u64> {
        let failures = |id: &u64| failed.get(id).copied().unwrap_or(0);
        let (_, (_, chosen)) = self
            .tags
            .iter()
            .enumerate()
            .min_by_key(|(i, (_, id))| (failures(id), *i))?;
        let chosen = *chosen;
        let alike: Vec<usize> = (0..self.tags.len())
            .filter(|&i| self.tags[i].1 == chosen)
            .collect();
        let at = alike[failures(&chosen) as usize % alike.len()];
        let (tag, _) = self.tags.remove(at)?;
        if self.tags.is_empty() {
            self.since = None;
        }
        Some(tag)
    }

    pub(super) fn held_longer_than(&self, bound: Duration) -> bool {
        self.since.is_some_and(|since| since.elapsed() > bound)
    }

    pub(super) fn len(&self) -> usize {
        self.tags.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.tags.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aside(n: u64) -> Aside {
        let mut aside = Aside::default();
        (0..n).for_each(|t| aside.push(t, t));
        aside
    }

    /// At a turn with the permit only one held aside is given back: the oldest of those whose
    /// parks failed the fewest times (by identity, whatever their place: review R38f F2); the
    /// clock of the others goes on until the last is taken.
    #[test]
    fn a_turn_takes_the_oldest_of_the_least_failed_held_aside_alone() {
        let none = HashMap::new();
        let mut held = aside(3);
        let since = held.since;
        assert_eq!(held.take_next(&none), Some(0));
        assert_eq!(held.tags, [(1, 1), (2, 2)]);
        assert_eq!(held.since, since, "the others' clock goes on");
        assert_eq!(held.take_next(&none), Some(1));
        assert_eq!(held.take_next(&none), Some(2));
        assert!(held.since.is_none());
        assert_eq!(held.take_next(&none), None);
        // Bodies 0 and 1 failed to park (0 twice): 2, then 3, then 1, then 0.
        let failed = HashMap::from([(0, 2), (1, 1)]);
        let mut held = aside(4);
        let order: Vec<u64> = std::iter::from_fn(|| held.take_next(&failed)).collect();
        assert_eq!(order, [2, 3, 1, 0]);
        // Three bodies alike (one identity, 7) that failed once between them: the second's
        // turn, not the first's again (review R38g F3).
        let mut alike = Aside::default();
        (10..13).for_each(|t| alike.push(t, 7));
        assert_eq!(alike.take_next(&HashMap::from([(7, 1)])), Some(11));
    }

    /// What is held aside is timed from the first of them, and taking them clears the clock.
    #[test]
    fn what_is_held_aside_is_timed_from_the_first_and_taken_whole() {
        let mut held = aside(3);
        assert!(!held.held_longer_than(Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(5));
        assert!(held.held_longer_than(Duration::from_millis(1)));
        assert_eq!(held.take(), vec![0, 1, 2]);
        assert!(held.is_empty());
        assert!(!held.held_longer_than(Duration::ZERO));
    }
}
