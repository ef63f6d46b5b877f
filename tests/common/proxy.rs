//! The TCP proxy: `TcpProxy` cuts, restores, freezes and thaws one warren's link to a server.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
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
