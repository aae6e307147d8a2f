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
use bytes::{BufMut as _, Bytes, BytesMut};
use http_body_util::BodyExt as _;
use prost::Message;
use tonic::Status;
use tonic::body::Body;
use tower::{Layer, Service, ServiceExt as _};
use tracing::warn;

use super::members::{Cluster, Target};
use super::templates::PATH as TEMPLATE_PATH;
use crate::auth::Auth;
use crate::error::ApiError;
use crate::rpc::{self, Routing};

/// The service's path prefix.
const API: &str = "/airlock.v1.Airlock/";
/// The largest first message read to route a call (a CreateSandbox with its files is the
/// largest; the daemon's own cap on a message applies after).
const MAX_FIRST_MESSAGE: usize = 64 << 20;
/// How long a gathering call waits for one node.
const GATHER_TIMEOUT: Duration = Duration::from_secs(15);

/// Field 1 as a string (every sandbox and execution request has its id there).
#[derive(Clone, PartialEq, Message)]
struct IdField {
    #[prost(string, tag = "1")]
    id: String,
}

/// WriteFile's first message: its header (field 1) has the sandbox id in field 1.
#[derive(Clone, PartialEq, Message)]
struct WriteFileHead {
    #[prost(message, optional, tag = "1")]
    header: Option<IdField>,
}

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
                let (req, first) = peek_first(req).await?;
                let id = match r {
                    Routing::ByWriteFileHeader => WriteFileHead::decode(first)
                        .ok()
                        .and_then(|h| h.header)
                        .map(|h| h.id),
                    _ => IdField::decode(first).ok().map(|f| f.id),
                }
                .unwrap_or_default();
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
        let bytes = collect(body, MAX_FIRST_MESSAGE).await?;
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
        req: http::Request<Body>,
        tenant: &str,
    ) -> Result<Vec<M>, Status> {
        let (parts, body) = req.into_parts();
        let bytes = collect(body, MAX_FIRST_MESSAGE).await?;
        let mut out = Vec::new();
        for target in self.cluster.everyone() {
            let call = self.send(&target, tenant, rebuild(&parts, bytes.clone()));
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
        let bytes = collect(body, MAX_FIRST_MESSAGE).await?;
        let request = first_message(&bytes)
            .and_then(|m| ListSandboxesRequest::decode(m).ok())
            .unwrap_or_default();
        let answers: Vec<ListSandboxesResponse> =
            self.gather(rebuild(&parts, bytes), tenant).await?;
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
        let answers: Vec<ListTemplatesResponse> = self.gather(req, tenant).await?;
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
        let bytes = collect(body, MAX_FIRST_MESSAGE).await?;
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

/// Reads `body` whole (at most `limit` bytes).
async fn collect(body: Body, limit: usize) -> Result<Bytes, Status> {
    http_body_util::Limited::new(body, limit)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| Status::invalid_argument(format!("reading the request: {e}")))
}

/// The request again from its parts and body bytes.
fn rebuild(parts: &http::request::Parts, body: Bytes) -> http::Request<Body> {
    let mut req = http::Request::new(Body::new(http_body_util::Full::new(body)));
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    *req.headers_mut() = parts.headers.clone();
    req
}

/// The first gRPC message in `bytes` (uncompressed; `None` otherwise or incomplete).
fn first_message(bytes: &[u8]) -> Option<&[u8]> {
    if bytes.len() < 5 || bytes[0] != 0 {
        return None;
    }
    let len = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
    bytes.get(5..5 + len)
}

/// Reads `req`'s body until its first message is complete; answers the request with the body
/// whole again, and that message.
async fn peek_first(req: http::Request<Body>) -> Result<(http::Request<Body>, Bytes), Status> {
    let (parts, mut body) = req.into_parts();
    let mut buf = BytesMut::new();
    let mut ended = false;
    loop {
        if let Some(len) =
            (buf.len() >= 5).then(|| u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize)
        {
            if len > MAX_FIRST_MESSAGE {
                return Err(Status::resource_exhausted("the first message is too large"));
            }
            if buf.len() >= 5 + len || ended {
                break;
            }
        } else if ended {
            break;
        }
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    buf.put(data);
                }
            }
            Some(Err(e)) => return Err(Status::invalid_argument(format!("the request: {e}"))),
            None => ended = true,
        }
    }
    let first = Bytes::copy_from_slice(first_message(&buf).unwrap_or_default());
    let head = buf.freeze();
    let rest = body.into_data_stream();
    let stream = futures_util::stream::once(async move { Ok::<_, Status>(head) }).chain(
        futures_util::StreamExt::map(rest, |r| r.map_err(|e| Status::internal(e.to_string()))),
    );
    let stream = futures_util::StreamExt::map(stream, |r| r.map(http_body::Frame::data));
    let req = http::Request::from_parts(parts, Body::new(http_body_util::StreamBody::new(stream)));
    Ok((req, first))
}

use futures_util::StreamExt as _;

/// Whether a create's response sends it to the next node: CAPACITY_EXHAUSTED or
/// TEMPLATE_NOT_FOUND (a trailers-only answer).
fn moves_on(headers: &http::HeaderMap) -> bool {
    use tonic_types::StatusExt as _;
    Status::from_header_map(headers).is_some_and(|s| {
        s.get_details_error_info()
            .is_some_and(|i| i.reason == "CAPACITY_EXHAUSTED" || i.reason == "TEMPLATE_NOT_FOUND")
    })
}

/// The message of a unary gRPC answer, or its error.
async fn unary_answer<M: Message + Default>(resp: Response) -> Result<M, Status> {
    if let Some(s) = Status::from_header_map(resp.headers())
        && s.code() != tonic::Code::Ok
    {
        return Err(s);
    }
    let collected = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| Status::unavailable(format!("a node's answer: {e}")))?;
    if let Some(trailers) = collected.trailers()
        && let Some(s) = Status::from_header_map(trailers)
        && s.code() != tonic::Code::Ok
    {
        return Err(s);
    }
    let bytes = collected.to_bytes();
    let msg = first_message(&bytes)
        .ok_or_else(|| Status::internal("a node's answer is no gRPC message"))?;
    M::decode(msg).map_err(|e| Status::internal(format!("a node's answer: {e}")))
}

/// A successful unary gRPC answer carrying `m`.
fn grpc_ok<M: Message>(m: &M) -> Response {
    let msg = m.encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + msg.len());
    frame.put_u8(0);
    frame.put_u32(u32::try_from(msg.len()).unwrap_or(u32::MAX));
    frame.put_slice(&msg);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let frames = futures_util::stream::iter([
        Ok::<_, Infallible>(http_body::Frame::data(frame.freeze())),
        Ok(http_body::Frame::trailers(trailers)),
    ]);
    let mut resp = http::Response::new(Body::new(http_body_util::StreamBody::new(frames)));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    resp
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn framed(m: &impl Message) -> Bytes {
        let msg = m.encode_to_vec();
        let mut b = BytesMut::new();
        b.put_u8(0);
        b.put_u32(msg.len() as u32);
        b.put_slice(&msg);
        b.freeze()
    }

    #[test]
    fn every_call_on_a_sandbox_or_an_execution_names_it_in_field_1() {
        use airlock_api::v1::*;
        let id = "sb-beef000000000001".to_owned();
        let requests: Vec<(&str, Bytes)> = vec![
            (
                "GetSandbox",
                framed(&GetSandboxRequest {
                    sandbox_id: id.clone(),
                }),
            ),
            (
                "Exec",
                framed(&ExecRequest {
                    sandbox_id: id.clone(),
                    ..Default::default()
                }),
            ),
            (
                "ReadFile",
                framed(&ReadFileRequest {
                    sandbox_id: id.clone(),
                    ..Default::default()
                }),
            ),
            (
                "ExposePort",
                framed(&ExposePortRequest {
                    sandbox_id: id.clone(),
                    ..Default::default()
                }),
            ),
            (
                "StreamExecution",
                framed(&StreamExecutionRequest {
                    execution_id: id.clone(),
                    ..Default::default()
                }),
            ),
            (
                "WriteStdin",
                framed(&WriteStdinRequest {
                    execution_id: id.clone(),
                    ..Default::default()
                }),
            ),
        ];
        for (method, bytes) in requests {
            assert_ne!(
                rpc::by_name(method).unwrap().routing,
                Routing::Local,
                "{method}"
            );
            let got = IdField::decode(first_message(&bytes).unwrap()).unwrap();
            assert_eq!(got.id, id, "{method}");
        }
        let wf = WriteFileRequest {
            part: Some(write_file_request::Part::Header(WriteFileHeader {
                sandbox_id: id.clone(),
                path: "/tmp/x".into(),
                ..Default::default()
            })),
        };
        let head = WriteFileHead::decode(first_message(&framed(&wf)).unwrap()).unwrap();
        assert_eq!(head.header.unwrap().id, id);
        assert_eq!(
            rpc::by_name("CreateTemplate").unwrap().routing,
            Routing::Local
        );
    }

    #[test]
    fn a_frame_that_is_compressed_short_or_cut_is_not_decoded() {
        assert!(first_message(&[1, 0, 0, 0, 0]).is_none());
        assert!(first_message(&[0, 0, 0]).is_none());
        assert!(first_message(&[0, 0, 0, 0, 9, 1, 2]).is_none());
        assert_eq!(first_message(&[0, 0, 0, 0, 1, 7]), Some(&[7u8][..]));
    }

    #[tokio::test]
    async fn a_peeked_request_keeps_its_whole_body() {
        let msg = airlock_api::v1::GetSandboxRequest {
            sandbox_id: "sb-beef000000000001".into(),
        };
        let mut body = framed(&msg).to_vec();
        body.extend_from_slice(b"more");
        let req = http::Request::new(Body::new(http_body_util::Full::new(Bytes::from(
            body.clone(),
        ))));
        let (req, first) = peek_first(req).await.unwrap();
        assert_eq!(IdField::decode(first).unwrap().id, msg.sandbox_id);
        let all = req.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(all.to_vec(), body);
    }

    #[tokio::test]
    async fn an_answer_made_here_decodes_as_a_grpc_answer() {
        let r = grpc_ok(&DestroySandboxResponse { destroyed: true });
        let back: DestroySandboxResponse = unary_answer(r).await.unwrap();
        assert!(back.destroyed);
        let err: Status = ApiError::Capacity {
            what: "sandboxes",
            limit: 1,
            current: 1,
        }
        .into();
        assert!(moves_on(err.into_http::<Body>().headers()));
        let quota: Status = ApiError::Quota {
            tenant: "t".into(),
            what: "sandboxes",
            limit: 1,
            current: 1,
        }
        .into();
        assert!(!moves_on(quota.into_http::<Body>().headers()));
    }
}
