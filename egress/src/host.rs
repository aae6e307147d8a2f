//! The host's own addresses: guarded like a range of their own, a single address wide (see
//! [`crate::Attempt::host`]). Read here once for every part of the daemon that connects on a
//! sandbox's behalf (the egress proxy, the package proxy).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

/// The host's own addresses (of its interfaces, in the daemon's namespace), read again at
/// most once every [`HostAddrs::REFRESH`], so that an address added later is guarded too.
#[derive(Debug, Default)]
pub struct HostAddrs {
    read: Mutex<Option<(Instant, Arc<HashSet<IpAddr>>)>>,
}

impl HostAddrs {
    const REFRESH: Duration = Duration::from_secs(1);

    /// Whether `addr` (IPv4-mapped IPv6 judged as IPv4) is one of the host's addresses.
    pub fn contains(&self, addr: IpAddr) -> bool {
        let addr = match addr {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
            v4 => v4,
        };
        self.current().contains(&addr)
    }

    fn current(&self) -> Arc<HashSet<IpAddr>> {
        let mut read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, addrs)) = read.as_ref()
            && at.elapsed() < Self::REFRESH
        {
            return addrs.clone();
        }
        let addrs = match if_addrs::get_if_addrs() {
            Ok(ifs) => Arc::new(ifs.iter().map(if_addrs::Interface::ip).collect()),
            Err(e) => {
                // Keep what was read before: an error must not open the host's addresses.
                warn!("reading the host's addresses: {e}");
                read.as_ref().map(|(_, a)| a.clone()).unwrap_or_default()
            }
        };
        *read = Some((Instant::now(), addrs.clone()));
        addrs
    }
}
