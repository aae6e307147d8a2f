//! What a sandbox may reach over its network, decided before a packet leaves its namespace:
//! the egress policy ([`policy`]) and the parsers that read the name a connection states
//! ([`sniff`]: TLS SNI, HTTP `Host`), each on bounded input.

pub mod dns;
pub mod policy;
pub mod sniff;

pub use ipnet::IpNet;
pub use policy::{Allowance, Attempt, Denial, DomainPattern, Policy, PolicyError, Rule};
