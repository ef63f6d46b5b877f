//! The publisher actor: one connection of its own, publisher confirms, persistent and
//! `mandatory` publishes that return only once the broker confirmed them, and a reconnect loop
//! with backoff so callers get a fast `Unavailable` while the broker is away. Its link coming up
//! or going down is told to whoever owns it ([`LinkReport`], given at construction): the broker
//! layer emits no event itself.
//!
//! A nack renews the channel (at most once per [`RENEW_EVERY`]): a RabbitMQ channel whose first
//! publish to a quorum queue came while the queue's leader node was down nacks every later
//! publish to that queue for its whole life (3.10's `rabbit_fifo_client` keeps asking the dead
//! node: its first enqueue asks the node the queue record names as leader, and a `nodedown`
//! leaves that choice unchanged), even after a new leader was elected; a new channel asks the
//! queue's current leader. Later 3.11 and 3.12 releases make it rarer (the client starts from the
//! node's leaderboard rather than the record: rabbitmq/rabbitmq-server#9241).

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tracing::{info, warn};

use crate::amqp::{self, AmqpConfig, AmqpError, headers, republish};

/// Publish one message and wait for the broker's confirm.
#[derive(Debug, Clone, Message)]
#[rtype(result = "Result<(), AmqpError>")]
pub struct Publish {
    pub exchange: String,
    pub routing_key: String,
    /// Shared with the delivery it copies, never cloned (`Bytes::from(vec)` takes a `Vec`).
    pub body: bytes::Bytes,
    pub properties: BasicProperties,
}

/// Publish several messages as one group and wait for every confirm; the answer holds one
/// result per message, in order. Groups have the channel to themselves, so a returned
/// (unroutable) message is told to the right publish: lapin hands each returned message to
/// whichever confirm it completes next, which under a `multiple` ack may be another publish's,
/// so with single publishes in flight to several destinations an unroutable message could
/// look confirmed (see [`publish_group`]). The router and the DLQ stage publish this way, and
/// learn the late outcome of what is in doubt ([`Group::late`]).
#[derive(Debug, Message)]
#[rtype(result = "Group")]
pub struct PublishAll(pub Vec<Publish>);

/// Whether the publisher has a live channel (for `/readyz`).
#[derive(Debug, Message)]
#[rtype(result = "bool")]
pub struct IsConnected;

/// Close the connection and stop.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Close;

/// A connection attempt finished.
#[derive(Message)]
#[rtype(result = "()")]
struct Connected(Connection, Channel);

/// The broker nacked a publish on the channel of `generation`.
#[derive(Message)]
#[rtype(result = "()")]
struct Refused {
    generation: u64,
}

/// A new channel on the current connection, to replace the channel of `generation`; `None` if
/// it could not be opened (the connection is failing: the watchdog reconnects).
#[derive(Message)]
#[rtype(result = "()")]
struct Renewed {
    generation: u64,
    channel: Option<Channel>,
}

/// Told each time a publisher's link comes up (`up`) or goes down, with the publisher's purpose
/// (`api`, `router`, `cli`): its owner reports it (warren's roles emit `link_lost` /
/// `link_restored` and set the link metric, `events::publisher_link`). A plain function, called
/// on the actor's thread at the moment of the change, so reports keep the order of the changes.
pub type LinkReport = fn(purpose: &'static str, up: bool);

/// The least time between two channel renewals after nacks: a queue that refuses everything
/// (full, with `x-overflow=reject-publish`) costs at most one channel a second.
pub const RENEW_EVERY: Duration = Duration::from_secs(1);

/// Whether a nack on the channel of `generation` should renew it: it is the current channel, no
/// renewal is under way, and the last one was at least [`RENEW_EVERY`] ago.
fn should_renew(
    generation: u64,
    current: u64,
    renewing: bool,
    last_renewal: Option<std::time::Instant>,
    now: std::time::Instant,
) -> bool {
    generation == current
        && !renewing
        && last_renewal.is_none_or(|at| now.duration_since(at) >= RENEW_EVERY)
}

/// The publisher actor.
pub struct Publisher {
    /// The broker link's settings: where to connect, the connect and confirm bounds.
    amqp: AmqpConfig,
    /// Shown in the broker's connection list (`api`, `router`, `cli`).
    purpose: &'static str,
    /// The frame limit its link proposes: the router republishes other publishers' messages.
    frames: amqp::Frames,
    /// Whom to tell when the link comes up or goes down.
    on_link: LinkReport,
    /// The live connection, kept so it can be closed cleanly (shared with a channel renewal).
    connection: Option<Arc<Connection>>,
    /// The confirm-mode channel publishes go through; `None` while disconnected.
    channel: Option<Channel>,
    /// Whether a reconnect loop is running, so only one runs.
    connecting: bool,
    /// Set by `Close`, so a dropped connection is not re-opened during shutdown.
    closing: bool,
    /// Numbers the channels publishes go through, so a nack names the channel it came on.
    generation: u64,
    /// A channel renewal (after a nack) is under way.
    renewing: bool,
    /// When the channel was last renewed after a nack, to renew at most once per RENEW_EVERY.
    last_renewal: Option<std::time::Instant>,
    /// Held by a group for its whole length: one group at a time on the channel.
    group: Arc<tokio::sync::Mutex<()>>,
    /// Single publishes waiting to go out in the next group.
    pending: Pending,
}

/// A single publish waiting for its group.
struct PendingPublish {
    publish: Publish,
    /// Where its result goes.
    result: tokio::sync::oneshot::Sender<Result<(), AmqpError>>,
    /// When it came (for `warren_publish_duration_seconds`).
    at: std::time::Instant,
    /// The publisher's channel when it came, and that channel's generation: a group goes out on
    /// the channel of its newest publish.
    channel: Channel,
    generation: u64,
}
type Pending = Arc<std::sync::Mutex<Vec<PendingPublish>>>;

impl Publisher {
    /// A publisher for `purpose`, whose link changes are told to `on_link`.
    pub fn new(
        amqp: AmqpConfig,
        purpose: &'static str,
        frames: amqp::Frames,
        on_link: LinkReport,
    ) -> Self {
        Self {
            amqp,
            purpose,
            frames,
            on_link,
            connection: None,
            channel: None,
            connecting: false,
            closing: false,
            generation: 0,
            renewing: false,
            last_renewal: None,
            group: Arc::default(),
            pending: Arc::default(),
        }
    }

    /// The frame limit of the live connection (0 while there is none).
    fn frame_max(&self) -> u32 {
        self.connection
            .as_ref()
            .map_or(0, |c| c.configuration().frame_max())
    }

    fn live_channel(&mut self) -> Option<Channel> {
        match &self.channel {
            Some(ch) if ch.status().connected() => Some(ch.clone()),
            Some(_) => {
                self.channel = None;
                self.connection = None;
                (self.on_link)(self.purpose, false);
                None
            }
            None => None,
        }
    }

    fn reconnect(&mut self, ctx: &mut Context<Self>) {
        if self.connecting || self.closing {
            return;
        }
        self.connecting = true;
        let config = self.amqp.clone();
        let (purpose, frames) = (self.purpose, self.frames);
        let addr = ctx.address();
        actix::spawn(async move {
            let open = || open(&config, purpose, frames);
            if let Some((conn, ch)) = amqp::until_open(
                purpose,
                "publisher cannot reach the broker; retrying",
                Duration::ZERO,
                open,
                || addr.connected(),
            )
            .await
            {
                addr.do_send(Connected(conn, ch));
            }
        });
    }
}

async fn open(
    config: &AmqpConfig,
    purpose: &str,
    frames: amqp::Frames,
) -> Result<(Connection, Channel), AmqpError> {
    let (conn, channel) = amqp::connect_channel(config, purpose, frames).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(AmqpError::from)?;
    Ok((conn, channel))
}

impl Actor for Publisher {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        self.reconnect(ctx);
        // Notice a dead channel even when nobody publishes.
        ctx.run_interval(Duration::from_secs(1), |act, ctx| {
            if act.live_channel().is_none() {
                act.reconnect(ctx);
            }
        });
    }
}

impl Handler<Connected> for Publisher {
    type Result = ();

    fn handle(&mut self, msg: Connected, _: &mut Self::Context) {
        self.connecting = false;
        if self.closing {
            actix::spawn(amqp::close(Some(msg.1), Some(msg.0)));
            return;
        }
        info!(purpose = self.purpose, "publisher connected");
        (self.on_link)(self.purpose, true);
        self.connection = Some(Arc::new(msg.0));
        self.channel = Some(msg.1);
        self.generation += 1;
    }
}

impl Handler<Refused> for Publisher {
    type Result = ();

    fn handle(&mut self, msg: Refused, ctx: &mut Self::Context) {
        let now = std::time::Instant::now();
        if self.closing
            || !should_renew(
                msg.generation,
                self.generation,
                self.renewing,
                self.last_renewal,
                now,
            )
        {
            return;
        }
        let Some(conn) = self.connection.clone() else {
            return;
        };
        self.renewing = true;
        self.last_renewal = Some(now);
        warn!(
            purpose = self.purpose,
            "the broker nacked a publish; renewing the channel"
        );
        let addr = ctx.address();
        let generation = msg.generation;
        let bound = self.amqp.connect_timeout();
        actix::spawn(async move {
            let opened = async {
                let channel = conn.create_channel().await?;
                channel
                    .confirm_select(ConfirmSelectOptions::default())
                    .await?;
                Ok::<_, lapin::Error>(channel)
            };
            let channel = match tokio::time::timeout(bound, opened).await {
                Ok(Ok(channel)) => Some(channel),
                Ok(Err(e)) => {
                    warn!(error = %e, "cannot open a new publisher channel");
                    None
                }
                Err(_) => {
                    warn!("no new publisher channel within {bound:?}");
                    None
                }
            };
            addr.do_send(Renewed {
                generation,
                channel,
            });
        });
    }
}

impl Handler<Renewed> for Publisher {
    type Result = ();

    fn handle(&mut self, msg: Renewed, _: &mut Self::Context) {
        self.renewing = false;
        let Some(channel) = msg.channel else {
            return;
        };
        // Too late: closing, reconnected since, or the link was dropped as dead meanwhile.
        if self.closing || msg.generation != self.generation || self.connection.is_none() {
            actix::spawn(amqp::close(Some(channel), None));
            return;
        }
        let old = self.channel.replace(channel);
        self.generation += 1;
        // Publishes still waiting on the old channel get their confirms (or nacks) first.
        actix::spawn(async move {
            if let Some(ch) = &old {
                let _ = tokio::time::timeout(Duration::from_secs(5), ch.wait_for_confirms()).await;
            }
            amqp::close(old, None).await;
        });
    }
}

impl Handler<Publish> for Publisher {
    type Result = ResponseFuture<Result<(), AmqpError>>;

    /// Single publishes (the API's, `warren publish`'s) go out in groups too, so that a returned
    /// message is always told to the right one (see [`PublishAll`]): each joins the pending
    /// list, and whoever gets the channel next publishes everything pending as one group and
    /// hands each its result. While a group waits for its confirms the next one gathers, so
    /// concurrent publishes still share round trips (a publish can wait for the group ahead of
    /// it and then its own: at most twice `PUBLISH_TIMEOUT_MS`).
    fn handle(&mut self, msg: Publish, ctx: &mut Self::Context) -> Self::Result {
        let Some(channel) = self.live_channel() else {
            self.reconnect(ctx);
            let result = Err(AmqpError::Unavailable("no connection to the broker".into()));
            amqp::count_publish(&result, Duration::ZERO);
            return Box::pin(async { result });
        };
        let timeout = self.amqp.publish_timeout();
        let frame_max = self.frame_max();
        let (addr, group, pending) = (ctx.address(), self.group.clone(), self.pending.clone());
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        lock(&pending).push(PendingPublish {
            publish: msg,
            result: tx,
            at: std::time::Instant::now(),
            channel,
            generation: self.generation,
        });
        Box::pin(async move {
            loop {
                tokio::select! {
                    biased;
                    // Published in an earlier group (or in this one, below).
                    result = &mut rx => {
                        return result.unwrap_or_else(|_| {
                            Err(AmqpError::Unavailable(
                                "the publish was dropped before it was confirmed".into(),
                            ))
                        });
                    }
                    // This one's turn to publish everything pending.
                    _alone = group.lock() => {
                        // Let publishes already on their way join (the handlers of a burst
                        // run one after another): take the list once it stops growing.
                        let mut seen = 0;
                        for _ in 0..64 {
                            let now = lock(&pending).len();
                            if now == seen {
                                break;
                            }
                            seen = now;
                            tokio::task::yield_now().await;
                        }
                        let taken = std::mem::take(&mut *lock(&pending));
                        let Some(newest) = taken.last() else {
                            continue;
                        };
                        let (channel, generation) = (newest.channel.clone(), newest.generation);
                        let (publishes, waiting): (Vec<Publish>, Vec<_>) = taken
                            .into_iter()
                            .map(|p| (p.publish, (p.result, p.at)))
                            .unzip();
                        let results =
                            publish_group(&channel, publishes, frame_max, timeout).await;
                        if results.iter().any(|r| matches!(r, Err(AmqpError::Nacked))) {
                            addr.do_send(Refused { generation });
                        }
                        for ((tx, at), result) in waiting.into_iter().zip(results) {
                            amqp::count_publish(&result, at.elapsed());
                            let _ = tx.send(result);
                        }
                    }
                }
            }
        })
    }
}

/// Locks the pending list (never held across an await; a panic while holding it cannot leave
/// it half-changed, so a poisoned lock is taken as it is).
fn lock(pending: &Pending) -> std::sync::MutexGuard<'_, Vec<PendingPublish>> {
    pending.lock().unwrap_or_else(|e| e.into_inner())
}

impl Handler<PublishAll> for Publisher {
    type Result = ResponseFuture<Group>;

    fn handle(&mut self, msg: PublishAll, ctx: &mut Self::Context) -> Self::Result {
        let n = msg.0.len();
        let Some(channel) = self.live_channel() else {
            self.reconnect(ctx);
            let result = Err(AmqpError::Unavailable("no connection to the broker".into()));
            for _ in 0..n {
                amqp::count_publish(&result, Duration::ZERO);
            }
            return Box::pin(async move {
                Group {
                    results: vec![result; n],
                    late: None,
                }
            });
        };
        let timeout = self.amqp.publish_timeout();
        let frame_max = self.frame_max();
        let (addr, generation, group) = (ctx.address(), self.generation, self.group.clone());
        Box::pin(async move {
            let _alone = group.lock().await;
            let started = std::time::Instant::now();
            let group = publish_group_late(&channel, msg.0, frame_max, timeout).await;
            for result in &group.results {
                amqp::count_publish(result, started.elapsed());
            }
            if group
                .results
                .iter()
                .any(|r| matches!(r, Err(AmqpError::Nacked)))
            {
                addr.do_send(Refused { generation });
            }
            group
        })
    }
}

/// The longest a publish in doubt (sent, its confirm not come within `PUBLISH_TIMEOUT_MS`) is
/// still awaited in the background ([`Late`]): after it, it counts as not confirmed (a
/// redelivery of its original is then routed again, a second copy if it did land). Five minutes
/// cover a broker holding publishes under a memory or disk alarm that an operator clears.
pub const LATE_CONFIRMS: Duration = Duration::from_secs(300);

/// What became of a group of publishes ([`publish_group_late`]).
#[derive(Debug)]
pub struct Group {
    /// One result per publish, in order.
    pub results: Vec<Result<(), AmqpError>>,
    /// The publishes that were sent and whose confirm did not come in time: their result is
    /// `ConfirmTimeout`, yet the broker may hold them (a broker under an alarm confirms late).
    pub late: Option<Late>,
}

/// Publishes in doubt, and their outcome once known.
#[derive(Debug)]
pub struct Late {
    /// Their indices in the group, in order.
    pub indices: Vec<usize>,
    /// Resolves, once every one of them ended (or after [`LATE_CONFIRMS`]), to whether each
    /// was confirmed after all (an ack whose message came back unroutable, a nack, a channel
    /// that failed or no answer in time are not), in the order of `indices`.
    pub outcome: tokio::sync::oneshot::Receiver<Vec<bool>>,
}

/// Publishes `publishes` on `channel` (in confirm mode, used by nobody else meanwhile), waits
/// for every confirm, and tells each publish's fate: confirmed, or not (nacked, unroutable,
/// timed out, the channel failed). [`publish_group_late`] without the late outcomes.
pub async fn publish_group(
    channel: &Channel,
    publishes: Vec<Publish>,
    frame_max: u32,
    timeout: Duration,
) -> Vec<Result<(), AmqpError>> {
    publish_group_late(channel, publishes, frame_max, timeout)
        .await
        .results
}

/// Publishes `publishes` on `channel` (in confirm mode, used by nobody else meanwhile), waits
/// up to `timeout` for every confirm, and tells each publish's fate: confirmed, or not (nacked,
/// unroutable, timed out, the channel failed).
///
/// A publish sent whose confirm did not come within `timeout` is in doubt, not failed: the
/// broker may hold it (under a memory or disk alarm it confirms late). Its confirm is still
/// awaited in the background (up to [`LATE_CONFIRMS`]) and [`Group::late`] tells its outcome.
/// Publishes are sent one after another; what was not sent yet when `timeout` passed is not
/// sent at all (its result is `ConfirmTimeout`, and it is not in doubt), so the channel is the
/// next group's alone once this one returns.
///
/// Which publish a returned message belongs to is decided here, not by lapin: lapin attaches
/// each `basic.return` to whichever pending confirm it completes next, and a `basic.ack` with
/// `multiple` completes a whole range of them in no particular order, so an unroutable publish
/// can come back as a plain `Ack` while a routed one carries its returned message (seen in the
/// ledger test: a dead-letter publish to an unbound DLQ "confirmed" beside retry publishes, and
/// the message lost). All of a group's returned messages arrive before the acks that complete
/// it, so together they are exactly the group's; each is matched to a publish with the same
/// exchange, routing key, body and properties (identical publishes are interchangeable).
/// Before the group starts, every confirm still outstanding on the channel (an earlier group's
/// that timed out) is awaited, so a late ack cannot take one of this group's returned messages.
pub async fn publish_group_late(
    channel: &Channel,
    publishes: Vec<Publish>,
    frame_max: u32,
    timeout: Duration,
) -> Group {
    let n = publishes.len();
    let fail = |e: AmqpError| Group {
        results: vec![Err(e); n],
        late: None,
    };
    let deadline = tokio::time::Instant::now() + timeout;
    match tokio::time::timeout_at(deadline, channel.wait_for_confirms()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return fail(AmqpError::Unavailable(e.to_string())),
        Err(_) => return fail(AmqpError::ConfirmTimeout(timeout)),
    }
    // What the link cannot carry is never sent: a content header over the frame limit makes
    // the broker close the connection, and every other publish in flight with it.
    let mut results: Vec<Result<(), AmqpError>> = Vec::with_capacity(n);
    let mut fitted: Vec<Option<BasicProperties>> = Vec::with_capacity(n);
    for p in &publishes {
        match republish::fit(p.properties.clone(), &headers::REASONS, frame_max) {
            Ok(properties) => {
                fitted.push(Some(properties));
                results.push(Ok(()));
            }
            Err(e) => {
                fitted.push(None);
                results.push(Err(e.into()));
            }
        }
    }
    // Sent one after another; each confirm awaited beside the others. A send under way when
    // the time is up has its frames queued already: it is in doubt with the ones before it.
    let mut confirms: Vec<(usize, Confirming)> = Vec::with_capacity(n);
    let mut sent_all = true;
    for (i, properties) in fitted.into_iter().enumerate() {
        let Some(properties) = properties else {
            continue;
        };
        if !sent_all {
            results[i] = Err(AmqpError::ConfirmTimeout(timeout));
            continue;
        }
        let (ch, p) = (channel.clone(), publishes[i].clone());
        let mut sending = Box::pin(async move { start(&ch, &p, properties).await });
        match tokio::time::timeout_at(deadline, &mut sending).await {
            Ok(Ok(confirm)) => confirms.push((
                i,
                Box::pin(async move { confirm.await.map_err(|e| AmqpError::from_confirm(&e)) }),
            )),
            // Not sent: the channel refused it before it left (closed already).
            Ok(Err(e)) => results[i] = Err(AmqpError::Unavailable(e.to_string())),
            Err(_) => {
                sent_all = false;
                confirms.push((
                    i,
                    Box::pin(async move {
                        let confirm = sending
                            .await
                            .map_err(|e| AmqpError::Unavailable(e.to_string()))?;
                        confirm.await.map_err(|e| AmqpError::from_confirm(&e))
                    }),
                ));
            }
        }
    }
    let indices: Vec<usize> = confirms.iter().map(|(i, _)| *i).collect();
    let mut all = futures::future::join_all(confirms.into_iter().map(|(_, c)| c));
    let waited = if sent_all {
        tokio::time::timeout_at(deadline, &mut all).await.ok()
    } else {
        None
    };
    if let Some(outcomes) = waited {
        settle(
            &publishes,
            &mut results,
            indices.iter().copied().zip(outcomes),
        );
        return Group {
            results,
            late: None,
        };
    }
    // In doubt: the answers are still awaited, and told when they come.
    let mut late = results.clone();
    for &i in &indices {
        results[i] = Err(AmqpError::ConfirmTimeout(timeout));
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    let doubtful = indices.clone();
    tokio::spawn(async move {
        match tokio::time::timeout(LATE_CONFIRMS, all).await {
            Ok(outcomes) => settle(
                &publishes,
                &mut late,
                doubtful.iter().copied().zip(outcomes),
            ),
            Err(_) => {
                for &i in &doubtful {
                    late[i] = Err(AmqpError::ConfirmTimeout(LATE_CONFIRMS));
                }
            }
        }
        let _ = tx.send(doubtful.iter().map(|&i| late[i].is_ok()).collect());
    });
    Group {
        results,
        late: Some(Late {
            indices,
            outcome: rx,
        }),
    }
}

/// A publish's confirm being awaited (its send first, when that was still under way).
type Confirming = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Confirmation, AmqpError>> + Send + 'static>,
>;

/// Writes the confirms `outcomes` (index in the group, answer) into `results`, then tells each
/// returned message to the publish it belongs to (see [`publish_group_late`]): a publish whose
/// message came back is not confirmed, whatever its ack said.
fn settle(
    publishes: &[Publish],
    results: &mut [Result<(), AmqpError>],
    outcomes: impl Iterator<Item = (usize, Result<Confirmation, AmqpError>)>,
) {
    let n = publishes.len();
    let mut returned = Vec::new();
    for (i, outcome) in outcomes {
        results[i] = match outcome {
            Ok(Confirmation::Ack(r)) => {
                returned.extend(r);
                Ok(())
            }
            Ok(Confirmation::Nack(r)) => {
                returned.extend(r);
                Err(AmqpError::Nacked)
            }
            Ok(Confirmation::NotRequested) => Err(AmqpError::Protocol(
                "publisher confirms are not enabled on this channel".into(),
            )),
            Err(e) => Err(e),
        };
    }
    for r in returned {
        let d = &r.delivery;
        let same = |p: &Publish| {
            p.exchange == d.exchange.as_str()
                && p.routing_key == d.routing_key.as_str()
                && p.body[..] == d.data[..]
        };
        // The same properties too (the message id tells apart messages with equal bodies: all
        // malformed messages can be `{not json`, and when a binding goes away in the middle of
        // a group the first of them was routed and a later one returned); then the looser
        // match. A confirmed publish first; a nacked one already failed either way.
        let exact = |p: &Publish| same(p) && p.properties == d.properties;
        let owner = (0..n)
            .find(|&i| results[i].is_ok() && exact(&publishes[i]))
            .or_else(|| (0..n).find(|&i| results[i].is_ok() && same(&publishes[i])))
            .or_else(|| (0..n).find(|&i| same(&publishes[i])));
        match owner {
            Some(i) if results[i].is_ok() => {
                results[i] = Err(AmqpError::Unroutable {
                    exchange: publishes[i].exchange.clone(),
                    routing_key: publishes[i].routing_key.clone(),
                });
            }
            Some(_) => {}
            None => warn!(exchange = %d.exchange, routing_key = %d.routing_key,
                "a returned message matches no publish of its group; ignored"),
        }
    }
}

/// Sends `p` on `channel` as a `mandatory` publish with `properties` (persistent if they say so);
/// the returned confirm resolves when the broker confirms it.
async fn start(
    channel: &Channel,
    p: &Publish,
    properties: BasicProperties,
) -> lapin::Result<lapin::PublisherConfirm> {
    channel
        .basic_publish(
            p.exchange.as_str().into(),
            p.routing_key.as_str().into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            &p.body,
            properties,
        )
        .await
}

/// Publishes one message on `channel` (in confirm mode, used by nobody else meanwhile) and waits
/// for its confirm: [`publish_group`] of one.
pub async fn publish_confirmed(
    channel: &Channel,
    msg: Publish,
    frame_max: u32,
    timeout: Duration,
) -> Result<(), AmqpError> {
    publish_group(channel, vec![msg], frame_max, timeout)
        .await
        .pop()
        .unwrap_or_else(|| Err(AmqpError::Unavailable("nothing was published".into())))
}

impl Handler<IsConnected> for Publisher {
    type Result = bool;

    fn handle(&mut self, _: IsConnected, _: &mut Self::Context) -> bool {
        self.live_channel().is_some()
    }
}

impl Handler<Close> for Publisher {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: Close, _: &mut Self::Context) -> Self::Result {
        self.closing = true;
        let channel = self.channel.take();
        let conn = self.connection.take();
        Box::pin(
            async move {
                if let Some(ch) = &channel {
                    // Confirms still outstanding are waited for before the channel closes.
                    let _ =
                        tokio::time::timeout(Duration::from_secs(5), ch.wait_for_confirms()).await;
                }
                amqp::close(channel, None).await;
                if let Some(conn) = conn {
                    let _ = conn.close(200, "bye".into()).await;
                }
            }
            .into_actor(self)
            .map(|_, _, ctx| ctx.stop()),
        )
    }
}

/// Standard properties of a message warren publishes: persistent, with id and timestamp, and,
/// with `latency_header` (`PUBLISH_LATENCY_HEADER`), the publish time in milliseconds
/// (`x-published-ms`, for the end-to-end latency).
///
/// No content type: RabbitMQ 3.10 delivers a message whose encoded properties exceed 64 bytes
/// about a quarter slower than one whose properties fit (measured: a UUID message id and a
/// timestamp are 48 bytes, 65 with `application/json` beside them, and the raw drain of those
/// 65-byte messages ran at 0.67-0.74 of the drain of either 61- or 57-byte ones;
/// docs/performance.md, "What message properties cost the broker"). Nothing reads the content
/// type (every body on warren's queues is JSON), and a header table is larger than 64 bytes on
/// its own, so the rule only matters, and only holds, for messages without one.
///
/// The message id is a short string already: made by [`crate::amqp::headers::short`] from text
/// warren did not write itself, so a key over 255 bytes is the caller's error to report, never a
/// panic here.
pub fn json_properties(message_id: ShortString, latency_header: bool) -> BasicProperties {
    traced_json_properties(message_id, None, latency_header)
}

/// [`json_properties`], with the W3C `traceparent` header when `trace` is given (a valid one:
/// the caller checks it). No header table at all when neither is asked: a table costs the
/// broker CPU on every message (docs/performance.md).
pub fn traced_json_properties(
    message_id: ShortString,
    trace: Option<&str>,
    latency_header: bool,
) -> BasicProperties {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(message_id)
        .with_timestamp(now_ms / 1000);
    if !latency_header && trace.is_none() {
        return properties;
    }
    let mut headers = lapin::types::FieldTable::default();
    if latency_header {
        headers.insert(
            crate::amqp::headers::PUBLISHED_MS.into(),
            lapin::types::AMQPValue::LongLongInt(now_ms as i64),
        );
    }
    if let Some(trace) = trace {
        headers.insert(
            crate::amqp::headers::TRACEPARENT.into(),
            lapin::types::AMQPValue::LongString(trace.as_bytes().to_vec().into()),
        );
    }
    properties.with_headers(headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_nack_renews_the_current_channel_at_most_once_per_interval() {
        let now = Instant::now();
        assert!(should_renew(3, 3, false, None, now), "first nack");
        assert!(
            !should_renew(2, 3, false, None, now),
            "an old channel's nack"
        );
        assert!(!should_renew(3, 3, true, None, now), "a renewal under way");
        let just = now - Duration::from_millis(100);
        assert!(
            !should_renew(3, 3, false, Some(just), now),
            "renewed 100 ms ago"
        );
        let long_ago = now - RENEW_EVERY;
        assert!(
            should_renew(3, 3, false, Some(long_ago), now),
            "renewed a while ago"
        );
    }

    /// The properties of a user message as warren publishes it fit in the 64 bytes past which
    /// RabbitMQ 3.10 delivers a message about a quarter slower (see [`json_properties`]).
    #[test]
    fn a_user_message_has_at_most_64_bytes_of_properties() {
        // A content header frame is its properties plus 20 bytes: frame type, channel, size
        // (7), class, weight, body size (12), frame end (1).
        let properties = |p: &BasicProperties| crate::amqp::republish::header_frame_size(p) - 20;
        let id = headers::short(uuid::Uuid::new_v4().to_string()).expect("36 bytes");
        let plain = json_properties(id.clone(), false);
        assert_eq!(properties(&plain), 48);
        assert!(plain.content_type().is_none());
        let with_content_type = plain.clone().with_content_type("application/json".into());
        assert_eq!(properties(&with_content_type), 65, "the measured slow case");
        assert!(
            properties(&json_properties(id, true)) > 64,
            "a header table"
        );
    }
}
