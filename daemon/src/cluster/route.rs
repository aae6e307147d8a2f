//! The routing layer in front of a listener's gRPC service (cluster mode): a call on a sandbox
//! or an execution goes to the node its id names; CreateSandbox is placed; ListSandboxes and
//! ListTemplates are gathered from every node; DeleteTemplate goes to every node; the rest is
//! served here. A call forwarded by another node (the cluster token) is always served here, so
//! nothing is forwarded twice. The caller is authenticated here first (its tenant travels with
//! a forwarded call); bodies stay gRPC frames, decoded only as far as routing needs.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use airlock_api::v1::{
    DestroySandboxResponse, ListSandboxesRequest, ListSandboxesResponse, ListTemplatesResponse,
    SandboxState,
};
use bytes::Bytes;
use prost::Message;
use tonic::Status;
use tonic::body::Body;
use tower::{Layer, Service, ServiceExt as _};
use tracing::warn;

use super::frames::{
    MAX_REQUEST, MAX_SMALL_REQUEST, collect, first_message, grpc_ok, moves_on, peek_id, rebuild,
    unary_answer,
};
use super::members::{Cluster, Target};
use super::templates::PATH as TEMPLATE_PATH;
use crate::auth::Auth;
use crate::error::ApiError;
use crate::rpc::{self, Routing};

/// The service's path prefix.
const API: &str = "/airlock.v1.Airlock/";
/// How long a gathering call waits for one node.
const GATHER_TIMEOUT: Duration = Duration::from_secs(15);

/// The layer, per listener (its authentication).
#[derive(Clone, Debug)]
pub struct RouteLayer {
    pub cluster: Arc<Cluster>,
    pub auth: Auth,
}

impl<S> Layer<S> for RouteLayer {
    type Service = Route<S>;

    fn layer(&self, inner: S) -> Route<S> {
        Route {
            inner,
            cluster: self.cluster.clone(),
            auth: self.auth.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Route<S> {
    inner: S,
    cluster: Arc<Cluster>,
    auth: Auth,
}

type Response = http::Response<Body>;

impl<S> Service<http::Request<Body>> for Route<S>
where
    S: Service<http::Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The clone that was made ready serves this call.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let call = Call {
            inner: std::sync::Mutex::new(inner),
            cluster: self.cluster.clone(),
            auth: self.auth.clone(),
        };
        Box::pin(async move {
            Ok(call
                .route(req)
                .await
                .unwrap_or_else(|status| status.into_http()))
        })
    }
}

/// One call being routed (the inner service behind a mutex: the call's future is `Send`
/// without the service being `Sync`).
struct Call<S> {
    inner: std::sync::Mutex<S>,
    cluster: Arc<Cluster>,
    auth: Auth,
}

fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or_default().trim())
}

impl<S> Call<S>
where
    S: Service<http::Request<Body>, Response = Response, Error = Infallible> + Clone + Send,
    S::Future: Send,
{
    async fn route(self, req: http::Request<Body>) -> Result<Response, Status> {
        let path = req.uri().path().to_owned();
        if let Some(rest) = path.strip_prefix(TEMPLATE_PATH) {
            if !self.auth.is_cluster_token(bearer(req.headers())) {
                let mut r = http::Response::new(Body::empty());
                *r.status_mut() = http::StatusCode::UNAUTHORIZED;
                return Ok(r);
            }
            return Ok(self.cluster.serve_template(rest));
        }
        let Some(method) = path.strip_prefix(API) else {
            return self.local(req).await; // reflection
        };
        let caller = self.auth.caller(
            bearer(req.headers()),
            req.headers()
                .get(super::FORWARDED_TENANT)
                .and_then(|v| v.to_str().ok()),
        )?;
        if caller.forwarded {
            return self.local(req).await;
        }
        let tenant = caller.tenant;
        // A method the service lacks is answered there (UNIMPLEMENTED).
        let routing = rpc::by_name(method).map_or(Routing::Local, |r| r.routing);
        match routing {
            Routing::Local => self.local(req).await,
            r @ (Routing::BySandbox | Routing::ByExecution | Routing::ByWriteFileHeader) => {
                let (req, id) = peek_id(req, r == Routing::ByWriteFileHeader).await?;
                self.by_id(req, method, &id, &tenant).await
            }
            Routing::Place => self.create(req, &tenant).await,
            Routing::Gather if method == rpc::LIST_SANDBOXES.name => {
                self.list_sandboxes(req, &tenant).await
            }
            Routing::Gather if method == rpc::LIST_TEMPLATES.name => {
                self.list_templates(req, &tenant).await
            }
            Routing::EveryHolder if method == rpc::DELETE_TEMPLATE.name => {
                self.delete_template(req, &tenant).await
            }
            Routing::Gather | Routing::EveryHolder => Err(Status::unimplemented(format!(
                "{method}: the cluster's router does not merge its answers"
            ))),
        }
    }

    async fn local(&self, req: http::Request<Body>) -> Result<Response, Status> {
        let svc = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Ok(resp) = svc.oneshot(req).await;
        Ok(resp)
    }

    /// Sends `req` to `target`: served here, or forwarded as `tenant`'s.
    async fn send(
        &self,
        target: &Target,
        tenant: &str,
        req: http::Request<Body>,
    ) -> Result<Response, Status> {
        match target {
            Target::Remote { address, .. } => {
                self.cluster.peers.forward(address, tenant, req).await
            }
            _ => self.local(req).await,
        }
    }

    /// A call on the sandbox or execution `id`.
    async fn by_id(
        &self,
        req: http::Request<Body>,
        method: &str,
        id: &str,
        tenant: &str,
    ) -> Result<Response, Status> {
        match self.cluster.target_of(id) {
            Target::Lost(node) => self.lost(method, id, &node, tenant).await,
            // An id no node claimed is answered here (not found, or malformed).
            target => self.send(&target, tenant, req).await,
        }
    }

    /// A call on a sandbox or execution whose node left.
    async fn lost(
        &self,
        method: &str,
        id: &str,
        node: &str,
        tenant: &str,
    ) -> Result<Response, Status> {
        let lost = || -> Status {
            ApiError::NodeLost {
                id: id.to_owned(),
                node: node.to_owned(),
            }
            .into()
        };
        if crate::ids::Kind::Execution.names(id) {
            return Err(lost());
        }
        let record = self
            .cluster
            .ledger
            .lost(id, node)
            .await?
            .filter(|s| s.tenant == tenant);
        let Some(record) = record else {
            return Err(ApiError::SandboxNotFound(id.to_owned()).into());
        };
        match method {
            m if m == rpc::GET_SANDBOX.name => Ok(grpc_ok(&record)),
            m if m == rpc::DESTROY_SANDBOX.name => {
                Ok(grpc_ok(&DestroySandboxResponse { destroyed: false }))
            }
            _ => Err(lost()),
        }
    }

    /// CreateSandbox: tried on each candidate node in turn while they answer
    /// CAPACITY_EXHAUSTED or TEMPLATE_NOT_FOUND (the template is fetched by a node that lacks
    /// it; a node without any source for it answers TEMPLATE_NOT_FOUND).
    async fn create(&self, req: http::Request<Body>, tenant: &str) -> Result<Response, Status> {
        let (parts, body) = req.into_parts();
        // Held while it is tried on one node after another.
        let (bytes, _held) = collect(body, MAX_REQUEST, &self.cluster.buffers).await?;
        let request = first_message(&bytes)
            .and_then(|m| airlock_api::v1::CreateSandboxRequest::decode(m).ok())
            .unwrap_or_default();
        let template = if request.template.is_empty() {
            "base"
        } else {
            &request.template
        };
        let owner = self.cluster.daemon.templates.owner_for(tenant);
        let candidates = self.cluster.placement(&owner, template);
        if candidates.is_empty() {
            // No node has room: answered here (its admission says why).
            return self.local(rebuild(&parts, bytes)).await;
        }
        let mut last = None;
        for target in candidates {
            let resp = self
                .send(&target, tenant, rebuild(&parts, bytes.clone()))
                .await;
            let resp = match resp {
                Ok(r) => r,
                Err(e) => {
                    warn!(?target, "create on a node: {e}");
                    last = Some(Err(e));
                    continue;
                }
            };
            if let Target::Remote { name, .. } = &target {
                self.cluster.placed_on(name);
            } else {
                self.cluster.placed_on(&self.cluster.name);
            }
            // Full, or without the template yet (its holder still hashes it): the next node.
            if !moves_on(resp.headers()) {
                return Ok(resp);
            }
            last = Some(Ok(resp));
        }
        last.unwrap_or_else(|| Err(Status::unavailable("no node answered")))
    }

    /// Sends the call to every node; answers the decoded responses (a node's failure fails
    /// the call: a partial list would look complete).
    async fn gather<M: Message + Default>(
        &self,
        parts: &http::request::Parts,
        bytes: &Bytes,
        tenant: &str,
    ) -> Result<Vec<M>, Status> {
        let mut out = Vec::new();
        for target in self.cluster.everyone() {
            let call = self.send(&target, tenant, rebuild(parts, bytes.clone()));
            let resp = tokio::time::timeout(GATHER_TIMEOUT, call)
                .await
                .map_err(|_| Status::unavailable(format!("{target:?} did not answer")))??;
            out.push(unary_answer::<M>(resp).await?);
        }
        Ok(out)
    }

    async fn list_sandboxes(
        &self,
        req: http::Request<Body>,
        tenant: &str,
    ) -> Result<Response, Status> {
        let (parts, body) = req.into_parts();
        let (bytes, _held) = collect(body, MAX_SMALL_REQUEST, &self.cluster.buffers).await?;
        let request = first_message(&bytes)
            .and_then(|m| ListSandboxesRequest::decode(m).ok())
            .unwrap_or_default();
        let answers: Vec<ListSandboxesResponse> = self.gather(&parts, &bytes, tenant).await?;
        let mut seen = std::collections::HashSet::new();
        let mut sandboxes: Vec<_> = answers
            .into_iter()
            .flat_map(|a| a.sandboxes)
            .filter(|s| seen.insert(s.id.clone()))
            .collect();
        let dead = SandboxState::Dead as i32;
        if request.states.contains(&dead) {
            let lost = self.cluster.ledger.lost_of(tenant).await?;
            sandboxes.extend(lost.into_iter().filter(|s| {
                !seen.contains(&s.id)
                    && request
                        .labels
                        .iter()
                        .all(|(k, v)| s.labels.get(k) == Some(v))
            }));
        }
        sandboxes.sort_by_key(|s| (s.created_unix_ms, s.id.clone()));
        Ok(grpc_ok(&ListSandboxesResponse { sandboxes }))
    }

    async fn list_templates(
        &self,
        req: http::Request<Body>,
        tenant: &str,
    ) -> Result<Response, Status> {
        let (parts, body) = req.into_parts();
        let (bytes, _held) = collect(body, MAX_SMALL_REQUEST, &self.cluster.buffers).await?;
        let answers: Vec<ListTemplatesResponse> = self.gather(&parts, &bytes, tenant).await?;
        let mut by_name = HashMap::new();
        for t in answers.into_iter().flat_map(|a| a.templates) {
            by_name
                .entry((t.tenant.clone(), t.name.clone()))
                .or_insert(t);
        }
        let mut templates: Vec<_> = by_name.into_values().collect();
        templates.sort_by(|a, b| (&a.tenant, &a.name).cmp(&(&b.tenant, &b.name)));
        Ok(grpc_ok(&ListTemplatesResponse { templates }))
    }

    /// DeleteTemplate on every node that holds it: done when one did; TEMPLATE_NOT_FOUND
    /// when none held it.
    async fn delete_template(
        &self,
        req: http::Request<Body>,
        tenant: &str,
    ) -> Result<Response, Status> {
        let (parts, body) = req.into_parts();
        let (bytes, _held) = collect(body, MAX_SMALL_REQUEST, &self.cluster.buffers).await?;
        let mut first_error = None;
        let mut deleted = None;
        for target in self.cluster.everyone() {
            let resp = self
                .send(&target, tenant, rebuild(&parts, bytes.clone()))
                .await?;
            match Status::from_header_map(resp.headers()) {
                Some(s) if s.code() != tonic::Code::Ok => {
                    first_error.get_or_insert(s);
                }
                _ => deleted = Some(resp),
            }
        }
        match (deleted, first_error) {
            (Some(r), _) => Ok(r),
            (None, Some(e)) => Err(e),
            (None, None) => Err(Status::internal("no node answered")),
        }
    }
}
