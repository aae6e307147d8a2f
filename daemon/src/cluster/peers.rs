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

use super::{ClusterConfig, ClusterError, FORWARDED_TENANT};

/// How long a node-to-node connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// The other nodes' channels.
pub struct Peers {
    channels: Mutex<HashMap<String, Channel>>,
    tls: Option<ClientTlsConfig>,
    token: HeaderValue,
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
        })
    }

    /// The channel to the node at `address`.
    fn channel(&self, address: &str) -> Result<Channel, tonic::Status> {
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = channels.get(address) {
            return Ok(c.clone());
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
