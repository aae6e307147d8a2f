//! The E2B-compatible gateway: code written for E2B's SDK runs on Airlock with only its
//! settings changed (`E2B_API_URL`, `E2B_SANDBOX_URL` or `E2B_DOMAIN`, and an API key). Off
//! unless `[e2b] listen` is set. One listener serves both of E2B's planes:
//! - the control plane (`control.rs`): E2B's REST API (`/sandboxes`, `/v2/sandboxes`, ...),
//!   authenticated by `X-API-Key`, which is a tenant's token (the one its gRPC calls use);
//! - the in-sandbox plane, which E2B calls envd: its Connect RPC services `process.Process`
//!   (`process.rs`) and `filesystem.Filesystem` (`filesystem.rs`), and `/files` and `/health`
//!   over plain HTTP (`files.rs`). A request names its sandbox by its host
//!   (`<port>-<sandbox id>.<domain>`), by `E2b-Sandbox-Id`, or by its access token alone (the
//!   SDK sends only the token after some reconnects), and is authorised by the sandbox's access
//!   token: an HMAC of the sandbox id under a key kept in the data directory, given to the
//!   tenant by create and connect.
//!
//! Everything maps onto the daemon's own sandboxes, executions and files, so quotas, file and
//! network policies, the redaction of secrets and the audit trail apply as to gRPC calls.

// Handlers answer a refusal with the response itself (`Result<_, Response>`), once per request.
#![allow(clippy::result_large_err)]

mod code;
mod control;
mod files;
mod filesystem;
mod listen;
mod process;
mod templates;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hmac::Mac;
use serde::Deserialize;
use tracing::info;

use crate::auth::Tokens;
use crate::daemon::Daemon;
use crate::error::{ApiError, StartError};
use crate::sandbox::SandboxRt;

/// envd's interface, generated from `proto/e2b` at build time.
#[allow(missing_debug_implementations, clippy::all)]
pub mod pb {
    connectrpc::include_generated!();
}

/// The envd version the gateway reports: SDKs gate features on it (0.5.7: raw uploads, which
/// the 2.x SDKs use by default; 0.4.0: no user means the default user).
pub const ENVD_VERSION: &str = "0.5.7";

/// The port E2B's SDKs address envd on.
pub const ENVD_PORT: &str = "49983";

/// `[e2b]` in the daemon's settings.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct E2bConfig {
    /// `HOST:PORT` of the gateway's listener (HTTP/1.1 and HTTP/2; TLS with the daemon's
    /// `[tls]`); empty: off. Off loopback it needs `[tls]` or `allow_insecure_tcp`.
    pub listen: String,
    /// The domain sandbox hosts are named under (`49983-<sandbox id>.<domain>`), returned to
    /// SDKs as the sandbox's `domain`; empty: none (point `E2B_SANDBOX_URL` at the listener).
    pub domain: String,
    /// A sandbox's lifetime when a create names none (E2B's default: 300 s).
    pub default_timeout_s: u32,
    /// Paths the gateway's sandboxes may write and read through files calls (E2B's envd acts
    /// with the guest account's own permissions everywhere).
    pub file_paths: Vec<String>,
    /// The largest request body (bytes): a larger declared `Content-Length` is answered 413
    /// before the body is read. 0: the daemon's `max_file_bytes` and 1 MiB (for a multipart
    /// upload's framing).
    pub max_body_bytes: u64,
}

impl E2bConfig {
    /// The largest request body, `max_file_bytes` being the daemon's largest file.
    pub fn body_limit(&self, max_file_bytes: u64) -> u64 {
        match self.max_body_bytes {
            0 => max_file_bytes.saturating_add(1 << 20),
            n => n,
        }
    }
}

impl Default for E2bConfig {
    fn default() -> Self {
        Self {
            listen: String::new(),
            domain: String::new(),
            default_timeout_s: 300,
            file_paths: vec!["/".into()],
            max_body_bytes: 0,
        }
    }
}

/// The gateway's state, shared by its handlers.
#[derive(Debug)]
pub struct Gateway {
    pub daemon: Arc<Daemon>,
    /// `[e2b]`.
    pub cfg: E2bConfig,
    tokens: Arc<Tokens>,
    /// The key of sandboxes' access tokens (and of template file upload links).
    key: [u8; 32],
    /// Template builds and their uploaded files (`templates.rs`).
    pub templates: templates::Builds,
}

/// The sandbox an envd request is for, authorised (put in the request by [`envd_auth`]).
#[derive(Clone, Debug)]
pub struct Target {
    pub rt: Arc<SandboxRt>,
}

impl Target {
    pub fn tenant(&self) -> &str {
        &self.rt.tenant
    }
}

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// What a traffic token's HMAC covers before the sandbox id (no sandbox id or signed link
/// begins so).
const TRAFFIC: &str = "traffic\0";

impl Gateway {
    /// The gateway of `daemon`; the token key is made on first use (0600 in the data dir).
    pub fn new(
        daemon: Arc<Daemon>,
        cfg: E2bConfig,
        tokens: Arc<Tokens>,
    ) -> Result<Self, StartError> {
        let path = daemon.cfg.data_dir.join("e2b-token.key");
        let key = match std::fs::read(&path) {
            Ok(k) if k.len() == 32 => k,
            _ => {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                let mut k = vec![0u8; 32];
                airlock_proto::identity::random_bytes(&mut k)
                    .map_err(|e| StartError::Setting(format!("random key: {e}")))?;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&path)
                    .map_err(StartError::io(path.display().to_string()))?;
                f.write_all(&k)
                    .map_err(StartError::io(path.display().to_string()))?;
                k
            }
        };
        let mut fixed = [0u8; 32];
        fixed.copy_from_slice(&key);
        Ok(Self {
            daemon,
            cfg,
            tokens,
            key: fixed,
            templates: templates::Builds::default(),
        })
    }

    /// Sandbox `id`'s access token.
    pub fn access_token(&self, id: &str) -> String {
        access_token(&self.key, id)
    }

    fn token_matches(&self, id: &str, token: &str) -> bool {
        token_matches(&self.key, id, token)
    }

    /// Sandbox `id`'s traffic token (E2B's `trafficAccessToken`): what the code interpreter's
    /// SDK sends on port 49999 (`E2B-Traffic-Access-Token`), where its context calls send no
    /// access token. It opens the interpreter's routes only, never envd's.
    pub fn traffic_token(&self, id: &str) -> String {
        access_token(&self.key, &format!("{TRAFFIC}{id}"))
    }

    fn traffic_matches(&self, id: &str, token: &str) -> bool {
        token_matches(&self.key, &format!("{TRAFFIC}{id}"), token)
    }

    /// The tenant whose API key `headers` carry.
    pub fn tenant(&self, headers: &HeaderMap) -> Result<String, Response> {
        self.caller(headers).map(|(tenant, _)| tenant)
    }

    /// The tenant whose API key `headers` carry, and whether the key may make templates.
    pub fn caller(&self, headers: &HeaderMap) -> Result<(String, bool), Response> {
        let key = header_str(headers, "x-api-key")
            .or_else(|| {
                header_str(headers, "authorization").map(|a| a.strip_prefix("Bearer ").unwrap_or(a))
            })
            .map(str::trim)
            .filter(|k| !k.is_empty());
        match key.and_then(|k| self.tokens.caller_of(k)) {
            Some((t, right)) => Ok((t.to_owned(), right)),
            None => Err(json_error(
                StatusCode::UNAUTHORIZED,
                "an API key (X-API-Key) of an Airlock tenant is needed",
            )),
        }
    }

    /// The sandbox the request's host names, for envd's port.
    fn host_sandbox<'h>(&self, headers: &'h HeaderMap) -> Option<&'h str> {
        sandbox_of_host(header_str(headers, "host")?, &self.cfg.domain)
    }

    /// The live sandbox an envd request is for, authorised by its access token.
    fn envd_target(&self, headers: &HeaderMap) -> Result<Target, Response> {
        let token = header_str(headers, "x-access-token").map(str::trim);
        // The interpreter's port also takes the sandbox's traffic token.
        let traffic = header_str(headers, "e2b-traffic-access-token")
            .map(str::trim)
            .filter(|_| code::is_for_interpreter(headers, &self.cfg.domain));
        let named = self
            .host_sandbox(headers)
            .or_else(|| header_str(headers, "e2b-sandbox-id"))
            .map(str::to_owned);
        let id = match (named, token) {
            (Some(id), _) => id,
            // No name: the token alone (it names one sandbox: look it up among the live ones).
            (None, Some(t)) => self
                .daemon
                .sandboxes
                .all()
                .into_iter()
                .map(|rt| rt.id.clone())
                .find(|id| self.token_matches(id, t))
                .ok_or_else(|| {
                    json_error(
                        StatusCode::UNAUTHORIZED,
                        "no live sandbox has this access token",
                    )
                })?,
            (None, None) => {
                return Err(json_error(
                    StatusCode::BAD_REQUEST,
                    "which sandbox? (E2b-Sandbox-Id or the host <port>-<id>.<domain>)",
                ));
            }
        };
        let authorised = token.is_some_and(|t| self.token_matches(&id, t))
            || traffic.is_some_and(|t| self.traffic_matches(&id, t));
        if !authorised {
            return Err(json_error(
                StatusCode::UNAUTHORIZED,
                "the sandbox's access token (X-Access-Token) is missing or wrong",
            ));
        }
        let gone = || {
            json_error(
                StatusCode::BAD_GATEWAY,
                &format!("The sandbox {id} was not found"),
            )
        };
        let rt = self.daemon.sandboxes.by_id(&id).ok_or_else(gone)?;
        if rt.state() != airlock_api::v1::SandboxState::Running || rt.is_ending() {
            return Err(gone());
        }
        rt.touch();
        Ok(Target { rt })
    }
}

fn mac(key: &[u8], id: &str) -> HmacSha256 {
    // An HMAC takes a key of any length: this cannot fail.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    m.update(b"e2b-envd-access\0");
    m.update(id.as_bytes());
    m
}

impl Gateway {
    /// The HMAC (hex) of `what` under the gateway's key: a capability in a URL.
    pub fn sign(&self, what: &str) -> String {
        access_token(&self.key, what)
    }

    /// Whether `token` is [`sign`](Self::sign)'s of `what` (constant time).
    pub fn signed(&self, what: &str, token: &str) -> bool {
        token_matches(&self.key, what, token)
    }
}

/// Sandbox `id`'s access token under `key`: the hex of an HMAC-SHA256 of its id.
fn access_token(key: &[u8], id: &str) -> String {
    crate::audit::hex(&mac(key, id).finalize().into_bytes())
}

/// Whether `token` is sandbox `id`'s access token under `key` (compared in constant time).
fn token_matches(key: &[u8], id: &str, token: &str) -> bool {
    hex::decode(token).is_ok_and(|raw| mac(key, id).verify_slice(&raw).is_ok())
}

/// The guest port and sandbox a host name `<port>-<id>.<domain>[:PORT]` names (none without a
/// domain).
fn host_parts<'h>(host: &'h str, domain: &str) -> Option<(&'h str, &'h str)> {
    if domain.is_empty() {
        return None;
    }
    let host = match host.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => host,
    };
    let label = host.strip_suffix(domain)?.strip_suffix('.')?;
    let (port, id) = label.split_once('-')?;
    (!id.is_empty() && !id.contains('.')).then_some((port, id))
}

/// The sandbox a host name names, for envd's port or the code interpreter's.
fn sandbox_of_host<'h>(host: &'h str, domain: &str) -> Option<&'h str> {
    let (port, id) = host_parts(host, domain)?;
    (port == ENVD_PORT || port == code::PORT).then_some(id)
}

/// The guest port a host name names.
fn port_of_host<'h>(host: &'h str, domain: &str) -> Option<&'h str> {
    host_parts(host, domain).map(|(port, _)| port)
}

/// A header's value as text.
pub fn header_str<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// An error in E2B's JSON shape (`{"code": STATUS, "message": ...}`); never retried by the
/// SDKs (`Should-Retry: false`: a create the SDK repeated could make a second sandbox).
pub fn json_error(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({"code": status.as_u16(), "message": message});
    let mut r = (status, axum::Json(body)).into_response();
    r.headers_mut()
        .insert("should-retry", HeaderValue::from_static("false"));
    r
}

/// The HTTP status of a daemon error, for the REST and file endpoints.
pub fn http_status(e: &ApiError) -> StatusCode {
    use tonic::Code;
    match e {
        ApiError::FileTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        ApiError::DiskQuota { .. } => StatusCode::INSUFFICIENT_STORAGE,
        ApiError::SandboxNotRunning { .. } => StatusCode::CONFLICT,
        _ => match e.code() {
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted | Code::FailedPrecondition => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable => StatusCode::BAD_GATEWAY,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
    }
}

/// A daemon error as an E2B error, its message redacted of the tenant's secrets, a denial
/// audited.
pub fn api_error(tenant: &str, sandbox: &str, call: &str, e: &ApiError) -> Response {
    crate::audit::denial(tenant, sandbox, call, e);
    let message = crate::secrets::logs::redact(Some(tenant), &e.to_string());
    tracing::info!(
        call,
        tenant,
        reason = e.reason(),
        "e2b call failed: {message}"
    );
    json_error(http_status(e), &message)
}

/// Resolves and authorises the sandbox of an envd request.
async fn envd_auth(State(gw): State<Arc<Gateway>>, mut req: Request, next: Next) -> Response {
    match gw.envd_target(req.headers()) {
        Ok(t) => {
            req.extensions_mut().insert(t);
            next.run(req).await
        }
        Err(r) => r,
    }
}

/// The gateway's routes: the control plane by path, envd's for the rest.
pub fn router(gw: Arc<Gateway>) -> Router {
    let connect = connectrpc::Router::new()
        .add_service(Arc::new(process::ProcessService::new(gw.clone())))
        .add_service(Arc::new(filesystem::FilesystemService::new(gw.clone())));
    // The code interpreter's port (49999) is served by its own routes, authorised as envd's.
    let code = code::routes().with_state(gw.clone());
    let domain = gw.cfg.domain.clone();
    let to_code = move |req: Request, next: Next| {
        let (code, domain) = (code.clone(), domain.clone());
        async move {
            if code::is_for_interpreter(req.headers(), &domain) {
                use tower::ServiceExt as _;
                return match code.oneshot(req).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                };
            }
            next.run(req).await
        }
    };
    let envd = files::routes()
        .fallback_service(connect.into_axum_service())
        .layer(axum::middleware::from_fn(to_code))
        .layer(axum::middleware::from_fn_with_state(gw.clone(), envd_auth))
        .with_state(gw.clone());
    let max_body = gw.cfg.body_limit(gw.daemon.cfg.max_file_bytes);
    let app = control::routes()
        .merge(templates::routes())
        .with_state(gw)
        .fallback_service(envd)
        .layer(axum::extract::DefaultBodyLimit::disable());
    listen::limit_bodies(app, max_body)
}

/// Serves the gateway on `listener` (TLS with the daemon's `[tls]`) until it fails, within
/// the daemon's limits on TCP connections ([`listen`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    daemon: Arc<Daemon>,
    cfg: E2bConfig,
    tokens: Arc<Tokens>,
) -> Result<(), StartError> {
    let tls = match &daemon.cfg.tls {
        Some(t) => Some(crate::tcp::tls::acceptor(t, &[b"h2", b"http/1.1"], false)?),
        None => None,
    };
    let gw = Arc::new(Gateway::new(daemon.clone(), cfg, tokens)?);
    let app = router(gw);
    let local = listener
        .local_addr()
        .map_err(StartError::io("[e2b] listen"))?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    info!("E2B gateway on {scheme}://{local}");
    let limits = crate::tcp::limit::ConnLimits::of(&daemon.cfg);
    let header = std::time::Duration::from_millis(daemon.cfg.header_read_timeout_ms.max(1));
    listen::serve_on(listener, app, limits, tls, header).await
}

/// `Content-Type: application/json` responses of a value.
pub fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response {
    let mut r = (status, axum::Json(v)).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_tokens_name_one_sandbox_under_one_key() {
        let (k1, k2) = ([1u8; 32], [2u8; 32]);
        let t = access_token(&k1, "sb-0123456789abcdef");
        assert_eq!(t.len(), 64);
        assert!(token_matches(&k1, "sb-0123456789abcdef", &t));
        assert!(token_matches(&k1, "sb-0123456789abcdef", &t.to_uppercase()));
        assert!(!token_matches(&k1, "sb-0123456789abcdee", &t));
        assert!(!token_matches(&k2, "sb-0123456789abcdef", &t));
        for bad in ["", "0", "zz", &t[..62], &format!("{t}00")] {
            assert!(!token_matches(&k1, "sb-0123456789abcdef", bad), "{bad:?}");
        }
    }

    #[test]
    fn hosts_name_sandboxes_on_envds_and_the_interpreters_ports_only() {
        let d = "e2b.test";
        assert_eq!(sandbox_of_host("49983-sb-1.e2b.test", d), Some("sb-1"));
        assert_eq!(sandbox_of_host("49983-sb-1.e2b.test:3000", d), Some("sb-1"));
        assert_eq!(sandbox_of_host("8080-sb-1.e2b.test", d), None);
        assert_eq!(sandbox_of_host("49999-sb-1.e2b.test", d), Some("sb-1"));
        assert_eq!(port_of_host("49999-sb-1.e2b.test:443", d), Some("49999"));
        assert_eq!(sandbox_of_host("49983-sb-1.other.test", d), None);
        assert_eq!(sandbox_of_host("49983-.e2b.test", d), None);
        assert_eq!(sandbox_of_host("49983-a.b.e2b.test", d), None);
        assert_eq!(sandbox_of_host("e2b.test", d), None);
        assert_eq!(sandbox_of_host("49983-sb-1.e2b.test", ""), None);
    }

    #[test]
    fn daemon_errors_keep_their_meaning_as_http_statuses() {
        let cases = [
            (ApiError::SandboxNotFound("x".into()), 404),
            (ApiError::InvalidArgument("x".into()), 400),
            (ApiError::Unauthenticated("x".into()), 401),
            (ApiError::FileNotFound { path: "/x".into() }, 404),
            (ApiError::FileTooLarge { size: 2, limit: 1 }, 413),
            (ApiError::Internal("x".into()), 500),
        ];
        for (e, status) in cases {
            assert_eq!(http_status(&e).as_u16(), status, "{e}");
        }
    }
}
