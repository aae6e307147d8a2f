//! Egress policy: which destinations a sandbox may connect to, and why a connection was allowed
//! or refused.
//!
//! A policy is deny-all (the default), a list of rules (domains with `*.` wildcards, CIDRs,
//! each with optional ports), or allow-internet. Whatever the policy, addresses in the
//! *guarded* ranges — loopback, the private ranges, link-local (the metadata address
//! 169.254.169.254 among them), CGNAT (the sandboxes' own links), ULA, multicast, unspecified
//! and reserved space — are refused unless a CIDR rule lies inside the guarded range itself:
//! a wildcard, a domain whose name resolves there, a CIDR wider than the range or
//! allow-internet never opens them. Domain rules are decided on the name the connection states
//! (TLS SNI, HTTP `Host`) *and* on the address the proxy resolved for that name itself, so a
//! guest that lies in DNS, connects to a literal address or follows a CNAME gets nothing more.
//! Addresses the caller marks never-reachable ([`Attempt::never`]: the daemon's cluster peers
//! and etcd, the operator's list) are refused whatever the rules.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use thiserror::Error;

/// The longest domain name (RFC 1035, without the final dot).
pub const MAX_NAME_LEN: usize = 253;
/// Rules per policy (a bound on what a request may make the daemon check per connection).
pub const MAX_RULES: usize = 256;

/// Ranges that only an explicit CIDR rule inside them opens.
const GUARDED: &[&str] = &[
    "0.0.0.0/8",       // "this network", unspecified
    "10.0.0.0/8",      // private
    "100.64.0.0/10",   // CGNAT: the sandboxes' own links (100.96.0.0/30) are here
    "127.0.0.0/8",     // loopback
    "169.254.0.0/16",  // link-local, 169.254.169.254 (cloud metadata) among them
    "172.16.0.0/12",   // private
    "192.0.0.0/24",    // IETF protocol assignments
    "192.0.2.0/24",    // documentation
    "192.168.0.0/16",  // private
    "198.18.0.0/15",   // benchmarking
    "198.51.100.0/24", // documentation
    "203.0.113.0/24",  // documentation
    "224.0.0.0/4",     // multicast
    "240.0.0.0/4",     // reserved, broadcast
    "::/128",          // unspecified
    "::1/128",         // loopback
    "::ffff:0:0/96",   // IPv4-mapped: judged as IPv4 by `Policy::check`, never by itself
    "64:ff9b::/96",    // NAT64: would reach any IPv4 address
    "100::/64",        // discard
    "2001:db8::/32",   // documentation
    "fc00::/7",        // unique local (ULA)
    "fe80::/10",       // link-local
    "ff00::/8",        // multicast
];

/// Errors in a policy as a request states it.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error(
        "invalid domain pattern {0:?}: a host name, or \"*.\" and a name of two labels or more"
    )]
    Domain(String),
    #[error("invalid CIDR {0:?}")]
    Cidr(String),
    #[error("port 0 is not a port")]
    Port,
    #[error("{0} rules; at most {MAX_RULES}")]
    TooManyRules(usize),
}

/// A domain pattern: `example.com` (that name only) or `*.example.com` (every name below it,
/// not `example.com` itself). Stored lowercase, without a final dot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DomainPattern {
    Exact(String),
    Below(String),
}

impl DomainPattern {
    pub fn parse(s: &str) -> Result<Self, PolicyError> {
        let bad = || PolicyError::Domain(s.to_owned());
        let lower = s.trim_end_matches('.').to_ascii_lowercase();
        let (below, name) = match lower.strip_prefix("*.") {
            Some(rest) => (true, rest.to_owned()),
            None => (false, lower),
        };
        // `*.com` would be most of the internet by accident: a wildcard needs two labels.
        if !valid_name(&name) || (below && !name.contains('.')) {
            return Err(bad());
        }
        Ok(if below {
            Self::Below(name)
        } else {
            Self::Exact(name)
        })
    }

    /// Whether `name` (already normalised by [`normalise_name`]) matches.
    pub fn matches(&self, name: &str) -> bool {
        match self {
            Self::Exact(n) => name == n,
            Self::Below(n) => name
                .strip_suffix(n.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }
}

impl fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact(n) => write!(f, "{n}"),
            Self::Below(n) => write!(f, "*.{n}"),
        }
    }
}

/// A name as a connection or a query states it, lowercase without a final dot; `None` if it
/// is not a valid host name (too long, empty labels, characters outside `[a-z0-9-_]`).
pub fn normalise_name(name: &str) -> Option<String> {
    let lower = name.trim_end_matches('.').to_ascii_lowercase();
    valid_name(&lower).then_some(lower)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// What a rule matches besides its target: every port (empty) or these.
fn port_ok(ports: &[u16], port: u16) -> bool {
    ports.is_empty() || ports.contains(&port)
}

/// One allow rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    Domain {
        pattern: DomainPattern,
        ports: Vec<u16>,
    },
    Cidr {
        net: IpNet,
        ports: Vec<u16>,
    },
}

impl Rule {
    /// `domain` with `ports` (empty: any).
    pub fn domain(pattern: &str, ports: &[u16]) -> Result<Self, PolicyError> {
        check_ports(ports)?;
        Ok(Self::Domain {
            pattern: DomainPattern::parse(pattern)?,
            ports: ports.to_vec(),
        })
    }

    /// `cidr` (an address alone is a /32 or /128) with `ports` (empty: any).
    pub fn cidr(cidr: &str, ports: &[u16]) -> Result<Self, PolicyError> {
        check_ports(ports)?;
        Ok(Self::Cidr {
            net: parse_net(cidr)?,
            ports: ports.to_vec(),
        })
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (target, ports) = match self {
            Self::Domain { pattern, ports } => (pattern.to_string(), ports),
            Self::Cidr { net, ports } => (net.to_string(), ports),
        };
        write!(f, "{target}")?;
        if !ports.is_empty() {
            let list: Vec<String> = ports.iter().map(u16::to_string).collect();
            write!(f, ":{}", list.join(","))?;
        }
        Ok(())
    }
}

fn check_ports(ports: &[u16]) -> Result<(), PolicyError> {
    if ports.contains(&0) {
        return Err(PolicyError::Port);
    }
    Ok(())
}

/// A sandbox's egress policy.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Policy {
    /// Nothing leaves the sandbox (the default).
    #[default]
    DenyAll,
    /// What the rules allow.
    Rules(Vec<Rule>),
    /// Every public address on every port; guarded ranges stay closed.
    AllowInternet,
}

/// Why a connection was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// The policy is deny-all.
    DenyAll,
    /// The address is in a guarded range and no CIDR rule inside that range allows it.
    Guarded(IpNet),
    /// The address is one of the host's own (an address of one of its interfaces), and no
    /// CIDR rule of exactly that address allows it.
    HostAddress(IpAddr),
    /// The connection named no host (no SNI, no `Host`) and no CIDR rule allows its address.
    NoName,
    /// The address is out of every sandbox's reach (the cluster's peers, etcd, the operator's
    /// list): no rule opens it.
    Never(IpAddr),
    /// The name is allowed, but the proxy did not resolve it to this address.
    NotResolvedTo(String),
    /// No rule matches (name and port, or address and port).
    NoRule,
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DenyAll => write!(f, "the policy denies all egress"),
            Self::Guarded(net) => write!(
                f,
                "{net} is only reachable through a CIDR rule inside it (not by a domain, a \
                 wildcard or allow-internet)"
            ),
            Self::HostAddress(addr) => write!(
                f,
                "{addr} is an address of the host itself, only reachable through a CIDR rule of \
                 exactly that address"
            ),
            Self::NoName => write!(f, "the connection names no host and no CIDR rule allows it"),
            Self::Never(addr) => write!(
                f,
                "{addr} is out of every sandbox's reach (the cluster's own or the operator's \
                 never-reachable addresses); no rule opens it"
            ),
            Self::NotResolvedTo(name) => {
                write!(f, "{name} does not resolve to this address")
            }
            Self::NoRule => write!(f, "no rule allows it"),
        }
    }
}

/// Why a connection was allowed: the rule (as text), or allow-internet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Allowance {
    Rule(String),
    Internet,
}

/// A connection as the proxy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt<'a> {
    /// Where the guest connected.
    pub addr: IpAddr,
    pub port: u16,
    /// The name it stated (SNI or `Host`), normalised, if any.
    pub name: Option<&'a str>,
    /// The addresses the proxy itself resolved `name` to (empty without a name).
    pub resolved: &'a [IpAddr],
    /// `resolved` comes from the operator's static host map, not from DNS: a guarded address
    /// there is the operator's explicit choice for that name, and an exact domain rule for the
    /// name (never a wildcard, never allow-internet) may reach it.
    pub pinned: bool,
    /// `addr` is one of the host's own addresses (the caller knows its interfaces): guarded
    /// like a range of its own, a single address wide, whatever range it is in.
    pub host: bool,
    /// `addr` is one the operator put out of every sandbox's reach (the cluster's peers and
    /// etcd, a configured list): no rule of any kind opens it.
    pub never: bool,
}

impl Policy {
    /// Checks the policy's size limits.
    pub fn validate(&self) -> Result<(), PolicyError> {
        match self {
            Self::Rules(rules) if rules.len() > MAX_RULES => {
                Err(PolicyError::TooManyRules(rules.len()))
            }
            _ => Ok(()),
        }
    }

    /// The verdict on one connection.
    pub fn check(&self, attempt: &Attempt<'_>) -> Result<Allowance, Denial> {
        let addr = canonical(attempt.addr);
        let rules = match self {
            Self::DenyAll => return Err(Denial::DenyAll),
            Self::Rules(rules) => rules.as_slice(),
            Self::AllowInternet => &[],
        };
        if attempt.never {
            return Err(Denial::Never(addr));
        }
        // A CIDR rule decides on the address alone; inside a guarded range only a rule that
        // lies inside that range counts (for the host's own address: that address alone).
        let own = attempt.host.then(|| IpNet::from(addr));
        let guard = own.or_else(|| guarded_range(addr));
        for rule in rules {
            if let Rule::Cidr { net, ports } = rule
                && net.contains(&addr)
                && port_ok(ports, attempt.port)
                && guard.is_none_or(|g| g.contains(net))
            {
                return Ok(Allowance::Rule(rule.to_string()));
            }
        }
        if let Some(g) = guard {
            if attempt.pinned
                && let Some(name) = attempt.name
                && attempt.resolved.iter().any(|r| canonical(*r) == addr)
                && let Some(rule) = rules.iter().find(|r| {
                    matches!(r, Rule::Domain { pattern: DomainPattern::Exact(n), ports }
                        if n == name && port_ok(ports, attempt.port))
                })
            {
                return Ok(Allowance::Rule(rule.to_string()));
            }
            return Err(match own {
                Some(_) => Denial::HostAddress(addr),
                None => Denial::Guarded(g),
            });
        }
        if matches!(self, Self::AllowInternet) {
            return Ok(Allowance::Internet);
        }
        let Some(name) = attempt.name else {
            return Err(Denial::NoName);
        };
        let mut named = false;
        for rule in rules {
            if let Rule::Domain { pattern, ports } = rule
                && pattern.matches(name)
                && port_ok(ports, attempt.port)
            {
                named = true;
                if attempt.resolved.iter().any(|r| canonical(*r) == addr) {
                    return Ok(Allowance::Rule(rule.to_string()));
                }
            }
        }
        Err(if named {
            Denial::NotResolvedTo(name.to_owned())
        } else {
            Denial::NoRule
        })
    }

    /// Whether a DNS query for `name` may be answered: some domain rule matches it (on any
    /// port), or the policy allows the internet. Answers still never lead into guarded ranges
    /// unless a CIDR rule opens them (see [`Policy::check`]).
    pub fn may_resolve(&self, name: &str) -> bool {
        match self {
            Self::DenyAll => false,
            Self::AllowInternet => true,
            Self::Rules(rules) => rules.iter().any(|r| match r {
                Rule::Domain { pattern, .. } => pattern.matches(name),
                Rule::Cidr { .. } => false,
            }),
        }
    }
}

impl Policy {
    /// Whether everything `requested` allows, this policy (an operator's ceiling) allows too;
    /// otherwise the first rule that goes beyond it. Allow-internet covers every domain rule
    /// and every CIDR outside the guarded ranges; a rule list covers a domain rule with a
    /// pattern at least as wide and a CIDR rule inside one of its CIDRs, on the ports it
    /// allows.
    pub fn covers(&self, requested: &Policy) -> Result<(), String> {
        let wanted = match requested {
            Self::DenyAll => return Ok(()),
            Self::AllowInternet => {
                return match self {
                    Self::AllowInternet => Ok(()),
                    _ => Err("allow-internet".to_owned()),
                };
            }
            Self::Rules(rules) => rules,
        };
        for rule in wanted {
            let ok = match (self, rule) {
                (Self::DenyAll, _) => false,
                (Self::AllowInternet, Rule::Domain { .. }) => true,
                (Self::AllowInternet, Rule::Cidr { net, .. }) => !GUARDED
                    .iter()
                    .filter_map(|s| s.parse::<IpNet>().ok())
                    .any(|g| g.contains(net) || net.contains(&g)),
                (Self::Rules(ceiling), _) => ceiling.iter().any(|c| rule_covers(c, rule)),
            };
            if !ok {
                return Err(rule.to_string());
            }
        }
        Ok(())
    }
}

/// Whether ceiling rule `c` allows everything rule `r` allows.
fn rule_covers(c: &Rule, r: &Rule) -> bool {
    let ports = |cp: &[u16], rp: &[u16]| {
        cp.is_empty() || (!rp.is_empty() && rp.iter().all(|p| cp.contains(p)))
    };
    match (c, r) {
        (
            Rule::Domain {
                pattern: cp,
                ports: cports,
            },
            Rule::Domain {
                pattern: rp,
                ports: rports,
            },
        ) => {
            let wide_enough = match (cp, rp) {
                (DomainPattern::Exact(a), DomainPattern::Exact(b)) => a == b,
                (DomainPattern::Exact(_), DomainPattern::Below(_)) => false,
                (DomainPattern::Below(_), DomainPattern::Exact(b)) => cp.matches(b),
                (DomainPattern::Below(a), DomainPattern::Below(b)) => a == b || cp.matches(b),
            };
            wide_enough && ports(cports, rports)
        }
        (
            Rule::Cidr {
                net: cn,
                ports: cports,
            },
            Rule::Cidr {
                net: rn,
                ports: rports,
            },
        ) => cn.contains(rn) && ports(cports, rports),
        _ => false,
    }
}

/// A CIDR (an address alone is a /32 or /128), its host bits cleared.
pub fn parse_net(cidr: &str) -> Result<IpNet, PolicyError> {
    let net = cidr
        .parse::<IpNet>()
        .or_else(|_| cidr.parse::<IpAddr>().map(IpNet::from))
        .map_err(|_| PolicyError::Cidr(cidr.to_owned()))?;
    Ok(net.trunc())
}

/// IPv4-mapped IPv6 addresses are judged as the IPv4 address they carry.
pub fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// The guarded range `addr` is in, if any.
pub fn guarded_range(addr: IpAddr) -> Option<IpNet> {
    let addr = canonical(addr);
    GUARDED
        .iter()
        .filter_map(|s| s.parse::<IpNet>().ok())
        .find(|net| net.contains(&addr))
}

#[cfg(test)]
mod tests;
