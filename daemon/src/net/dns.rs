//! One sandbox's DNS server, on its gateway address: answers A queries for the names its
//! policy allows (from the operator's host map, else the host's resolver), AAAA with no data
//! (the guest has IPv4 only), and refuses everything else at once — names no rule allows,
//! tunnel-shaped names, other query types, queries beyond the rate limit. Every query is
//! logged.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use airlock_api::v1::{EgressEvent, EgressKind};
use airlock_egress::dns::{DnsAnswer, DnsQuery, MAX_QUERY, QueryType, parse};
use airlock_egress::{Policy, Rule};
use tokio::net::UdpSocket;
use tokio::task::JoinSet;

use super::{NetState, now_ms};

/// TTL of the answers: short, so that a policy change is not outlived by guests' caches.
const TTL_S: u32 = 30;
/// What a sandbox's own host name resolves to (Debian's /etc/hosts convention).
const OWN_ADDRESS: Ipv4Addr = Ipv4Addr::new(127, 0, 1, 1);
/// Lookups in flight per sandbox; more queries are refused.
const MAX_PENDING: usize = 32;

/// A token bucket: `rate` per second, at most `burst` at once.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    rate: f64,
    burst: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: u32, burst: u32) -> Self {
        Self {
            tokens: f64::from(burst),
            rate: f64::from(rate),
            burst: f64::from(burst.max(1)),
            at: Instant::now(),
        }
    }

    fn take(&mut self) -> bool {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Serves queries until the sandbox's network is dropped (which aborts this task and the
/// lookups it started).
pub(super) async fn serve(state: Arc<NetState>, sock: UdpSocket) {
    let sock = Arc::new(sock);
    let mut bucket = Bucket::new(state.cfg().dns_per_second, state.cfg().dns_burst);
    let mut buf = vec![0u8; MAX_QUERY + 1];
    let mut lookups = JoinSet::new();
    loop {
        tokio::select! {
            got = sock.recv_from(&mut buf) => {
                let Ok((n, from)) = got else { continue };
                query(&state, &sock, &mut bucket, &mut lookups, &buf[..n], from).await;
            }
            Some(_) = lookups.join_next(), if !lookups.is_empty() => {}
        }
    }
}

/// One datagram from the guest: refused, answered here (the sandbox's own name), or looked
/// up on a task of `lookups` when a rule allows its name; logged unless it is the own name.
async fn query(
    state: &Arc<NetState>,
    sock: &Arc<UdpSocket>,
    bucket: &mut Bucket,
    lookups: &mut JoinSet<()>,
    datagram: &[u8],
    from: SocketAddr,
) {
    let t0 = Instant::now();
    let Some(q) = parse(datagram) else {
        let mut ev = event(None);
        ev.verdict = format!("not a DNS query ({} bytes)", datagram.len());
        state.record(ev);
        return;
    };
    let mut ev = event(Some(&q));
    if let Some(why) = refusal(state, bucket, &q, lookups.len()) {
        ev.verdict = why;
        reply(sock, &q, &DnsAnswer::Refused, from).await;
        state.record(ev);
        return;
    }
    let name = q.name.clone().unwrap_or_default();
    if name == state.sandbox_id {
        // The sandbox's own host name (the agent sets its id) is answered here, as
        // /etc/hosts would: sudo and others look it up, and it is no egress.
        let answer = match q.qtype {
            QueryType::A => DnsAnswer::Addresses(vec![OWN_ADDRESS], TTL_S),
            _ => DnsAnswer::NoData,
        };
        reply(sock, &q, &answer, from).await;
        return;
    }
    let policy = state.policy();
    let Some(rule) = allowing_rule(&policy, &name) else {
        ev.verdict = match *policy {
            Policy::DenyAll => "the policy denies all egress".to_owned(),
            _ => "no rule allows this name".to_owned(),
        };
        reply(sock, &q, &DnsAnswer::Refused, from).await;
        state.record(ev);
        return;
    };
    let (st, sock) = (state.clone(), sock.clone());
    lookups.spawn(look_up(st, sock, q, from, name, rule, ev, t0));
}

/// Query step: why `q` is refused before its name is looked at, if it is: over the rate
/// limit (this takes a token), tunnel-shaped, or too many lookups (`pending`) at once.
fn refusal(state: &NetState, bucket: &mut Bucket, q: &DnsQuery, pending: usize) -> Option<String> {
    if !bucket.take() {
        Some(format!(
            "rate limit: more than {} queries per second",
            state.cfg().dns_per_second
        ))
    } else if let Some(shape) = q.refused_shape() {
        Some(shape.to_string())
    } else if pending >= MAX_PENDING {
        Some(format!("more than {MAX_PENDING} lookups at once"))
    } else {
        None
    }
}

/// Query step (on a task of its own): resolves `name`, which `rule` allows, answers the
/// guest (its IPv4 addresses for A, no data for other types, NXDOMAIN without any), remembers
/// what it resolved to, and records the event.
#[allow(clippy::too_many_arguments)]
async fn look_up(
    st: Arc<NetState>,
    sock: Arc<UdpSocket>,
    q: DnsQuery,
    from: SocketAddr,
    name: String,
    rule: String,
    mut ev: EgressEvent,
    t0: Instant,
) {
    let (addrs, _) = st.resolve(&name).await;
    let v4: Vec<_> = addrs
        .iter()
        .filter_map(|a| match a {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
        .collect();
    let answer = match (&q.qtype, v4.is_empty()) {
        (_, true) => DnsAnswer::NxDomain,
        (QueryType::A, false) => DnsAnswer::Addresses(v4.clone(), TTL_S),
        _ => DnsAnswer::NoData,
    };
    if !v4.is_empty() {
        st.remember(&name, &addrs);
    }
    reply(&sock, &q, &answer, from).await;
    ev.allowed = true;
    ev.verdict = if v4.is_empty() {
        format!("{rule}; the name does not resolve")
    } else {
        rule
    };
    ev.answers = v4.iter().map(ToString::to_string).collect();
    ev.duration_ms = t0.elapsed().as_secs_f64() * 1000.0;
    st.record(ev);
}

/// The rule that lets the guest resolve `name` (as text), if any.
fn allowing_rule(policy: &Policy, name: &str) -> Option<String> {
    match policy {
        Policy::DenyAll => None,
        Policy::AllowInternet => Some("allow-internet".to_owned()),
        Policy::Rules(rules) => rules
            .iter()
            .find(|r| matches!(r, Rule::Domain { pattern, .. } if pattern.matches(name)))
            .map(ToString::to_string),
    }
}

fn event(q: Option<&DnsQuery>) -> EgressEvent {
    EgressEvent {
        kind: EgressKind::Dns as i32,
        time_unix_ms: now_ms(),
        name: q.map(|q| q.raw_name.clone()).unwrap_or_default(),
        query_type: q.map(|q| q.qtype.to_string()).unwrap_or_default(),
        port: 53,
        ..Default::default()
    }
}

async fn reply(sock: &UdpSocket, q: &DnsQuery, answer: &DnsAnswer, to: SocketAddr) {
    let _ = sock.send_to(&q.answer(answer), to).await;
}
