//! What the TCP listeners (gRPC in `server`, the E2B gateway in `e2b`) share: their limits on
//! connections and handshakes ([`limit`]) and their TLS ([`tls`]).

pub mod limit;
pub mod tls;
