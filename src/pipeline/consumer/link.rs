//! The broker link of the consumer: its states ([`Link`], [`Linked`], [`Subscription`],
//! [`Phase`]), connecting with the prefetch set, rebuilding after a growing backoff when a link
//! died young, tearing a link down (its unacked deliveries go back to the queue) and naming why
//! it ended.

use std::time::{Duration, Instant};

use actix::prelude::*;
use lapin::options::BasicQosOptions;
use lapin::{Channel, Connection};
use tracing::{error, info, warn};

use super::{Consumer, ConsumerConfig};
use crate::amqp::{self, AmqpConfig, AmqpError};
use crate::pipeline::acks::Acker;

/// A link that lived at least this long was healthy: the next rebuild starts without delay.
const HEALTHY_LINK: Duration = Duration::from_secs(30);

/// What the consumer is told about its broker link (connected, qos set, not yet consuming).
#[derive(Message)]
#[rtype(result = "()")]
struct Connected {
    conn: Connection,
    channel: Channel,
}

/// The broker link, one state at a time.
pub(super) enum Link {
    /// No connection and none being made: before the start, and after `Close`.
    Down,
    /// A connect (after its backoff) is under way; it answers `Connected`.
    Connecting,
    /// Connected, with its prefetch set.
    /// Boxed: the link is rebuilt rarely, and the other states carry nothing.
    Up(Box<Linked>),
}

/// An open link: the connection, its channel, that channel's acks and its subscription.
pub(super) struct Linked {
    pub(super) connection: Connection,
    pub(super) channel: Channel,
    /// The acks of this channel; taken once a drain is over, to send the last ones.
    pub(super) acker: Option<Acker>,
    /// When the link came up, to tell a young death (back off) from an old one.
    pub(super) since: Instant,
    /// The prefetch window (`basic.qos`) set on this channel.
    pub(super) window: u16,
    pub(super) subscription: Subscription,
}

/// The subscription (`basic.consume`) of a link.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Subscription {
    /// Not consuming: held, past the byte budget, or stopping.
    None,
    /// A `basic.consume` is under way.
    Pending,
    /// Consuming under this consumer tag.
    Active(String),
    /// Cancelled by warren (a hold, a new window), its stream not ended yet: deliveries the
    /// broker sent before its `cancel-ok` may still come. No new subscription until it ends:
    /// the next one's deliveries carry higher tags, and handed on before the older ones, a
    /// multi-ack of theirs would ack older deliveries not yet processed (found by the balance
    /// bench: one-by-one acks for the rest of the drain, and deliveries left unacked).
    Cancelling(String, Instant),
}

/// Where the consumer is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Running,
    /// `Cancel` came: nothing new is subscribed; the stream is ending.
    Stopping,
    /// Stopping, and the stream ended: nothing more will arrive.
    StreamEnded,
}

impl Consumer {
    /// The open link, if there is one.
    pub(super) fn linked(&mut self) -> Option<&mut Linked> {
        match &mut self.link {
            Link::Up(linked) => Some(linked.as_mut()),
            _ => None,
        }
    }

    /// The channel of the open link, when it is still open.
    pub(super) fn open_channel(&self) -> Option<&Channel> {
        match &self.link {
            Link::Up(linked) if linked.channel.status().connected() => Some(&linked.channel),
            _ => None,
        }
    }

    pub(super) fn connecting(&self) -> bool {
        matches!(self.link, Link::Connecting)
    }

    /// Consuming: the link is up with a subscription.
    pub(super) fn consuming(&self) -> bool {
        matches!(&self.link, Link::Up(l) if matches!(l.subscription, Subscription::Active(_)))
    }

    /// Starts a connect, after the backoff a link that lived `lived` earns (`None`: there was
    /// none). Not while one is under way, nor once stopping.
    pub(super) fn connect(&mut self, ctx: &mut Context<Self>, lived: Option<Duration>) {
        if self.connecting() || self.phase != Phase::Running {
            return;
        }
        self.link = Link::Connecting;
        let amqp = self.amqp.clone();
        let config = self.config.clone();
        let frames = self.frames;
        let addr = ctx.address();
        let first_delay = self.rebuild_delay(lived);
        actix::spawn(async move {
            let open = || open(&amqp, &config, frames);
            let wanted = || addr.connected();
            if let Some((conn, channel)) = amqp::until_open(
                &config.stage.to_string(),
                "consumer cannot consume; retrying",
                first_delay,
                open,
                wanted,
            )
            .await
            {
                addr.do_send(Connected { conn, channel });
            }
        });
    }

    /// How long to wait before (re)building the link: nothing for the first one or after a
    /// healthy one, a growing backoff (200 ms doubling to 10 s, jittered) after each link that
    /// died young.
    pub(super) fn rebuild_delay(&mut self, lived: Option<Duration>) -> Duration {
        match lived {
            None if self.generation == 0 => Duration::ZERO,
            Some(lived) if lived >= HEALTHY_LINK => {
                self.rebuild_delays = Box::new(amqp::reconnect_backoff());
                Duration::ZERO
            }
            _ => self
                .rebuild_delays
                .next()
                .unwrap_or(Duration::from_secs(10)),
        }
    }

    /// Rebuilds the link for `reason` (counted), after the backoff `connect` applies.
    pub(super) fn rebuild(&mut self, ctx: &mut Context<Self>, reason: &'static str) {
        crate::metrics::consumer_restart(&self.config.stage, reason);
        let lived = self.teardown();
        self.connect(ctx, lived);
    }

    /// Drops the link: its unacked deliveries go back to the queue on the broker. Answers how
    /// long the link lived (`None`: there was none).
    pub(super) fn teardown(&mut self) -> Option<Duration> {
        // Held deliveries of this channel go back to the queue with it.
        let (held, held_bytes) = self.throttle.clear();
        self.inflight = self.inflight.saturating_sub(held);
        self.inflight_bytes = self.inflight_bytes.saturating_sub(held_bytes);
        // A permit held for a subscription without a body limit goes; one held for a body
        // still in flight stays until it settles (`oversize.rs`).
        self.oversize_link_lost();
        self.oversize_settled();
        match std::mem::replace(&mut self.link, Link::Down) {
            Link::Up(linked) => {
                // However it ended (the channel closed, the stream ended, a stuck consumer): the
                // link is down until the next one is up.
                self.config.copies.link_down();
                crate::events::amqp_link(
                    &self.config.stage.to_string(),
                    false,
                    Some(self.config.stage.pipeline()),
                );
                // Dropping the acker ends its task; the channel's unacked deliveries are requeued.
                drop(linked.acker);
                actix::spawn(amqp::close(Some(linked.channel), Some(linked.connection)));
                Some(linked.since.elapsed())
            }
            Link::Down | Link::Connecting => None,
        }
    }

    /// Why the current link ended, from what the stream reported; a delivery the AMQP client
    /// cannot parse is named with what to do about it, and a frame over twice the configured
    /// limit (the AMQP client takes up to that) makes the next link take the broker's limit.
    pub(super) fn link_end_reason(&mut self) -> &'static str {
        match &self.last_stream_error {
            Some(e) if e.contains("frame too large") => {
                warn!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, error = %e,
                    "a delivery's content header is larger than the frame_max that AMQP_URL sets; \
                     this consumer takes the broker's frame_max from now on");
                self.frames = amqp::Frames::BrokerOnly;
                "frame_too_large"
            }
            Some(e) if e.contains("failed to parse") => {
                error!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, error = %e,
                    "a delivery at the head of the queue cannot be parsed by the AMQP client; \
                     it is redelivered on every reconnect (paced by a backoff) and blocks the \
                     messages behind it. Remove it with a tool that tolerates it (for example the \
                     management UI's Get Messages with 'Reject requeue false', which sends it to \
                     the DLX); on a quorum queue its delivery limit dead-letters it by itself");
                "parse_error"
            }
            _ if self.open_channel().is_some() => "cancelled",
            _ => "connection_lost",
        }
    }
}

/// Connects (once the [topology gate](crate::topology::gate) is open) and sets the prefetch; subscribing is left to [`Consumer::maybe_subscribe`].
async fn open(
    amqp: &AmqpConfig,
    config: &ConsumerConfig,
    frames: amqp::Frames,
) -> Result<(Connection, Channel), AmqpError> {
    // Before connecting: held until the start's topology check passed (`gate`).
    if !crate::topology::gate::wait_open(amqp.connect_timeout()).await {
        return Err(AmqpError::Unavailable(
            "the exchanges and queues are not checked yet (the broker could not be reached at \
             the start; the check is tried again with the reconnect backoff)"
                .into(),
        ));
    }
    let (conn, channel) = amqp::connect_channel(amqp, &config.stage.to_string(), frames).await?;
    let result = channel
        .basic_qos(config.prefetch, BasicQosOptions { global: false })
        .await;
    match result {
        Ok(()) => Ok((conn, channel)),
        Err(e) => {
            amqp::close(Some(channel), Some(conn)).await;
            Err(e.into())
        }
    }
}

impl Handler<Connected> for Consumer {
    type Result = ();

    fn handle(&mut self, msg: Connected, ctx: &mut Self::Context) {
        if self.phase != Phase::Running {
            self.link = Link::Down;
            actix::spawn(amqp::close(Some(msg.channel), Some(msg.conn)));
            self.stream_done(ctx);
            return;
        }
        // Counted by the stage's memory of copies, which a reload may hand to the stage that
        // replaces this one: generations never repeat within it.
        let first = self.generation == 0;
        let generation = self.config.copies.link_up();
        self.generation = generation;
        self.link = Link::Up(Box::new(Linked {
            acker: Some(Acker::open(
                msg.channel.clone(),
                self.config.stage.clone(),
                self.config.prefetch,
                (self.config.copies.clone(), generation),
            )),
            connection: msg.conn,
            channel: msg.channel,
            since: Instant::now(),
            // `open` set the configured prefetch on the new channel.
            window: self.config.prefetch,
            subscription: Subscription::None,
        }));
        self.last_stream_error = None;
        info!(pipeline = self.config.stage.pipeline(), stage = self.config.stage.stage().as_str(), queue = %self.config.queue, prefetch = self.config.prefetch,
            generation, held = !self.holds.is_empty(), "connected");
        crate::events::amqp_link(
            &self.config.stage.to_string(),
            true,
            Some(self.config.stage.pipeline()),
        );
        if !first {
            crate::metrics::reconnected("amqp");
        }
        self.maybe_subscribe(ctx);
    }
}
