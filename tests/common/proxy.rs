//! The TCP proxy: `TcpProxy` cuts, restores, freezes, thaws and delays one warren's link to a
//! server, either way.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::env::free_port;

/// A TCP proxy in front of a server (PostgreSQL, RabbitMQ) that one test's warren connects
/// through, so the test can cut and restore that warren's link alone, and knows which upstream
/// connections are its own.
pub struct TcpProxy {
    port: u16,
    /// The server's URL, to rewrite for the proxy.
    upstream_url: url::Url,
    state: Arc<ProxyState>,
    accept: tokio::task::JoinHandle<()>,
}

/// What the accept loop and the connection tasks share with the test.
pub struct ProxyState {
    /// Where the server listens.
    upstream: String,
    /// While false, new connections are reset as soon as they are accepted.
    up: AtomicBool,
    /// Bumped by `cut`: every live connection ends when it changes.
    cuts: watch::Sender<u64>,
    /// While true, nothing passes in either direction, but every socket stays open: a
    /// half-open link, as a network partition leaves it.
    frozen: watch::Sender<bool>,
    /// The live connections' holds: while one is true, what the server sends on that connection
    /// waits (in the proxy and the kernel's buffers) and is passed on, in order, when the hold
    /// ends: a slow link, not a broken one. What the client sends passes, unless its own hold
    /// (`Hold::held_up`) is on.
    holds: Mutex<Vec<Hold>>,
    /// When not zero, on connections accepted from then on every AMQP `basic.consume-ok` the
    /// server sends (and what follows it) reaches the client this many ms late: a broker slow to
    /// answer a consume.
    consume_ok_delay_ms: AtomicU64,
    /// Local ports of the live upstream connections: PostgreSQL's `client_port` for them.
    upstream_ports: Mutex<HashSet<u16>>,
    /// When not zero, a connection that has passed this many bytes from the server stops
    /// there (mid-frame, a body half-received), until [`TcpProxy::release`]: a link that
    /// stalls while a big message arrives.
    stall_past: watch::Sender<u64>,
    /// Armed by [`TcpProxy::hold_after_next_send`]: the first connection whose opening bytes
    /// hold these (its client's name) to send anything has what the server sends from then on
    /// held, once.
    hold_after: Mutex<Option<Vec<u8>>>,
    /// Whether the armed hold took a connection.
    hold_fired: AtomicBool,
    /// Armed by [`TcpProxy::hold_next_send`]: the first connection whose opening bytes hold
    /// these to send anything has what it sends held, from those bytes on, once.
    hold_before: Mutex<Option<Vec<u8>>>,
    /// The connection the armed [`ProxyState::hold_before`] took: its hold's sender, closed
    /// once that connection has ended.
    held_before: Mutex<Option<Arc<watch::Sender<bool>>>>,
}

impl TcpProxy {
    /// Starts a proxy to the server of `server_url` (`default_port` when the URL has none).
    pub async fn start(server_url: &str, default_port: u16) -> Self {
        let upstream_url = url::Url::parse(server_url).expect("server URL");
        let upstream = format!(
            "{}:{}",
            upstream_url.host_str().unwrap_or("127.0.0.1"),
            upstream_url.port().unwrap_or(default_port)
        );
        let listener = TcpListener::bind(("127.0.0.1", free_port()))
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let state = Arc::new(ProxyState {
            upstream,
            up: AtomicBool::new(true),
            cuts: watch::Sender::new(0),
            frozen: watch::Sender::new(false),
            holds: Mutex::new(Vec::new()),
            consume_ok_delay_ms: AtomicU64::new(0),
            upstream_ports: Mutex::new(HashSet::new()),
            stall_past: watch::Sender::new(0),
            hold_after: Mutex::new(None),
            hold_fired: AtomicBool::new(false),
            hold_before: Mutex::new(None),
            held_before: Mutex::new(None),
        });
        let accept = tokio::spawn({
            let state = state.clone();
            async move {
                loop {
                    if let Ok((client, _)) = listener.accept().await {
                        tokio::spawn(state.clone().serve(client));
                    }
                }
            }
        });
        TcpProxy {
            port,
            upstream_url,
            state,
            accept,
        }
    }

    /// The server's URL, through the proxy.
    pub fn url(&self) -> String {
        let mut url = self.upstream_url.clone();
        url.set_host(Some("127.0.0.1")).expect("host");
        url.set_port(Some(self.port)).expect("port");
        url.to_string()
    }

    /// The server goes away: live connections are reset, new ones are reset on accept.
    pub fn cut(&self) {
        self.state.up.store(false, Ordering::SeqCst);
        self.state.cuts.send_modify(|n| *n += 1);
    }

    /// New connections are reset on accept; live ones go on (a server that keeps its sessions
    /// but takes no new ones, as a primary fenced during a failover).
    pub fn refuse_new(&self) {
        self.state.up.store(false, Ordering::SeqCst);
    }

    /// The server is back for new connections.
    pub fn restore(&self) {
        self.state.up.store(true, Ordering::SeqCst);
    }

    /// The link goes silent without closing: live and new connections stay open, but no byte
    /// passes either way (a half-open connection; only timeouts can notice it).
    pub fn freeze(&self) {
        self.state.frozen.send_replace(true);
    }

    /// Ends a freeze: the frozen connections are reset, new ones pass again.
    pub fn thaw(&self) {
        self.state.frozen.send_replace(false);
        self.state.cuts.send_modify(|n| *n += 1);
    }

    /// What the server sends from now on on the live connection that has carried the most bytes
    /// to the client (a consumer's link: it carries the deliveries) is held back, until
    /// [`TcpProxy::release`]; the client's bytes still pass, other connections are untouched:
    /// answers that are late, not lost.
    pub fn hold_busiest(&self) {
        let holds = self.state.holds.lock().unwrap();
        let busiest = holds
            .iter()
            .filter(|h| !h.held.is_closed())
            .max_by_key(|h| h.bytes_down.load(Ordering::Relaxed))
            .expect("a live connection to hold");
        busiest.held.send_replace(true);
    }

    /// What the server sends from now on on every live connection whose client named itself
    /// with a connection name containing `name` (AMQP: warren's links are named `warren
    /// <purpose> <host>:<pid>`, so `warren router <host>:<pid>` is one warren's publisher) is
    /// held back, until [`TcpProxy::release`]: publisher confirms that come late, as from a
    /// broker under a memory alarm. Panics when no live connection has such a name.
    pub fn hold_named(&self, name: &str) {
        let holds = self.state.holds.lock().unwrap();
        let mut held = 0;
        for h in holds.iter().filter(|h| !h.held.is_closed()) {
            let opening = h.opening.lock().unwrap();
            if opening.windows(name.len()).any(|w| w == name.as_bytes()) {
                h.held.send_replace(true);
                held += 1;
            }
        }
        assert!(held > 0, "no live connection named {name:?} to hold");
    }

    /// What the client sends from now on on the live connection that has carried the most bytes
    /// to the client (a consumer's link: its acks) is held back, until [`TcpProxy::release`] or a
    /// cut (which drops it: frames the server never saw); the server's bytes still pass.
    pub fn hold_busiest_from_client(&self) {
        let holds = self.state.holds.lock().unwrap();
        let busiest = holds
            .iter()
            .filter(|h| !h.held.is_closed())
            .max_by_key(|h| h.bytes_down.load(Ordering::Relaxed))
            .expect("a live connection to hold");
        busiest.held_up.send_replace(true);
    }

    /// On connections accepted from now on, every `basic.consume-ok` of the server (AMQP) reaches
    /// the client `delay` late, and what the server sent after it waits behind it.
    pub fn delay_consume_ok(&self, delay: std::time::Duration) {
        let ms = u64::try_from(delay.as_millis()).expect("delay");
        self.state.consume_ok_delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Every connection that has passed (or passes) `bytes` from the server stops there, in
    /// the middle of whatever frame it carries, until [`TcpProxy::release`]: a big body that
    /// begins arriving and stalls (a link slow under its load).
    pub fn stall_past(&self, bytes: u64) {
        self.state.stall_past.send_replace(bytes);
    }

    /// The first connection whose client named itself `name` (in its first bytes: PostgreSQL's
    /// `application_name`, AMQP's connection name) to send anything from now on (a batch's
    /// insert on a connection of the pool) has everything the server sends from then on held,
    /// until [`TcpProxy::release`]: the server did what was asked (an autocommitted insert is
    /// stored), and the answer is lost on the way, a link gone silent at that moment. Once;
    /// [`TcpProxy::hold_fired`] tells.
    pub fn hold_after_next_send(&self, name: &str) {
        self.state.hold_fired.store(false, Ordering::SeqCst);
        *self.state.hold_after.lock().unwrap() = Some(name.as_bytes().to_vec());
    }

    /// The first connection whose client named itself `name` (see
    /// [`TcpProxy::hold_after_next_send`]) to send anything from now on has what it sends held
    /// from those bytes on, until [`TcpProxy::release`]: a statement on its way that the server
    /// has not received (a proxy or a network path holding it), delivered late. Once;
    /// [`TcpProxy::held_before_fired`] tells, [`TcpProxy::held_before_ended`] whether that
    /// connection has ended since (both ways: what it carried was passed or refused).
    pub fn hold_next_send(&self, name: &str) {
        *self.state.held_before.lock().unwrap() = None;
        *self.state.hold_before.lock().unwrap() = Some(name.as_bytes().to_vec());
    }

    /// Whether the hold armed by [`TcpProxy::hold_next_send`] took a connection.
    pub fn held_before_fired(&self) -> bool {
        self.state.held_before.lock().unwrap().is_some()
    }

    /// Whether the connection [`TcpProxy::hold_next_send`] took has ended.
    pub fn held_before_ended(&self) -> bool {
        self.state
            .held_before
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(|h| h.is_closed())
    }

    /// Whether the hold armed by [`TcpProxy::hold_after_next_send`] took a connection.
    pub fn hold_fired(&self) -> bool {
        self.state.hold_fired.load(Ordering::SeqCst)
    }

    /// Ends every hold and stall: what the server sent meanwhile reaches the client, in order.
    pub fn release(&self) {
        self.state.stall_past.send_replace(0);
        for hold in self.state.holds.lock().unwrap().iter() {
            hold.held.send_replace(false);
            hold.held_up.send_replace(false);
        }
    }

    /// Local ports of the live upstream connections (PostgreSQL's `client_port` for them).
    pub fn backend_client_ports(&self) -> Vec<i32> {
        let ports = self.state.upstream_ports.lock().unwrap();
        ports.iter().map(|p| i32::from(*p)).collect()
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}

impl ProxyState {
    async fn serve(self: Arc<Self>, mut client: TcpStream) {
        // Subscribe before looking at `up`, so a cut in between is not missed.
        let mut cuts = self.cuts.subscribe();
        let mut frozen = self.frozen.subscribe();
        if !self.up.load(Ordering::SeqCst) {
            let _ = client.set_zero_linger();
            return;
        }
        let frozen_now = *frozen.borrow_and_update();
        if frozen_now {
            // Accepted, never answered, until the freeze ends.
            let _ = cuts.changed().await;
            let _ = client.set_zero_linger();
            return;
        }
        let Ok(mut upstream) = TcpStream::connect(&self.upstream).await else {
            let _ = client.set_zero_linger();
            return;
        };
        let port = upstream.local_addr().map(|a| a.port()).unwrap_or(0);
        self.upstream_ports.lock().unwrap().insert(port);
        let hold = Hold {
            held: Arc::new(watch::Sender::new(false)),
            held_up: Arc::new(watch::Sender::new(false)),
            bytes_down: Arc::new(AtomicU64::new(0)),
            opening: Arc::new(Mutex::new(Vec::new())),
        };
        let held_down = hold.held.clone();
        let held_up_tx = hold.held_up.clone();
        let (held, held_up, bytes_down, opening) = (
            hold.held.subscribe(),
            hold.held_up.subscribe(),
            hold.bytes_down.clone(),
            hold.opening.clone(),
        );
        {
            let mut holds = self.holds.lock().unwrap();
            holds.retain(|h| !h.held.is_closed());
            holds.push(hold);
        }
        let consume_ok_delay = match self.consume_ok_delay_ms.load(Ordering::SeqCst) {
            0 => None,
            ms => Some(std::time::Duration::from_millis(ms)),
        };
        let down = Down {
            held,
            bytes: &bytes_down,
            consume_ok_delay,
            stall_past: self.stall_past.subscribe(),
            frozen: self.frozen.subscribe(),
        };
        let up = Up {
            held_up,
            held_up_tx,
            opening,
            held_down: held_down.clone(),
            state: &self,
        };
        tokio::select! {
            _ = pass(&mut client, &mut upstream, down, up) => {}
            _ = cuts.changed() => {
                let _ = client.set_zero_linger();
                let _ = upstream.set_zero_linger();
            }
            _ = async { frozen.wait_for(|f| *f).await.is_ok() } => {
                // Silent from now on; both sockets stay open until the freeze ends.
                let _ = cuts.changed().await;
                let _ = client.set_zero_linger();
                let _ = upstream.set_zero_linger();
            }
        }
        self.upstream_ports.lock().unwrap().remove(&port);
    }
}

/// The hold of one connection (see [`ProxyState::holds`]).
struct Hold {
    held: Arc<watch::Sender<bool>>,
    /// The same for what the client sends.
    held_up: Arc<watch::Sender<bool>>,
    /// Bytes passed from the server to the client so far.
    bytes_down: Arc<AtomicU64>,
    /// The first bytes the client sent ([`OPENING`] at most): an AMQP client's connection name
    /// is among them (`TcpProxy::hold_named`).
    opening: Arc<Mutex<Vec<u8>>>,
}

/// How many of a client's first bytes are kept to find its connection name by.
const OPENING: usize = 8 * 1024;

/// How [`pass`] treats what the client sends.
struct Up<'a> {
    /// The connection's hold of what the client sends.
    held_up: watch::Receiver<bool>,
    /// Its sender (`ProxyState::hold_before`).
    held_up_tx: Arc<watch::Sender<bool>>,
    /// Where its first bytes are kept.
    opening: Arc<Mutex<Vec<u8>>>,
    /// The connection's hold of what the server sends (`ProxyState::hold_after`).
    held_down: Arc<watch::Sender<bool>>,
    state: &'a ProxyState,
}

/// How [`pass`] treats what the server sends.
struct Down<'a> {
    /// The connection's hold.
    held: watch::Receiver<bool>,
    /// Bytes passed to the client so far.
    bytes: &'a AtomicU64,
    /// Delay of each AMQP `basic.consume-ok` (the stream is then read frame by frame).
    consume_ok_delay: Option<std::time::Duration>,
    /// [`ProxyState::stall_past`].
    stall_past: watch::Receiver<u64>,
    /// [`ProxyState::frozen`], looked at before each read's bytes are passed on.
    frozen: watch::Receiver<bool>,
}

impl Down<'_> {
    /// Writes `bytes` to the client, stopping at the stall point while one is set.
    async fn write(
        &mut self,
        to: &mut (impl AsyncWriteExt + Unpin),
        mut bytes: &[u8],
    ) -> std::io::Result<()> {
        while !bytes.is_empty() {
            let passed = self.bytes.load(Ordering::Relaxed);
            let limit = *self.stall_past.borrow_and_update();
            let room = match limit {
                0 => bytes.len(),
                limit => (limit.saturating_sub(passed) as usize).min(bytes.len()),
            };
            if room == 0 {
                // The sender dropped means the proxy is going away: pass on.
                if self.stall_past.changed().await.is_err() {
                    self.stall_past = watch::Sender::new(0).subscribe();
                }
                continue;
            }
            to.write_all(&bytes[..room]).await?;
            self.bytes.fetch_add(room as u64, Ordering::Relaxed);
            bytes = &bytes[room..];
        }
        Ok(())
    }
}

/// Passes bytes both ways until both sides have ended or one fails, as
/// `tokio::io::copy_bidirectional` does, except that the server's bytes wait while held, and
/// behind a delayed `basic.consume-ok`, and the client's while `held_up`.
async fn pass(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    mut down: Down<'_>,
    mut upward: Up<'_>,
) -> std::io::Result<()> {
    let (mut from_client, mut to_client) = client.split();
    let (mut from_upstream, mut to_upstream) = upstream.split();
    let up = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = from_client.read(&mut buf).await?;
            if n == 0 {
                return to_upstream.shutdown().await;
            }
            // A freeze is in force the moment `freeze` returns: bytes read after it never pass,
            // even when this task runs before the `serve` select has seen the freeze.
            if *upward.state.frozen.borrow() {
                std::future::pending::<()>().await;
            }
            {
                let mut opening = upward.opening.lock().unwrap();
                let room = OPENING.saturating_sub(opening.len()).min(n);
                opening.extend_from_slice(&buf[..room]);
            }
            let before = {
                let mut armed = upward.state.hold_before.lock().unwrap();
                let opening = upward.opening.lock().unwrap();
                let found = armed
                    .as_ref()
                    .is_some_and(|p| opening.windows(p.len()).any(|w| w == p.as_slice()));
                if found {
                    armed.take();
                }
                found
            };
            if before {
                upward.held_up_tx.send_replace(true);
                *upward.state.held_before.lock().unwrap() = Some(upward.held_down.clone());
            }
            // The sender dropped means the proxy is going away: pass on.
            let _ = upward.held_up.wait_for(|h| !*h).await;
            // Held before the bytes go, so the server's answer to them is held too.
            let fire = {
                let mut armed = upward.state.hold_after.lock().unwrap();
                let opening = upward.opening.lock().unwrap();
                let found = armed
                    .as_ref()
                    .is_some_and(|p| opening.windows(p.len()).any(|w| w == p.as_slice()));
                if found {
                    armed.take();
                }
                found
            };
            if fire {
                upward.held_down.send_replace(true);
                upward.state.hold_fired.store(true, Ordering::SeqCst);
            }
            to_upstream.write_all(&buf[..n]).await?;
        }
    };
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        // Bytes read but not passed yet: with a consume-ok delay, what ends in a partial frame.
        let mut pending: Vec<u8> = Vec::new();
        loop {
            let n = from_upstream.read(&mut buf).await?;
            if n == 0 {
                return to_client.shutdown().await;
            }
            if *down.frozen.borrow() {
                std::future::pending::<()>().await;
            }
            // The sender dropped means the proxy is going away: pass on.
            let _ = down.held.wait_for(|h| !*h).await;
            let Some(delay) = down.consume_ok_delay else {
                down.write(&mut to_client, &buf[..n]).await?;
                continue;
            };
            pending.extend_from_slice(&buf[..n]);
            // AMQP frames: type (1), channel (2), size (4), payload, frame end (1); a method
            // frame (type 1) starts with its class and method ids, 60 and 21 for consume-ok.
            while pending.len() >= 7 {
                let size = u32::from_be_bytes([pending[3], pending[4], pending[5], pending[6]]);
                let end = 8 + size as usize;
                if pending.len() < end {
                    break;
                }
                if pending[0] == 1 && size >= 4 && pending[7..11] == [0, 60, 0, 21] {
                    tokio::time::sleep(delay).await;
                }
                down.write(&mut to_client, &pending[..end]).await?;
                pending.drain(..end);
            }
        }
    };
    tokio::try_join!(up, down).map(|_| ())
}
