//! The deliveries a stage acked whose ack the broker may not have handled: the memory that
//! lets a stage a reload starts in another's place ask the old stage's table and parking about
//! exactly those redeliveries, and no other.
//!
//! A reload stops a stage and starts another on the same queue (another table, name or
//! mapping). The old stage's last acks may never reach the broker (its link silent at the
//! close, or reset before it), which then delivers those messages again, redelivered, to the
//! new stage: stored or parked again under the new spec, they would be a second copy. So the new
//! stage asks the old one's table about them (`predecessors::settled_before`). Asked about *every*
//! redelivery, it took messages the old stage never settled for done: a delivery given back
//! (a breaker's hand-back, a stop) whose key the old table held newer was acked as stale and
//! never stored in the new table (review R44 F5, a loss), and every later redelivery paid a
//! question to tables long retired.
//!
//! Per stage (shared with the stage a reload starts in its place, as [`super::copies::Copies`]
//! is), [`Acked`] remembers:
//! - *recent*: the [`AckPrint`] of each delivery the open channel's consumer settled with an ack,
//!   the newest first out of the bound: the broker counts a delivery whose ack it has not
//!   handled among the channel's unacknowledged ones, at most its window, so the acks not
//!   handled are always among the last window's worth (twice the largest window, as the copies'
//!   bound: a cancelled subscription's window beside the new one's);
//! - *lost*: what a channel left in *recent* when it went without a proof. An answered close
//!   proves every ack sent before it handled (the broker handles a channel's frames in order):
//!   its entries go ([`Acked::handled`]).
//!
//! Each entry names the stage incarnation that acked it (each start of a stage is one,
//! [`incarnation`]), so a stage asks a predecessor only about what that predecessor acked. A
//! redelivery with the print of a lost entry of a predecessor is asked of that predecessor, and
//! the entry is used up (one redelivery per ack). A redelivery matching nothing goes its way as
//! any message.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use lapin::BasicProperties;

/// What the memory knows an acked delivery by: a keyed hash (random keys per process) of its
/// body, message id and timestamp. Cheaper than the copies' [`super::copies::Fingerprint`] of
/// every property (computed for every ack, by the stage that settles it); a print two
/// messages share only sends the second to be asked of the old table, which answers for its
/// content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AckPrint(u64);

/// The print of a delivery's `body` and properties (`bare`: its headers are not read).
pub fn print(body: &[u8], bare: &BasicProperties) -> AckPrint {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    let mut h = KEYS.get_or_init(RandomState::new).build_hasher();
    h.write(body);
    match bare.message_id() {
        Some(id) => {
            h.write_u8(1);
            h.write(id.as_str().as_bytes());
        }
        None => h.write_u8(0),
    }
    match bare.timestamp() {
        Some(ts) => {
            h.write_u8(1);
            h.write_u64(*ts);
        }
        None => h.write_u8(0),
    }
    AckPrint(h.finish())
}

/// A new incarnation: each start of a stage is one, so what a stopped stage acked is told from
/// what its successor (the same pipeline and stage, changed by a reload) acks.
pub fn incarnation() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// One acked delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    generation: u64,
    owner: u64,
    print: AckPrint,
}

/// What the lock guards.
#[derive(Debug, Default)]
struct Lists {
    /// Acks of the open channel, oldest first.
    recent: VecDeque<Entry>,
    /// Acks of channels gone without a proof, oldest first.
    lost: VecDeque<Entry>,
    /// How many entries of `lost` have each print: every delivery of a batch is looked up
    /// while `lost` holds anything (one back from the retry queue is no redelivery), in
    /// constant time, where a scan of `lost` (up to ten windows) for each was quadratic.
    index: std::collections::HashMap<AckPrint, u32>,
}

impl Lists {
    /// `index` made again from `lost` (after a change of many entries: rare).
    fn reindex(&mut self) {
        self.index.clear();
        for e in &self.lost {
            *self.index.entry(e.print).or_insert(0) += 1;
        }
    }
}

/// One stage's memory of its acks (see the module doc).
#[derive(Debug)]
pub struct Acked {
    lists: Mutex<Lists>,
    /// Entries each list keeps at most: twice the largest window.
    capacity: AtomicUsize,
    /// Entries in `lost`: while 0, a redelivery is never looked up (no lock).
    lost: AtomicUsize,
}

impl Acked {
    /// The memory of a stage whose window is at most `prefetch`.
    pub fn new(prefetch: u16) -> Self {
        Self {
            lists: Mutex::default(),
            capacity: AtomicUsize::new(capacity(prefetch)),
            lost: AtomicUsize::new(0),
        }
    }

    /// A successor's window may be larger: the bound follows the largest.
    pub fn widen(&self, prefetch: u16) {
        self.capacity
            .fetch_max(capacity(prefetch), Ordering::AcqRel);
    }

    fn lists(&self) -> std::sync::MutexGuard<'_, Lists> {
        // Each change is one call: a panic while holding the lock leaves the lists consistent.
        self.lists.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The consumer of incarnation `owner` acked these deliveries (by print) on the channel
    /// of `generation`, its open one; each under the predecessor that settled it, if one did
    /// (its table or parking answers for it if this ack is lost too).
    pub fn acked(&self, generation: u64, owner: u64, prints: &[(AckPrint, Option<u64>)]) {
        if prints.is_empty() {
            return;
        }
        let cap = self.capacity.load(Ordering::Acquire);
        let mut lists = self.lists();
        lists.recent.extend(prints.iter().map(|&(print, by)| Entry {
            generation,
            owner: by.unwrap_or(owner),
            print,
        }));
        let over = lists.recent.len().saturating_sub(cap);
        lists.recent.drain(..over);
    }

    /// The channel went without a proof that the broker handled its acks: they are lost, and
    /// their messages may come again. Answers how many lost entries were forgotten to keep
    /// the bound ([`trim_lost`]).
    pub fn link_down(&self) -> usize {
        let cap = self.capacity.load(Ordering::Acquire);
        let mut lists = self.lists();
        let recent = std::mem::take(&mut lists.recent);
        lists.lost.extend(recent);
        let forgotten = trim_lost(&mut lists.lost, cap);
        lists.reindex();
        self.lost.store(lists.lost.len(), Ordering::Release);
        forgotten
    }

    /// The channel of `generation` closed with an answer: the broker handled every ack sent on
    /// it, none of its messages comes again.
    pub fn handled(&self, generation: u64) {
        let mut lists = self.lists();
        lists.recent.retain(|e| e.generation != generation);
        lists.lost.retain(|e| e.generation != generation);
        lists.reindex();
        self.lost.store(lists.lost.len(), Ordering::Release);
    }

    /// Whether the consumer of incarnation `owner` acked deliveries that no answered close
    /// proved handled (those messages may come again: its close went unanswered, or its
    /// channel went without one).
    pub fn unproven(&self, owner: u64) -> bool {
        let lists = self.lists();
        lists
            .recent
            .iter()
            .chain(&lists.lost)
            .any(|e| e.owner == owner)
    }

    /// Forgets every entry of the stage incarnation `owner`, which no stage asks about any
    /// more (more stages stopped on its queue than [`PREDECESSORS`]); answers how many went.
    pub fn forget(&self, owner: u64) -> usize {
        let mut lists = self.lists();
        let before = lists.recent.len() + lists.lost.len();
        lists.recent.retain(|e| e.owner != owner);
        lists.lost.retain(|e| e.owner != owner);
        lists.reindex();
        self.lost.store(lists.lost.len(), Ordering::Release);
        before - lists.recent.len() - lists.lost.len()
    }

    /// Whether any lost ack is remembered (a redelivery needs looking up).
    pub fn any_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire) > 0
    }

    /// Of `asked` (an index and the print of a redelivery), those a lost ack of one of `owners`
    /// settled: each with that owner. Each entry found is used up.
    pub fn take_lost(&self, asked: &[(usize, AckPrint)], owners: &[u64]) -> Vec<(usize, u64)> {
        if !self.any_lost() {
            return Vec::new();
        }
        let mut lists = self.lists();
        let mut found = Vec::new();
        for &(i, print) in asked {
            if !lists.index.contains_key(&print) {
                continue;
            }
            let at = lists
                .lost
                .iter()
                .position(|e| e.print == print && owners.contains(&e.owner));
            if let Some(at) = at
                && let Some(e) = lists.lost.remove(at)
            {
                if let Some(n) = lists.index.get_mut(&print) {
                    *n -= 1;
                    if *n == 0 {
                        lists.index.remove(&print);
                    }
                }
                found.push((i, e.owner));
            }
        }
        self.lost.store(lists.lost.len(), Ordering::Release);
        found
    }
}

impl Acked {
    /// Acks of a channel that closed before they were sent (the settlement came too late):
    /// the broker delivers those messages again. Those a predecessor settled are remembered
    /// again under it; their entries were used up when they were found, and the next
    /// redelivery, taken as new, was stored in the new table too (found by the test
    /// `reload two_reloads_before_the_old_link_drops_store_each_message_once`: the new stage's
    /// link cut while it acked the old stages' window).
    pub fn dropped(&self, prints: &[(AckPrint, Option<u64>)]) {
        let mut by: Vec<(u64, AckPrint)> = prints
            .iter()
            .filter_map(|&(print, by)| by.map(|owner| (owner, print)))
            .collect();
        by.sort_by_key(|(owner, _)| *owner);
        for group in by.chunk_by(|a, b| a.0 == b.0) {
            let prints: Vec<AckPrint> = group.iter().map(|(_, p)| *p).collect();
            self.give_back(group[0].0, &prints);
        }
    }

    /// Lost acks of `owner` taken by [`Acked::take_lost`] whose question could not be answered
    /// (the old table locked): remembered again, for when those messages come back.
    pub fn give_back(&self, owner: u64, prints: &[AckPrint]) {
        let mut lists = self.lists();
        // Generation 0 is no channel's: no close proves them.
        lists.lost.extend(prints.iter().map(|&print| Entry {
            generation: 0,
            owner,
            print,
        }));
        trim_lost(&mut lists.lost, self.capacity.load(Ordering::Acquire));
        lists.reindex();
        self.lost.store(lists.lost.len(), Ordering::Release);
    }
}

/// The most stages of one kind on one queue a stage started by a reload asks about its
/// redeliveries (the newest): reloads in a row, a pipeline removed and added back.
pub const PREDECESSORS: usize = 4;

/// Keeps, of each stage incarnation, the newest `cap` lost acks and the newest `cap` entries
/// given back ([`Acked::give_back`], generation 0: a statement's outcome unknown at its stop,
/// a question a locked table did not answer), and the newest `2 x cap x (PREDECESSORS + 1)` in
/// all (a stage and the predecessors it asks); answers how many it forgot. One bound for all
/// (the newest `cap`) forgot an earlier stage's lost acks once the next stopped stage lost its
/// own (review R46a F1: two reloads in a row behind a stalled link, and the first stage's whole
/// window was stored again in the third table); and a stage's last acks, moved here after what
/// its stop gave back, would push that out.
fn trim_lost(lost: &mut VecDeque<Entry>, cap: usize) -> usize {
    let limit = cap.saturating_mul(2 * (PREDECESSORS + 1));
    if lost.len() <= cap {
        return 0;
    }
    let mut per_owner: std::collections::HashMap<(u64, bool), usize> =
        std::collections::HashMap::new();
    let mut kept = 0;
    let mut keep = vec![false; lost.len()];
    for (i, e) in lost.iter().enumerate().rev() {
        let n = per_owner.entry((e.owner, e.generation == 0)).or_insert(0);
        if *n < cap && kept < limit {
            *n += 1;
            kept += 1;
            keep[i] = true;
        }
    }
    let before = lost.len();
    let mut at = 0;
    lost.retain(|_| {
        at += 1;
        keep[at - 1]
    });
    before - lost.len()
}

/// The entries a list keeps for a window of `prefetch`: twice the prefetch.
fn capacity(prefetch: u16) -> usize {
    usize::from(prefetch.max(1)) * 2
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::ShortString;

    /// Prints acked by the stage itself (no predecessor settled them).
    fn own(prints: &[AckPrint]) -> Vec<(AckPrint, Option<u64>)> {
        prints.iter().map(|&p| (p, None)).collect()
    }

    /// The print of a delivery of `body` with the message id `id`.
    fn printed(body: &str, id: Option<&str>) -> AckPrint {
        let mut p = BasicProperties::default();
        if let Some(id) = id {
            p = p.with_message_id(ShortString::from(id));
        }
        print(body.as_bytes(), &p)
    }

    #[test]
    fn a_print_tells_bodies_and_message_ids_apart() {
        let a = printed("body", Some("m-1"));
        assert_eq!(a, printed("body", Some("m-1")));
        assert_ne!(a, printed("bodz", Some("m-1")));
        assert_ne!(a, printed("body", Some("m-2")));
        assert_ne!(a, printed("body", None));
    }

    #[test]
    fn only_what_a_lost_link_acked_is_found_and_each_once() {
        let m = Acked::new(4);
        let (a, b) = (printed("a", None), printed("b", None));
        m.acked(1, 7, &own(&[a, b]));
        // Not lost yet: the link is up.
        assert!(m.take_lost(&[(0, a)], &[7]).is_empty());
        m.link_down();
        // Another owner's question finds nothing; the owner's finds each once.
        assert!(m.take_lost(&[(0, a)], &[8]).is_empty());
        assert_eq!(m.take_lost(&[(0, a), (1, b)], &[7]), [(0, 7), (1, 7)]);
        assert!(m.take_lost(&[(0, a), (1, b)], &[7]).is_empty());
        assert!(!m.any_lost());
    }

    /// A redelivery a predecessor settled, acked by its successor on the predecessor's
    /// behalf: when that ack is lost too (the link down) or never sent (the channel closed
    /// before the settlement), the next redelivery is found under the predecessor again. Found
    /// by the test `reload two_reloads_before_the_old_link_drops_store_each_message_once`:
    /// used up at the first redelivery, the second was taken as new and stored again.
    #[test]
    fn an_ack_made_on_a_predecessors_behalf_stays_its_when_lost_or_dropped() {
        let m = Acked::new(4);
        let (a, b) = (printed("a", None), printed("b", None));
        m.acked(1, 7, &own(&[a, b]));
        m.link_down();
        assert_eq!(m.take_lost(&[(0, a), (1, b)], &[7, 8]), [(0, 7), (1, 7)]);
        // Stage 8 acks a for 7 on its channel 2, which goes without a proof; its settlement of
        // b comes after its channel closed.
        m.acked(2, 8, &[(a, Some(7))]);
        m.dropped(&[(b, Some(7))]);
        m.link_down();
        assert_eq!(m.take_lost(&[(0, a), (1, b)], &[7, 8]), [(0, 7), (1, 7)]);
        // Its own dropped settlements are not remembered: its own table answers for them.
        m.dropped(&own(&[a]));
        assert!(!m.any_lost());
    }

    /// A stage pushed out of the stages a successor asks (more than `PREDECESSORS` stopped on
    /// its queue) has its entries forgotten, counted; the others' stay.
    #[test]
    fn a_forgotten_stages_entries_go_and_are_counted() {
        let m = Acked::new(4);
        let (a, b, c) = (printed("a", None), printed("b", None), printed("c", None));
        m.acked(1, 7, &own(&[a, b]));
        m.acked(1, 8, &own(&[c]));
        m.link_down();
        assert_eq!(m.forget(7), 2);
        assert_eq!(m.forget(7), 0);
        assert!(m.take_lost(&[(0, a), (1, b)], &[7, 8]).is_empty());
        assert_eq!(m.take_lost(&[(0, c)], &[8]), [(0, 8)]);
    }

    #[test]
    fn an_answered_close_proves_its_channels_acks() {
        let m = Acked::new(4);
        let a = printed("a", None);
        m.acked(1, 7, &own(&[a]));
        m.link_down();
        m.acked(2, 7, &own(&[a]));
        // The close of channel 2 was answered, before or after the successor took the memory.
        m.handled(2);
        m.link_down();
        assert_eq!(m.take_lost(&[(0, a)], &[7]), [(0, 7)]);
        assert!(m.take_lost(&[(0, a)], &[7]).is_empty());
    }

    #[test]
    fn the_memory_keeps_twice_the_window_newest_last() {
        let m = Acked::new(2);
        let prints: Vec<AckPrint> = (0..6).map(|i| printed(&i.to_string(), None)).collect();
        m.acked(1, 7, &own(&prints));
        m.link_down();
        // Only the last four (twice the window of two) can be unhandled.
        assert!(m.take_lost(&[(0, prints[1])], &[7]).is_empty());
        assert_eq!(m.take_lost(&[(0, prints[2])], &[7]), [(0, 7)]);
        assert_eq!(m.take_lost(&[(5, prints[5])], &[7]), [(5, 7)]);
    }

    /// Review R46a F1: two stages in a row that lost their acks (reloads behind a stalled
    /// link) are both remembered, each up to twice its window; only past the bound of all the
    /// stages a successor asks are the oldest forgotten.
    #[test]
    fn each_stopped_stage_keeps_its_own_lost_acks() {
        let a = Acked::new(2); // 4 a stage
        let prints: Vec<AckPrint> = (0..64).map(|i| printed(&format!("m{i}"), None)).collect();
        // Stage 1 acks 4 and loses its link; stage 2 acks 4 more (then 2 more, pushing its
        // own oldest 2 out of `recent`) and loses its link.
        a.acked(1, 1, &own(&prints[0..4]));
        assert_eq!(a.link_down(), 0);
        a.acked(2, 2, &own(&prints[4..10]));
        assert_eq!(a.link_down(), 0);
        let asked: Vec<(usize, AckPrint)> = prints[0..10].iter().copied().enumerate().collect();
        let found = a.take_lost(&asked, &[1, 2]);
        assert_eq!(
            found,
            [
                (0, 1),
                (1, 1),
                (2, 1),
                (3, 1),
                (6, 2),
                (7, 2),
                (8, 2),
                (9, 2)
            ],
            "stage 1's four and stage 2's newest four"
        );
        // What a stop gave back (a statement's outcome unknown) beside a full window of lost
        // acks of the same stage: both kept (review R46a F6).
        a.give_back(3, &prints[10..14]);
        a.acked(3, 3, &own(&prints[14..18]));
        assert_eq!(a.link_down(), 0);
        let asked: Vec<(usize, AckPrint)> = prints[10..18].iter().copied().enumerate().collect();
        assert_eq!(a.take_lost(&asked, &[3]).len(), 8);
        // Eleven stages of 4 lost acks each, past 2 x 4 x (PREDECESSORS + 1) = 40: the oldest
        // stage's are forgotten.
        let mut forgotten = 0;
        for stage in 0..11u64 {
            let from = 20 + stage as usize * 4;
            a.acked(stage + 10, stage + 10, &own(&prints[from..from + 4]));
            forgotten += a.link_down();
        }
        assert_eq!(forgotten, 4);
        let asked: Vec<(usize, AckPrint)> = prints[20..64].iter().copied().enumerate().collect();
        let found = a.take_lost(&asked, &(10..21).collect::<Vec<u64>>());
        assert_eq!(found.len(), 40, "{found:?}");
        assert!(found.iter().all(|(i, _)| *i >= 4), "{found:?}");
    }
}
