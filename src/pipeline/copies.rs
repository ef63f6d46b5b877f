//! The copies a stage republished of deliveries whose ack the broker may not have handled: the
//! memory that keeps a redelivery of such a message from being routed (retried, dead-lettered,
//! sent back to the DLQ) a second time.
//!
//! The fallback stage acks a message once its copy is confirmed, and AMQP acks are not
//! confirmed: when the consumer's channel dies after the copy was confirmed and before the broker
//! handled the ack, the broker delivers the original again (redelivered), and routed again it
//! made a second copy (found by review: 100 of 500 malformed messages twice in the DLQ under
//! load). Per stage, [`Copies`] remembers:
//! - the generation of the consumer's open channel (0 while there is none);
//! - *unproven*: each delivery of the open channel whose copy is being published or was
//!   confirmed, until a later round trip on that channel proves the broker handled its ack (the
//!   acker's fence, `acks.rs`: the broker handles a channel's frames in order, so the answer to
//!   a synchronous method sent after an ack comes after the ack was handled);
//! - *lost*: what dead channels left unproven. The broker delivers those again. A redelivery
//!   (its redelivered flag set) with the same [`Fingerprint`] as a confirmed one is acked as
//!   already routed instead of routed again, and the entry is used up (one redelivery per copy);
//!   the new ack is unproven in its turn, so a second lost link is covered too. A redelivery
//!   whose copy is still being published waits for that publish's outcome. A delivery that was
//!   never delivered before is never looked up, so an identical second message is routed as any
//!   other.
//!
//!
//! A copy whose confirm does not come within `PUBLISH_TIMEOUT_MS` is *in doubt*, not failed: it
//! was sent, and the broker may hold it (under a memory or disk alarm it confirms late). Its
//! original goes back to its queue (nacked) all the same, and its entry moves to *lost*
//! ([`Copies::in_doubt`]; no ack of it can be proven, the nack is not one), so that the
//! redelivery (redelivered flag, a new tag, the same fingerprint) waits for the outcome while the
//! publisher still awaits the confirm in the background (`publisher::LATE_CONFIRMS`); the late
//! outcome comes through [`Copies::published`]: confirmed, the redelivery is acked as already
//! routed; not (nacked, returned unroutable, the publisher's channel failed, no answer after
//! all), it is routed. A confirm lost with the publisher's link stays unknowable (the broker may
//! or may not hold the copy): such a copy counts as not confirmed and its original is routed
//! again, since a duplicate beats a loss.
//!
//! The bound: a channel's unproven acks are deliveries the broker still counts as unacked, at
//! most its prefetch window (two while a cancelled subscription's deliveries are still held), so
//! *lost* keeps at most twice the prefetch, oldest forgotten first (counted and logged): a
//! forgotten copy's redelivery is routed again, a second copy as before. Copies in doubt count
//! against the same bound (they were deliveries of the window too). Entries a redelivery never
//! uses up (the ack did land before the link died; the redelivery went to another instance, or
//! was inserted this time) stay until pushed out.
//!
//! The memory is the process's own, and outlives a stage a reload restarts: the stage started
//! in its place (a stage of the same kind on the same queue, the same pipeline or one renamed)
//! takes it over ([`Copies::carry_on`]), and the generations of its links go on from the old
//! stage's, so a redelivery of what the old stage left is still recognised. What the stopped
//! stages stored or parked may come again too (the acks of their last commits lost with their
//! link): the memory also holds the acks that may be lost (`acked.rs`), and a stage a reload
//! starts asks the stopped stages' tables about those redeliveries (`predecessors::settled_before`) and
//! their parking (`Fallback::parked_before`; the app keeps them, `app/pipelines.rs`). A stage
//! no reload replaced at once (a pipeline removed) leaves its memory with the app until a stage
//! is started on its queue. A redelivery to another
//! instance, or after warren itself restarted, is routed as any other.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use lapin::BasicProperties;
use tokio::sync::Notify;
use tracing::{info, warn};

use super::acked::Acked;
use super::message::Delivery;
use crate::metrics::StageId;

/// What the memory knows a message by: a keyed hash (random keys per process, so nobody can
/// make two messages collide on purpose) of its body and every property, headers included, but
/// the broker's redelivery count (`x-delivery-count`, which a quorum queue adds to a redelivery).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(u64);

/// One delivery whose copy is being published or was confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    generation: u64,
    tag: u64,
    fingerprint: Fingerprint,
    /// The copy was confirmed (else its publish is under way, or in doubt).
    confirmed: bool,
    /// Its original was given back to its queue (nack with requeue) while its copy was in
    /// doubt: no ack of it can be proven, and its redelivery comes on any channel.
    given_back: bool,
}

/// What the lock guards.
#[derive(Debug, Default)]
struct State {
    /// The open channel's generation, 0 while there is none.
    live: u64,
    /// The last generation handed out: the next link's is one more, also when the memory
    /// passed to the stage a reload started in its place (its consumer counts from here).
    last: u64,
    /// Deliveries of the open channel whose ack is not proven handled.
    unproven: Vec<Entry>,
    /// Deliveries of dead channels whose ack was not proven handled, oldest first.
    lost: VecDeque<Entry>,
}

/// What the memory says of a redelivery that is about to be routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recall {
    /// Its copy was confirmed before its channel died: ack it as already routed.
    Routed,
    /// A copy of it is still being published for a channel that died: wait for the outcome.
    Pending,
    /// Nothing known: route it.
    Unknown,
}

/// One stage's memory of its copies (see the module doc). Shared by the consumer (its channel's
/// generation, the acker's proofs) and the fallback stage (what it publishes and recalls).
#[derive(Debug)]
pub struct Copies {
    /// The pipeline and stage, the labels of its log lines and metric.
    stage: StageId,
    /// The open channel's generation, read without the lock by the fallback stage.
    live: AtomicU64,
    /// Entries in `unproven`: while 0, the acker never takes the lock nor fences.
    unproven: AtomicUsize,
    /// Entries `lost` holds at most (twice the prefetch; the larger prefetch once handed to a
    /// successor).
    capacity: AtomicUsize,
    /// The queue the stage consumes: a successor on another queue starts with a memory of its
    /// own.
    queue: String,
    /// The fingerprints' keys, random per process.
    keys: RandomState,
    /// Shared with the memory of a stage renamed by a reload on the same queue: the old stage's
    /// late publish outcomes still reach the entries its successor waits on.
    state: Arc<Mutex<State>>,
    /// Woken when a publish under way ends: a redelivery may wait for it.
    outcomes: Arc<Notify>,
    /// Woken when the consumer's channel goes: a backoff holding its deliveries ends
    /// ([`Copies::gone`]).
    links: Notify,
    /// The deliveries its consumer acked whose ack may not have reached the broker
    /// (`acked.rs`), handed on with the rest of the memory.
    acked: Arc<Acked>,
}

impl Copies {
    /// The memory of `stage`, which consumes `queue` with a window of at most `prefetch`.
    pub fn new(stage: StageId, queue: &str, prefetch: u16) -> Self {
        Self {
            stage,
            live: AtomicU64::new(0),
            unproven: AtomicUsize::new(0),
            capacity: AtomicUsize::new(capacity(prefetch)),
            queue: queue.to_string(),
            keys: RandomState::new(),
            state: Default::default(),
            outcomes: Default::default(),
            links: Notify::new(),
            acked: Arc::new(Acked::new(prefetch)),
        }
    }

    /// The memory of `stage` (consuming `queue`, a window of at most `prefetch`) that a reload
    /// starts: `kept`, the memory of the stage it replaces, when that one was a stage of the
    /// same kind on the same queue (the redeliveries of what it left come to this one), else a
    /// new one. The stage it replaces has stopped: its link is down, what it left unproven is
    /// lost. A pipeline renamed on the same queue gets what the old name's memory held, under
    /// its own name (review R40a F6: the redeliveries were routed again, a second copy).
    pub fn carry_on(
        kept: Option<Arc<Copies>>,
        stage: StageId,
        queue: &str,
        prefetch: u16,
    ) -> Arc<Copies> {
        match kept {
            Some(kept) if kept.stage.stage() == stage.stage() && kept.queue == queue => {
                kept.capacity
                    .fetch_max(capacity(prefetch), Ordering::AcqRel);
                kept.acked.widen(prefetch);
                kept.link_down();
                if kept.stage == stage {
                    return kept;
                }
                let mut renamed = Self::new(stage, queue, prefetch);
                // The same keys: the lost entries are found by the fingerprints they made.
                renamed.keys = kept.keys.clone();
                renamed
                    .capacity
                    .fetch_max(kept.capacity.load(Ordering::Acquire), Ordering::AcqRel);
                // The same entries and generations, and the same wake-ups: a copy the old stage
                // was still publishing, or had in doubt, ends through the old stage's publisher,
                // which tells the old memory (review R42b F6: moved to a memory of their own,
                // their redeliveries waited on outcomes that never came, requeued every 15 s
                // until a restart).
                renamed.state = kept.state.clone();
                renamed.outcomes = kept.outcomes.clone();
                renamed.acked = kept.acked.clone();
                Arc::new(renamed)
            }
            _ => Arc::new(Self::new(stage, queue, prefetch)),
        }
    }

    /// The deliveries the stage's consumers acked whose acks may be lost (`acked.rs`).
    pub fn acked(&self) -> &Acked {
        &self.acked
    }

    /// The memory of acks, shared by every stage carried on from this one.
    pub fn acked_memory(&self) -> Arc<Acked> {
        self.acked.clone()
    }

    /// The queue the stage consumes.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The pipeline and stage whose memory this is.
    pub fn stage(&self) -> &StageId {
        &self.stage
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock leaves the lists consistent (each change is one call).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The generation of the consumer's open channel, 0 while there is none.
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Acquire)
    }

    /// The consumer opened a channel: answers its generation (one more than the last).
    pub fn link_up(&self) -> u64 {
        let live = {
            let mut state = self.state();
            state.last += 1;
            state.live = state.last;
            self.live.store(state.live, Ordering::Release);
            state.live
        };
        self.links.notify_waiters();
        live
    }

    /// The consumer's channel is gone: what it left unproven is the broker's again, and comes
    /// back redelivered.
    pub fn link_down(&self) {
        let acks_forgotten = self.acked.link_down();
        if acks_forgotten > 0 {
            warn!(
                pipeline = self.stage.pipeline(),
                stage = self.stage.stage().as_str(),
                count = acks_forgotten,
                "more acks the broker may not have handled than this stage and the stages it \
                 replaced can remember (twice the prefetch each): the oldest are forgotten, \
                 and a redelivery of one is taken as a new message"
            );
        }
        let (moved, forgotten) = {
            let mut state = self.state();
            state.live = 0;
            self.live.store(0, Ordering::Release);
            let unproven = std::mem::take(&mut state.unproven);
            self.unproven.store(0, Ordering::Release);
            let moved = unproven.len();
            state.lost.extend(unproven);
            (moved, self.trim(&mut state))
        };
        self.links.notify_waiters();
        if moved > 0 {
            info!(
                pipeline = self.stage.pipeline(),
                stage = self.stage.stage().as_str(),
                count = moved,
                "copies made of deliveries whose ack the broker may not have handled when the \
                 link went down: their redeliveries are acked as already routed"
            );
        }
        self.forgot(forgotten);
    }

    /// Resolves once the channel of `generation` is gone (the link went down, or a newer one
    /// is up): its unsettled deliveries are the broker's again, and holding them longer (a
    /// requeue backoff) only keeps the consumer counting them in flight (review R38g F4: a body
    /// whose park failed held its stage still for its whole backoff, up to 60 s, after each
    /// lost link).
    pub async fn gone(&self, generation: u64) {
        loop {
            let notified = self.links.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.live() != generation {
                return;
            }
            notified.await;
        }
    }

    /// Forgets the oldest of `lost` past the capacity: answers how many.
    fn trim(&self, state: &mut State) -> usize {
        // A stage and the stages it replaced (`acked::PREDECESSORS`), each a window's worth
        // twice: the copies of several reloads in a row behind a stalled link.
        let bound = self
            .capacity
            .load(Ordering::Acquire)
            .saturating_mul(super::acked::PREDECESSORS + 1);
        let over = state.lost.len().saturating_sub(bound);
        state.lost.drain(..over);
        over
    }

    /// Counts and logs `forgotten` copies pushed out of `lost`.
    fn forgot(&self, forgotten: usize) {
        if forgotten > 0 {
            crate::metrics::redeliveries(&self.stage, "forgotten", forgotten as u64);
            warn!(
                pipeline = self.stage.pipeline(),
                stage = self.stage.stage().as_str(),
                count = forgotten,
                capacity = self.capacity.load(Ordering::Acquire),
                "more copies with unproven acks than this stage and the stages it replaced can \
                 remember (twice the prefetch each): the oldest are \
                 forgotten, and their redeliveries are routed again"
            );
        }
    }

    /// The fingerprint of `d`'s body and properties.
    pub fn fingerprint(&self, d: &Delivery) -> Fingerprint {
        let mut h = self.keys.build_hasher();
        h.write(&d.body);
        hash_properties(&mut h, &d.properties.full());
        Fingerprint(h.finish())
    }

    /// Whether any copy of a dead channel is remembered (a redelivery needs looking up).
    pub fn any_lost(&self) -> bool {
        !self.state().lost.is_empty()
    }

    /// Copies of these deliveries (generation, tag, fingerprint) are about to be published:
    /// answers, for each, whether it may be (false: its channel is gone, the broker has it
    /// again; the delivery must not be routed).
    pub fn publishing(&self, items: &[(u64, u64, Fingerprint)]) -> Vec<bool> {
        let mut state = self.state();
        let live = state.live;
        let answers = items
            .iter()
            .map(|&(generation, tag, fingerprint)| {
                let ok = generation == live && live != 0;
                if ok {
                    state.unproven.push(Entry {
                        generation,
                        tag,
                        fingerprint,
                        confirmed: false,
                        given_back: false,
                    });
                }
                ok
            })
            .collect();
        self.unproven.store(state.unproven.len(), Ordering::Release);
        answers
    }

    /// The publishes of copies of these deliveries (generation, tag, confirmed) ended: a
    /// confirmed one is remembered until its ack is proven, any other is forgotten (its original
    /// is given back or parked, which is idempotent).
    pub fn published(&self, outcomes: &[(u64, u64, bool)]) {
        {
            let mut state = self.state();
            for &(generation, tag, confirmed) in outcomes {
                let at = |e: &Entry| e.generation == generation && e.tag == tag;
                if let Some(i) = state.unproven.iter().position(at) {
                    if confirmed {
                        state.unproven[i].confirmed = true;
                    } else {
                        state.unproven.swap_remove(i);
                    }
                } else if let Some(i) = state.lost.iter().position(at) {
                    if confirmed {
                        state.lost[i].confirmed = true;
                    } else {
                        state.lost.remove(i);
                    }
                }
            }
            self.unproven.store(state.unproven.len(), Ordering::Release);
        }
        self.outcomes.notify_waiters();
    }

    /// The copies of these deliveries (generation, tag) were sent and not confirmed in time:
    /// the broker may hold them, and their originals go back to their queue. Each is remembered
    /// as lost (the redelivery, with a new tag, finds it by its fingerprint and waits for the
    /// outcome) until [`Copies::published`] tells its late outcome.
    pub fn in_doubt(&self, items: &[(u64, u64)]) {
        let forgotten = {
            let mut state = self.state();
            for &(generation, tag) in items {
                let at = |e: &Entry| e.generation == generation && e.tag == tag;
                if let Some(i) = state.unproven.iter().position(at) {
                    let mut entry = state.unproven.swap_remove(i);
                    entry.given_back = true;
                    state.lost.push_back(entry);
                } else if let Some(e) = state.lost.iter_mut().find(|e| at(e)) {
                    e.given_back = true;
                }
            }
            self.unproven.store(state.unproven.len(), Ordering::Release);
            self.trim(&mut state)
        };
        self.forgot(forgotten);
    }

    /// Whether copies whose ack may be lost are remembered: while not, no redelivery needs
    /// looking up.
    pub fn remembers_lost(&self) -> bool {
        !self.state().lost.is_empty()
    }

    /// What is known of `d`, a redelivery about to be routed, whose fingerprint is
    /// `fingerprint`. On [`Recall::Routed`] the remembered copy is used up, and `d`'s own ack is
    /// unproven from now on (acked on its channel, which may die in its turn).
    pub fn recall(&self, d: &Delivery, fingerprint: Fingerprint) -> Recall {
        let mut state = self.state();
        if !d.redelivered || d.generation != state.live || state.live == 0 {
            return Recall::Unknown;
        }
        let same = |e: &Entry| e.fingerprint == fingerprint;
        if let Some(i) = state.lost.iter().position(|e| same(e) && e.confirmed) {
            state.lost.remove(i);
            state.unproven.push(Entry {
                generation: d.generation,
                tag: d.tag,
                fingerprint,
                confirmed: true,
                given_back: false,
            });
            self.unproven.store(state.unproven.len(), Ordering::Release);
            Recall::Routed
        } else if state.lost.iter().any(same) {
            Recall::Pending
        } else {
            Recall::Unknown
        }
    }

    /// Wakes when a publish under way ends. Take it before [`Copies::recall`] answers
    /// [`Recall::Pending`], so an outcome in between is not missed.
    pub fn outcome(&self) -> tokio::sync::futures::Notified<'_> {
        self.outcomes.notified()
    }

    /// Whether the acker of channel `generation` should fence: it has copies whose ack it sent
    /// (every tag up to `upto` is acked, and the tags of `ones`) and that are not proven yet.
    pub fn provable(&self, generation: u64, upto: u64, ones: &[u64]) -> bool {
        if self.unproven.load(Ordering::Acquire) == 0 {
            return false;
        }
        let state = self.state();
        state
            .unproven
            .iter()
            .any(|e| covered(e, generation, upto, ones))
    }

    /// The broker handled every ack the acker of channel `generation` sent so far (a fence was
    /// answered): those copies are forgotten, also when their link died since (the proof came
    /// first).
    pub fn prove(&self, generation: u64, upto: u64, ones: &[u64]) {
        let mut state = self.state();
        state
            .unproven
            .retain(|e| !covered(e, generation, upto, ones));
        state.lost.retain(|e| !covered(e, generation, upto, ones));
        self.unproven.store(state.unproven.len(), Ordering::Release);
    }

    /// Whether no copy waits for a proof (the acker forgets the tags it acked alone).
    pub fn none_unproven(&self) -> bool {
        self.unproven.load(Ordering::Acquire) == 0
    }
}

/// Whether the acker of channel `generation`, having acked every tag up to `upto` and the tags
/// of `ones`, sent the ack of `e` (a confirmed copy's: its settlement came after the confirm).
/// An original given back was nacked, never acked: no ack proves it.
fn covered(e: &Entry, generation: u64, upto: u64, ones: &[u64]) -> bool {
    e.generation == generation
        && e.confirmed
        && !e.given_back
        && (e.tag <= upto || ones.contains(&e.tag))
}

/// The entries `lost` keeps for a window of `prefetch`: twice the prefetch.
fn capacity(prefetch: u16) -> usize {
    usize::from(prefetch.max(1)) * 2
}

/// Feeds every property of `p` to `h`, the headers in their (sorted) order without
/// `x-delivery-count`; each field as its `Debug` form (`None`, `Some(..)`), so an absent one
/// never reads as another.
fn hash_properties(h: &mut impl Hasher, p: &BasicProperties) {
    use std::fmt::Write;
    let mut w = HashWriter(h);
    let _ = write!(
        w,
        "{:?}{:?}{:?}{:?}{:?}{:?}{:?}{:?}{:?}{:?}{:?}{:?}{:?}",
        p.content_type(),
        p.content_encoding(),
        p.delivery_mode(),
        p.priority(),
        p.correlation_id(),
        p.reply_to(),
        p.expiration(),
        p.message_id(),
        p.timestamp(),
        p.kind(),
        p.user_id(),
        p.app_id(),
        p.cluster_id(),
    );
    // No table and an empty one are the same: a quorum queue gives a message without headers a
    // table of one, `x-delivery-count`, when it delivers it again.
    let _ = w.write_str("headers:");
    for (key, value) in p.headers().iter().flat_map(|h| h.inner()) {
        if key.as_str() != "x-delivery-count" {
            let _ = write!(w, "{:?}={:?};", key.as_str(), value);
        }
    }
}

/// Formats straight into a hasher (no string per message).
struct HashWriter<'a, H: Hasher>(&'a mut H);

impl<H: Hasher> std::fmt::Write for HashWriter<'_, H> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.write(s.as_bytes());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Stage;
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    use std::time::{Duration, Instant};

    fn copies() -> Copies {
        Copies::new(StageId::new("users", Stage::Main), "users_q", 2)
    }

    fn delivery(generation: u64, tag: u64, redelivered: bool, body: &str) -> Delivery {
        Delivery {
            generation,
            tag,
            redelivered,
            body: body.as_bytes().to_vec().into(),
            properties: BasicProperties::default()
                .with_message_id(ShortString::from("m-1"))
                .into(),
            published_ms: None,
            exchange: Default::default(),
            routing_key: Default::default(),
            held_bytes: 0,
            received_at: Instant::now(),
            decoded: Default::default(),
        }
    }

    fn with_header(mut d: Delivery, key: &str, value: AMQPValue) -> Delivery {
        let full = d.properties.full().into_owned();
        let mut headers = full.headers().clone().unwrap_or_default();
        headers.insert(key.into(), value);
        d.properties = full.with_headers(headers).into();
        d
    }

    /// Publishes and confirms a copy of `d` on its (live) channel.
    fn confirmed(c: &Copies, d: &Delivery) {
        let f = c.fingerprint(d);
        assert_eq!(c.publishing(&[(d.generation, d.tag, f)]), [true]);
        c.published(&[(d.generation, d.tag, true)]);
    }

    #[test]
    fn a_fingerprint_tells_messages_apart_by_body_and_every_property() {
        let c = copies();
        let a = delivery(1, 1, false, "body");
        let fa = c.fingerprint(&a);
        // Another delivery of the same message (tag, generation, flag) is the same.
        assert_eq!(fa, c.fingerprint(&delivery(2, 9, true, "body")));
        assert_ne!(fa, c.fingerprint(&delivery(1, 1, false, "bodz")));
        let mut b = delivery(1, 1, false, "body");
        b.properties = (b.properties.full().into_owned())
            .with_message_id(ShortString::from("m-2"))
            .into();
        assert_ne!(fa, c.fingerprint(&b));
        let tenant = with_header(
            delivery(1, 1, false, "body"),
            "tenant",
            AMQPValue::LongString("a".into()),
        );
        assert_ne!(fa, c.fingerprint(&tenant));
        // The broker's count of deliveries (a quorum queue's redelivery) does not count, nor the
        // table it then adds to a message that had none.
        let mut empty = delivery(1, 1, false, "body");
        empty.properties = (empty.properties.full().into_owned())
            .with_headers(FieldTable::default())
            .into();
        assert_eq!(fa, c.fingerprint(&empty));
        let counted = with_header(
            delivery(1, 1, true, "body"),
            "x-delivery-count",
            AMQPValue::LongLongInt(1),
        );
        assert_eq!(fa, c.fingerprint(&counted));
    }

    /// A backoff holding deliveries ends when their channel goes, not before.
    #[tokio::test]
    async fn gone_resolves_when_the_channel_goes_and_not_before() {
        let c = Arc::new(copies());
        assert_eq!(c.link_up(), 1);
        let waiting = tokio::spawn({
            let c = c.clone();
            async move { c.gone(1).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "the channel of generation 1 is still open"
        );
        c.link_down();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("gone resolved once the link went down")
            .expect("the task ended");
        // An older generation is gone already; a newer link does not bring it back.
        assert_eq!(c.link_up(), 2);
        tokio::time::timeout(Duration::from_secs(1), c.gone(1))
            .await
            .expect("an older generation is gone");
    }

    #[test]
    fn a_redelivery_of_a_copy_lost_with_its_link_is_recalled_once() {
        let c = copies();
        assert_eq!(c.link_up(), 1);
        let first = delivery(1, 7, false, "bad");
        confirmed(&c, &first);
        c.link_down();
        assert_eq!(c.link_up(), 2);
        let again = delivery(2, 3, true, "bad");
        let f = c.fingerprint(&again);
        assert_eq!(c.recall(&again, f), Recall::Routed);
        // Used up: a third delivery of the same content is routed.
        assert_eq!(c.recall(&delivery(2, 4, true, "bad"), f), Recall::Unknown);
        // The recalled one's ack is unproven in its turn: lost again with link 2, recalled again.
        assert!(c.provable(2, 3, &[]));
        c.link_down();
        assert_eq!(c.link_up(), 3);
        assert_eq!(c.recall(&delivery(3, 1, true, "bad"), f), Recall::Routed);
    }

    #[test]
    fn a_first_delivery_or_another_message_is_never_recalled() {
        let c = copies();
        assert_eq!(c.link_up(), 1);
        confirmed(&c, &delivery(1, 1, false, "bad"));
        c.link_down();
        assert_eq!(c.link_up(), 2);
        // The same content never delivered before: a second message, routed.
        let twin = delivery(2, 1, false, "bad");
        assert_eq!(c.recall(&twin, c.fingerprint(&twin)), Recall::Unknown);
        let other = delivery(2, 2, true, "worse");
        assert_eq!(c.recall(&other, c.fingerprint(&other)), Recall::Unknown);
        // A delivery of a channel that is gone is the broker's again: never recalled.
        let stale = delivery(1, 5, true, "bad");
        assert_eq!(c.recall(&stale, c.fingerprint(&stale)), Recall::Unknown);
        let again = delivery(2, 3, true, "bad");
        assert_eq!(c.recall(&again, c.fingerprint(&again)), Recall::Routed);
    }

    #[test]
    fn a_proven_ack_forgets_its_copy() {
        let c = copies();
        assert_eq!(c.link_up(), 1);
        for tag in [1, 2, 5] {
            confirmed(&c, &delivery(1, tag, false, &format!("bad {tag}")));
        }
        // Acked up to 2, and 5 alone: nothing of another channel.
        assert!(!c.provable(9, 10, &[]));
        assert!(c.provable(1, 2, &[]));
        c.prove(1, 2, &[]);
        assert!(!c.provable(1, 2, &[]));
        c.prove(1, 2, &[5]);
        assert!(c.none_unproven());
        c.link_down();
        assert_eq!(c.link_up(), 2);
        let again = delivery(2, 1, true, "bad 1");
        assert_eq!(c.recall(&again, c.fingerprint(&again)), Recall::Unknown);
    }

    #[test]
    fn a_copy_not_confirmed_is_forgotten_and_a_pending_one_is_waited_for() {
        let c = copies();
        assert_eq!(c.link_up(), 1);
        let d = delivery(1, 1, false, "bad");
        let f = c.fingerprint(&d);
        assert_eq!(c.publishing(&[(1, 1, f)]), [true]);
        c.link_down();
        // A channel that is gone takes no new copies.
        assert_eq!(c.publishing(&[(1, 2, f)]), [false]);
        assert_eq!(c.link_up(), 2);
        let again = delivery(2, 1, true, "bad");
        assert_eq!(c.recall(&again, f), Recall::Pending);
        c.published(&[(1, 1, false)]);
        assert_eq!(c.recall(&again, f), Recall::Unknown);
    }

    #[test]
    fn past_the_bound_the_oldest_copies_are_forgotten() {
        // Prefetch 2: twice that for the stage and each of the four it may replace, 20 kept.
        let c = copies();
        assert_eq!(c.link_up(), 1);
        for tag in 1..=21 {
            confirmed(&c, &delivery(1, tag, false, &format!("bad {tag}")));
        }
        c.link_down();
        assert_eq!(c.link_up(), 2);
        let oldest = delivery(2, 1, true, "bad 1");
        assert_eq!(c.recall(&oldest, c.fingerprint(&oldest)), Recall::Unknown);
        for kept in ["bad 2", "bad 21"] {
            let d = delivery(2, 2, true, kept);
            assert_eq!(c.recall(&d, c.fingerprint(&d)), Recall::Routed, "{kept}");
        }
    }

    #[test]
    fn a_copy_in_doubt_waits_for_its_late_confirm_then_is_recalled() {
        let c = copies();
        assert_eq!(c.link_up(), 1);
        let d = delivery(1, 5, false, "bad");
        let f = c.fingerprint(&d);
        assert_eq!(c.publishing(&[(1, 5, f)]), [true]);
        // Not confirmed in time: the original goes back to its queue (nacked), the copy is in
        // doubt. Its redelivery, on the same channel, waits.
        c.in_doubt(&[(1, 5)]);
        assert!(c.none_unproven(), "a nacked original has no ack to prove");
        let again = delivery(1, 9, true, "bad");
        assert_eq!(c.recall(&again, f), Recall::Pending);
        // The late confirm; acks up to a later tag prove nothing of a nacked original.
        c.published(&[(1, 5, true)]);
        c.prove(1, 100, &[5]);
        assert_eq!(c.recall(&again, f), Recall::Routed);
        assert_eq!(c.recall(&delivery(1, 10, true, "bad"), f), Recall::Unknown);
    }

    #[test]
    fn a_copy_in_doubt_that_was_not_confirmed_is_routed_again() {
        let c = copies();
        assert_eq!(c.link_up(), 1);
        let d = delivery(1, 5, false, "bad");
        let f = c.fingerprint(&d);
        assert_eq!(c.publishing(&[(1, 5, f)]), [true]);
        c.in_doubt(&[(1, 5)]);
        // The link died meanwhile: the redelivery comes on the next channel, and still waits.
        c.link_down();
        assert_eq!(c.link_up(), 2);
        let again = delivery(2, 1, true, "bad");
        assert_eq!(c.recall(&again, f), Recall::Pending);
        c.published(&[(1, 5, false)]);
        assert_eq!(c.recall(&again, f), Recall::Unknown);
    }

    #[test]
    fn a_reload_hands_the_memory_to_the_same_stage_on_the_same_queue() {
        let c = Arc::new(copies());
        assert_eq!(c.link_up(), 1);
        confirmed(&c, &delivery(1, 7, false, "bad"));
        // The stage stopped (its acks unproven); a reload starts one in its place.
        let main = StageId::new("users", Stage::Main);
        let next = Copies::carry_on(Some(c.clone()), main.clone(), "users_q", 4);
        assert!(Arc::ptr_eq(&c, &next), "the same stage on the same queue");
        // Its links go on counting: no generation of the old stage comes again.
        assert_eq!(next.link_up(), 2);
        let again = delivery(2, 1, true, "bad");
        assert_eq!(
            next.recall(&again, next.fingerprint(&again)),
            Recall::Routed
        );
        // Another queue, or another stage, starts with a memory of its own.
        let moved = Copies::carry_on(Some(c.clone()), main, "users_q2", 2);
        assert!(!Arc::ptr_eq(&c, &moved));
        let dlq = Copies::carry_on(
            Some(c.clone()),
            StageId::new("users", Stage::Dlq),
            "users_q",
            2,
        );
        assert!(!Arc::ptr_eq(&c, &dlq));
        assert_eq!(
            Copies::carry_on(None, StageId::new("users", Stage::Main), "users_q", 2).link_up(),
            1
        );
    }

    #[test]
    fn a_pipeline_renamed_on_the_same_queue_takes_the_memory_under_its_name() {
        let c = Arc::new(copies());
        assert_eq!(c.link_up(), 1);
        confirmed(&c, &delivery(1, 7, false, "bad"));
        let renamed = StageId::new("users_v2", Stage::Main);
        let next = Copies::carry_on(Some(c.clone()), renamed.clone(), "users_q", 4);
        assert!(!Arc::ptr_eq(&c, &next), "a memory under the new name");
        assert_eq!(next.stage(), &renamed);
        // The lost copy, its fingerprint made with the same keys, and the generations go on.
        assert_eq!(next.link_up(), 2);
        let again = delivery(2, 1, true, "bad");
        assert_eq!(
            next.recall(&again, next.fingerprint(&again)),
            Recall::Routed
        );
    }

    /// Review R42b F6: a copy the old stage had in doubt when a reload renamed its pipeline
    /// ends through the old stage's publisher, which tells the old memory; the renamed stage's
    /// redelivery waited on it for ever (requeued every 15 s until a restart). Both memories
    /// hold the same entries, so the outcome reaches the waiting redelivery.
    #[test]
    fn a_copy_in_doubt_at_a_rename_ends_for_the_renamed_stage() {
        let c = Arc::new(copies());
        assert_eq!(c.link_up(), 1);
        let d = delivery(1, 5, false, "bad");
        let f = c.fingerprint(&d);
        assert_eq!(c.publishing(&[(1, 5, f)]), [true]);
        c.in_doubt(&[(1, 5)]);
        let next = Copies::carry_on(
            Some(c.clone()),
            StageId::new("users_v2", Stage::Main),
            "users_q",
            4,
        );
        assert_eq!(next.link_up(), 2);
        let again = delivery(2, 1, true, "bad");
        assert_eq!(next.recall(&again, f), Recall::Pending);
        let woken = next.outcome();
        c.published(&[(1, 5, false)]);
        assert!(
            futures::FutureExt::now_or_never(woken).is_some(),
            "the waiting redelivery is woken"
        );
        assert_eq!(
            next.recall(&again, f),
            Recall::Unknown,
            "routed, not waited on"
        );
    }
}
