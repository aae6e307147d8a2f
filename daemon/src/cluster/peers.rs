//! Calls to the other nodes: one HTTP/2 channel per node address, made on first use and kept;
//! a forwarded call carries the cluster token and the caller's tenant instead of the caller's
//! own credentials.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use http::HeaderValue;
use tonic::body::Body;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tower::ServiceExt as _;

use super::{ClusterConfig, ClusterError, FORWARDED_TENANT, is_loopback};

/// How long a node-to-node connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The other nodes' channels.
pub struct Peers {
    channels: Mutex<HashMap<String, Channel>>,
    tls: Option<ClientTlsConfig>,
    token: HeaderValue,
    /// `[cluster] allow_plaintext`: plain `http://` to nodes beyond loopback.
    allow_plaintext: bool,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers").finish_non_exhaustive()
    }
}

impl Peers {
    pub fn new(cfg: &ClusterConfig, token: String) -> Result<Self, ClusterError> {
        let tls = match &cfg.ca {
            Some(ca) => {
                let pem = std::fs::read(ca).map_err(|source| ClusterError::File {
                    what: ca.display().to_string(),
                    source,
                })?;
                Some(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))
            }
            None => None,
        };
        let mut token = HeaderValue::try_from(format!("Bearer {token}")).map_err(|_| {
            ClusterError::Setting("[cluster] token_file: not a valid header value".into())
        })?;
        token.set_sensitive(true);
        Ok(Self {
            channels: Mutex::default(),
            tls,
            token,
            allow_plaintext: cfg.allow_plaintext,
        })
    }

    /// The channel to the node at `address`.
    fn channel(&self, address: &str) -> Result<Channel, tonic::Status> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = channels.get(address) {
            return Ok(c.clone());
        }
        if address.starts_with("http://") && !self.allow_plaintext && !is_loopback(address) {
            return Err(tonic::Status::unavailable(format!(
                "node address {address}: the cluster token goes to another host only over \
                 https (or with [cluster] allow_plaintext)"
            )));
        }
        let bad = |e: tonic::transport::Error| {
            tonic::Status::internal(format!("node address {address}: {e}"))
        };
        let mut endpoint = Endpoint::from_shared(address.to_owned())
            .map_err(bad)?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10));
        if address.starts_with("https://") {
            let tls = self.tls.clone().ok_or_else(|| {
                tonic::Status::internal(format!(
                    "node address {address}: https needs [cluster] ca, the nodes' CA"
                ))
            })?;
            endpoint = endpoint.tls_config(tls).map_err(bad)?;
        }
        let channel = endpoint.connect_lazy();
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
    }

    /// Sends `req` to the node at `address` as `tenant`'s call (the cluster token instead of
    /// the caller's credentials).
    pub async fn forward(
        &self,
        address: &str,
        tenant: &str,
        mut req: http::Request<Body>,
    ) -> Result<http::Response<Body>, tonic::Status> {
        let headers = req.headers_mut();
        headers.insert(http::header::AUTHORIZATION, self.token.clone());
        let tenant = HeaderValue::try_from(tenant)
            .map_err(|_| tonic::Status::internal("a tenant name that is no header value"))?;
        headers.insert(FORWARDED_TENANT, tenant);
        self.send(address, req).await
    }

    /// Sends `req` to the node at `address` with the cluster token (node-to-node requests).
    pub async fn send(
        &self,
        address: &str,
        mut req: http::Request<Body>,
    ) -> Result<http::Response<Body>, tonic::Status> {
        req.headers_mut()
            .insert(http::header::AUTHORIZATION, self.token.clone());
        let channel = self.channel(address)?;
        channel
            .oneshot(req)
            .await
            .map_err(|e| tonic::Status::unavailable(format!("node {address}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Issue 37, item 3: the cluster token (and tenants' calls) cross the network only over
    /// TLS: plain `http://` to another node only on loopback, unless `allow_plaintext`.
    #[tokio::test]
    async fn the_cluster_token_goes_in_clear_only_to_loopback() {
        let token = "t".repeat(32);
        let peers = Peers::new(&ClusterConfig::default(), token.clone()).unwrap();
        for local in [
            "http://127.0.0.1:7443",
            "http://[::1]:7443",
            "http://localhost:7443",
        ] {
            assert!(peers.channel(local).is_ok(), "{local}");
        }
        for remote in [
            "http://10.0.0.5:7443",
            "http://node-b:7443",
            "http://[fd00::1]:7443",
        ] {
            let err = peers.channel(remote).unwrap_err();
            assert!(err.message().contains("allow_plaintext"), "{remote}: {err}");
        }
        let open = ClusterConfig {
            allow_plaintext: true,
            ..Default::default()
        };
        let peers = Peers::new(&open, token).unwrap();
        assert!(peers.channel("http://10.0.0.5:7443").is_ok());
    }
}
