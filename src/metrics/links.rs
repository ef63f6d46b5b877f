//! The links' state: each connection's gauge (`warren_connection_up`) and the state `/readyz`
//! reads, set together so that they cannot disagree; the links the roles need; the broker node
//! each AMQP link is on; what the start waits for before the roles run.

use super::*;

/// A connection to `target` (`amqp`, `postgres`, `redis`) came up or went down: the gauge
/// `warren_connection_up{target}` and the state `/readyz` reads ([`readiness`]), set together
/// so that they cannot disagree.
pub fn connection(target: &'static str, up: bool) {
    if let Some(i) = TARGETS.iter().position(|t| *t == target) {
        LINK_UP[i].store(up, Ordering::Relaxed);
    }
    gauge!(CONNECTION_UP, "target" => target).set(if up { 1.0 } else { 0.0 });
}

/// The targets of [`connection`], in the order of [`LINK_UP`].
const TARGETS: [&str; 3] = ["amqp", "postgres", "redis"];

/// Whether each target of [`TARGETS`] is up, as last reported to [`connection`].
static LINK_UP: [AtomicBool; 3] = [
    AtomicBool::new(false),
    AtomicBool::new(false),
    AtomicBool::new(false),
];

/// Which targets this instance's roles need to be ready, one bit each in the order of
/// [`TARGETS`]; set once at start by [`needs`].
static NEEDED: AtomicU8 = AtomicU8::new(0);

/// Declares, once at start, what this instance needs to be ready: the AMQP links its roles open
/// (each must be up; they start down; a consumer's link is named `<pipeline>/<stage>`) and, with `database`, the database. Redis is never
/// needed: messages flow without it.
pub fn needs(amqp_links: &[String], database: bool) {
    let all_up = {
        let mut guard = AMQP_LINKS.lock().unwrap_or_else(|p| p.into_inner());
        let links = guard.get_or_insert_with(HashMap::new);
        for link in amqp_links {
            links.entry(link.clone()).or_insert(false);
        }
        links.values().all(|u| *u)
    };
    let mut bits = 0;
    if !amqp_links.is_empty() {
        bits |= 1;
        connection("amqp", all_up);
    }
    if database {
        bits |= 2;
    }
    NEEDED.store(bits, Ordering::Relaxed);
}

/// The AMQP links of stages a reload removed: `/readyz` no longer waits for them.
pub fn unneed(amqp_links: &[String]) {
    let all_up = {
        let mut guard = AMQP_LINKS.lock().unwrap_or_else(|p| p.into_inner());
        let links = guard.get_or_insert_with(HashMap::new);
        for link in amqp_links {
            links.remove(link);
        }
        links.values().all(|u| *u)
    };
    if NEEDED.load(Ordering::Relaxed) & 1 != 0 {
        connection("amqp", all_up);
    }
}

/// What the metrics listener's `/readyz` answers: each link the roles need, up or not (a link
/// no role needs is left out), and the stages whose breaker is open, which do not make an
/// instance unready (docs/deploying.md, "What the probes mean"): an open breaker is the
/// pipeline's (a missing table, a privilege), shared by every instance, so failing readiness
/// would move no work and only stall a rolling update (the one that fixes it too), take every
/// instance's API out of its Service and block node drains; it shows here, in
/// `warren_breaker_open` and in the WarrenBreakerOpen alert instead.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Readiness {
    /// Every AMQP link of the roles (consumers, their publisher, the API's publisher) is up.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker: Option<bool>,
    /// The database answered the last probe (every 2 s, on a connection of its own, within
    /// 2 s) or insert.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub database: Option<bool>,
    /// The stages (`<pipeline>/<stage>`) whose sink-outage breaker is open; left out when none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub breakers_open: Vec<String>,
    /// While `warren run` waits before its roles start, what it waits for (the roles' links
    /// are not made yet, so they are left out: review R37x F2, `"database": false` while the
    /// database had answered); then never again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub starting: Option<String>,
}

impl Readiness {
    /// Whether the roles run and every needed link is up (open breakers do not count).
    pub fn ready(&self) -> bool {
        self.starting.is_none() && self.broker != Some(false) && self.database != Some(false)
    }
}

/// What the start waits for before the roles run (`None`: they run), for `/readyz`.
static STARTING: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// The start waits for `what` (`None`: the roles run): `/readyz` answers 503 naming it.
pub fn starting(what: Option<&str>) {
    *STARTING.lock().unwrap_or_else(|p| p.into_inner()) = what.map(str::to_string);
}

/// The links this instance needs (see [`needs`]) as [`connection`] last saw them, and the
/// stages whose breaker is open.
pub fn readiness() -> Readiness {
    let starting = STARTING.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if starting.is_some() {
        // The roles' links are not made yet: what they would say is not known.
        return Readiness {
            broker: None,
            database: None,
            breakers_open: Vec::new(),
            starting,
        };
    }
    let needed = NEEDED.load(Ordering::Relaxed);
    let link = |i: usize| (needed & (1 << i) != 0).then(|| LINK_UP[i].load(Ordering::Relaxed));
    Readiness {
        broker: link(0),
        database: link(1),
        breakers_open: stages()
            .iter()
            .filter(|(_, s)| s.breaker_open.load(Ordering::Relaxed))
            .map(|(id, _)| id.to_string())
            .collect(),
        starting: None,
    }
}

/// The broker node each AMQP link connected to last, so the gauge of the node it leaves (or of
/// a link that went down) can be set to 0.
static LINK_NODES: std::sync::Mutex<Option<std::collections::HashMap<String, String>>> =
    std::sync::Mutex::new(None);

/// An AMQP link connected to `node` (`host:port`): `warren_amqp_node_info{link, node}` is 1,
/// and 0 for the node it was on before, if another.
pub fn amqp_node(link: &str, node: &str) {
    let mut guard = LINK_NODES.lock().unwrap_or_else(|p| p.into_inner());
    let nodes = guard.get_or_insert_with(Default::default);
    if let Some(old) = nodes.insert(link.to_string(), node.to_string())
        && old != node
    {
        gauge!(AMQP_NODE_INFO, "link" => link.to_string(), "node" => old).set(0.0);
    }
    gauge!(AMQP_NODE_INFO, "link" => link.to_string(), "node" => node.to_string()).set(1.0);
}

/// The AMQP links of stages a reload removed: their `warren_amqp_node_info` goes to 0 (the
/// exporter cannot drop a series; 0 says the link is on no node) and a link of the same name
/// added again later starts from no node.
pub fn unlink(links: &[String]) {
    let mut guard = LINK_NODES.lock().unwrap_or_else(|p| p.into_inner());
    let nodes = guard.get_or_insert_with(Default::default);
    for link in links {
        if let Some(node) = nodes.remove(link) {
            gauge!(AMQP_NODE_INFO, "link" => link.clone(), "node" => node).set(0.0);
        }
    }
}

/// The broker node (`host:port`) the AMQP link `link` connected to last.
pub fn amqp_node_of(link: &str) -> Option<String> {
    let guard = LINK_NODES.lock().unwrap_or_else(|p| p.into_inner());
    guard.as_ref().and_then(|m| m.get(link)).cloned()
}

/// One AMQP link of this process (a consumer or a publisher, by name) came up or went down;
/// `warren_connection_up{target="amqp"}` is 1 while every known link is up. A link that went
/// down is on no node: its `warren_amqp_node_info` goes to 0 until it connects again.
pub fn amqp_link(link: &str, up: bool) {
    if !up {
        let guard = LINK_NODES.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(node) = guard.as_ref().and_then(|m| m.get(link)) {
            gauge!(AMQP_NODE_INFO, "link" => link.to_string(), "node" => node.clone()).set(0.0);
        }
    }
    let all_up = {
        let mut guard = AMQP_LINKS.lock().unwrap_or_else(|p| p.into_inner());
        let links = guard.get_or_insert_with(HashMap::new);
        links.insert(link.to_string(), up);
        links.values().all(|u| *u)
    };
    connection("amqp", all_up);
}

/// Every AMQP link of this process by name (those [`needs`] declared, and any that reported),
/// and whether it is up.
static AMQP_LINKS: Mutex<Option<HashMap<String, bool>>> = Mutex::new(None);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_when_every_needed_link_is_up() {
        let r = |broker, database| {
            Readiness {
                broker,
                database,
                breakers_open: Vec::new(),
                starting: None,
            }
            .ready()
        };
        assert!(r(Some(true), Some(true)));
        assert!(r(None, Some(true)), "a link no role needs does not count");
        assert!(r(None, None));
        assert!(!r(Some(false), Some(true)));
        assert!(!r(Some(true), Some(false)));
        assert!(!r(None, Some(false)));
        let waiting = Readiness {
            broker: None,
            database: None,
            breakers_open: Vec::new(),
            starting: Some("checking".into()),
        };
        assert!(!waiting.ready(), "the roles do not run yet");
        assert_eq!(
            serde_json::to_value(&waiting).expect("json"),
            serde_json::json!({"starting": "checking"})
        );
    }

    #[test]
    fn readiness_leaves_out_the_links_no_role_needs() {
        let body = serde_json::to_value(Readiness {
            broker: None,
            database: Some(false),
            breakers_open: Vec::new(),
            starting: None,
        })
        .expect("json");
        assert_eq!(body, serde_json::json!({"database": false}));
    }

    /// An open breaker is named in the body and leaves the instance ready.
    #[test]
    fn an_open_breaker_is_named_and_leaves_the_instance_ready() {
        let readiness = Readiness {
            broker: Some(true),
            database: Some(true),
            breakers_open: vec!["users/main".into()],
            starting: None,
        };
        assert!(readiness.ready());
        assert_eq!(
            serde_json::to_value(&readiness).expect("json"),
            serde_json::json!({"broker": true, "database": true, "breakers_open": ["users/main"]})
        );
    }
}
