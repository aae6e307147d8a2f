//! Where the package proxy connects. Index pages name the files' URLs, so a registry (or
//! whoever controls what it lists) chooses where the daemon connects from the host's
//! namespace; the proxy therefore connects only:
//!
//! - to a registry's own hosts: its URL's host and port, and the `file_hosts` the operator
//!   listed for it (PyPI's files are on `files.pythonhosted.org`). A file linked anywhere else
//!   is refused before any connection;
//! - to addresses outside the egress guards' ranges ([`airlock_egress::policy::guarded_range`]:
//!   loopback, private, link-local with the metadata address, CGNAT, ULA, ...) and not the
//!   host's own ([`airlock_egress::host::HostAddrs`]), unless the registry's
//!   `private_addresses` (CIDRs the operator wrote) holds the address: the one way to use a
//!   mirror on loopback or the operator's own network. Names are checked on the addresses
//!   they resolve to, by the resolver the client connects with (no second lookup to race),
//!   literal addresses before the request;
//! - following redirects only to the same host and port (at most 10).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use airlock_egress::host::HostAddrs;
use airlock_egress::policy::guarded_range;
use ipnet::IpNet;
use url::Url;

/// Redirects followed on one request (same host only).
const MAX_REDIRECTS: usize = 10;

/// A host a registry's files may be on: its name (or address) and port (`None`: the default
/// port of the link's scheme).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileHost {
    pub host: String,
    pub port: Option<u16>,
}

impl FileHost {
    /// `HOST`, `HOST:PORT`, `[V6]:PORT`; `None` if it is not one.
    pub fn parse(s: &str) -> Option<Self> {
        let u = Url::parse(&format!("http://{s}/")).ok()?;
        let host = u.host_str()?.to_owned();
        // `Url` drops port 80 as http's default; keep it when written.
        let port = u.port().or_else(|| s.ends_with(":80").then_some(80));
        (u.path() == "/" && u.username().is_empty() && u.query().is_none())
            .then_some(Self { host, port })
    }

    /// The registry URL's own host and port.
    pub fn of(url: &Url) -> Option<Self> {
        Some(Self {
            host: url.host_str()?.to_owned(),
            port: url.port_or_known_default(),
        })
    }

    fn matches(&self, url: &Url) -> bool {
        url.host_str() == Some(self.host.as_str())
            && match self.port {
                Some(p) => url.port_or_known_default() == Some(p),
                None => url.port().is_none(),
            }
    }
}

impl std::fmt::Display for FileHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(p) => write!(f, "{}:{p}", self.host),
            None => write!(f, "{}", self.host),
        }
    }
}

/// Why the proxy did not connect.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Refused {
    #[error("{url} is not on a host of registry {registry} (its hosts: {hosts})")]
    OffRegistry {
        url: String,
        registry: String,
        hosts: String,
    },
    #[error("{0} is neither http nor https")]
    Scheme(String),
    #[error(
        "{host} is at {addr}, {why}; the proxy connects there only where the registry's \
         private_addresses holds it"
    )]
    Guarded {
        host: String,
        addr: IpAddr,
        why: String,
    },
    #[error("{host} has no address")]
    NoAddress { host: String },
    #[error("a redirect from {from} to another host ({to}) was not followed")]
    CrossHost { from: String, to: String },
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooManyRedirects,
}

/// Whether `url` is on one of `hosts` (the registry `registry`'s), over http(s).
pub fn check_link(registry: &str, hosts: &[FileHost], url: &Url) -> Result<(), Refused> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Refused::Scheme(url.to_string()));
    }
    if hosts.iter().any(|h| h.matches(url)) {
        return Ok(());
    }
    Err(Refused::OffRegistry {
        url: url.to_string(),
        registry: registry.to_owned(),
        hosts: hosts
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// The address checks, shared by the client's resolver and the checks of literal addresses.
#[derive(Debug, Default)]
pub struct Guard {
    /// By host (as URLs write it): the guarded addresses its registries' `private_addresses`
    /// open.
    open: HashMap<String, Vec<IpNet>>,
    host_addrs: HostAddrs,
}

impl Guard {
    /// `hosts` and, for each, the CIDRs its registry opens (a host of several registries gets
    /// all of theirs).
    pub fn new<'a>(hosts: impl IntoIterator<Item = (&'a str, &'a [IpNet])>) -> Self {
        let mut open: HashMap<String, Vec<IpNet>> = HashMap::new();
        for (host, nets) in hosts {
            open.entry(host.to_owned())
                .or_default()
                .extend_from_slice(nets);
        }
        Self {
            open,
            host_addrs: HostAddrs::default(),
        }
    }

    /// Whether the proxy may connect to `addr`, an address of `host`.
    pub fn check_addr(&self, host: &str, addr: IpAddr) -> Result<(), Refused> {
        let addr = match addr {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
            v4 => v4,
        };
        let why = if let Some(net) = guarded_range(addr) {
            format!("in the guarded range {net}")
        } else if self.host_addrs.contains(addr) {
            "an address of the host itself".to_owned()
        } else {
            return Ok(());
        };
        let opened = self
            .open
            .get(host)
            .is_some_and(|nets| nets.iter().any(|n| n.contains(&addr)));
        match opened {
            true => Ok(()),
            false => Err(Refused::Guarded {
                host: host.to_owned(),
                addr,
                why,
            }),
        }
    }

    /// `url`'s host checked where it is a literal address (the resolver never sees those).
    pub fn check_literal(&self, url: &Url) -> Result<(), Refused> {
        let addr = match url.host() {
            Some(url::Host::Ipv4(a)) => IpAddr::V4(a),
            Some(url::Host::Ipv6(a)) => IpAddr::V6(a),
            _ => return Ok(()),
        };
        self.check_addr(url.host_str().unwrap_or(""), addr)
    }
}

/// The client's resolver: the system's, and every address it gives checked by [`Guard`]; a
/// name with any refused address is refused whole.
#[derive(Debug, Clone)]
pub struct Resolver(pub Arc<Guard>);

impl reqwest::dns::Resolve for Resolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let guard = self.0.clone();
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if addrs.is_empty() {
                return Err(Box::new(Refused::NoAddress { host }) as _);
            }
            for a in &addrs {
                guard
                    .check_addr(&host, a.ip())
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?;
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Redirects to the same host and port only, at most [`MAX_REDIRECTS`].
pub fn redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        if attempt.previous().len() > MAX_REDIRECTS {
            return attempt.error(Refused::TooManyRedirects);
        }
        let same = attempt.previous().last().is_some_and(|from| {
            from.host_str() == attempt.url().host_str()
                && from.port_or_known_default() == attempt.url().port_or_known_default()
        });
        if same {
            attempt.follow()
        } else {
            let from = attempt
                .previous()
                .last()
                .map(ToString::to_string)
                .unwrap_or_default();
            let to = attempt.url().to_string();
            attempt.error(Refused::CrossHost { from, to })
        }
    })
}

/// The [`Refused`] behind a client's error, if the guard refused.
pub fn refusal(e: &(dyn std::error::Error + 'static)) -> Option<Refused> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if let Some(r) = c.downcast_ref::<Refused>() {
            return Some(r.clone());
        }
        cur = c.source();
    }
    None
}
