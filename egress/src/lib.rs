//! What a sandbox may reach over its network, decided before a packet leaves its namespace:
//! the egress policy ([`policy`]) and the parsers that read the name a connection states
//! ([`sniff`]: TLS SNI, HTTP `Host`), each on bounded input; and the host's own addresses
//! ([`host`]), which no policy opens but a CIDR rule of exactly one.

pub mod dns;
pub mod host;
pub mod policy;
pub mod sniff;

pub use ipnet::IpNet;
pub use policy::{Allowance, Attempt, Denial, DomainPattern, Policy, PolicyError, Rule};
