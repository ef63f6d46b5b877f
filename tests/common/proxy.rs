//! The TCP proxy: `TcpProxy` cuts, restores, freezes, thaws and delays one warren's link to a
//! server.

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
    /// ends: a slow link, not a broken one. What the client sends passes.
    holds: Mutex<Vec<Hold>>,
    /// Local ports of the live upstream connections: PostgreSQL's `client_port` for them.
    upstream_ports: Mutex<HashSet<u16>>,
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
            upstream_ports: Mutex::new(HashSet::new()),
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

    /// Ends every hold: what the server sent meanwhile reaches the client, in order.
    pub fn release(&self) {
        for hold in self.state.holds.lock().unwrap().iter() {
            hold.held.send_replace(false);
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
            held: watch::Sender::new(false),
            bytes_down: Arc::new(AtomicU64::new(0)),
        };
        let (held, bytes_down) = (hold.held.subscribe(), hold.bytes_down.clone());
        {
            let mut holds = self.holds.lock().unwrap();
            holds.retain(|h| !h.held.is_closed());
            holds.push(hold);
        }
        tokio::select! {
            _ = pass(&mut client, &mut upstream, held, &bytes_down) => {}
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
    held: watch::Sender<bool>,
    /// Bytes passed from the server to the client so far.
    bytes_down: Arc<AtomicU64>,
}

/// Passes bytes both ways until both sides have ended or one fails, as
/// `tokio::io::copy_bidirectional` does, except that the server's bytes wait while `held`;
/// counts them in `bytes_down`.
async fn pass(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    mut held: watch::Receiver<bool>,
    bytes_down: &AtomicU64,
) -> std::io::Result<()> {
    let (mut from_client, mut to_client) = client.split();
    let (mut from_upstream, mut to_upstream) = upstream.split();
    let up = async {
        tokio::io::copy(&mut from_client, &mut to_upstream).await?;
        to_upstream.shutdown().await
    };
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = from_upstream.read(&mut buf).await?;
            if n == 0 {
                return to_client.shutdown().await;
            }
            // The sender dropped means the proxy is going away: pass on.
            let _ = held.wait_for(|h| !*h).await;
            to_client.write_all(&buf[..n]).await?;
            bytes_down.fetch_add(n as u64, Ordering::Relaxed);
        }
    };
    tokio::try_join!(up, down).map(|_| ())
}
