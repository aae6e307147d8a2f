//! E2B's control plane (REST, `X-API-Key`) over the daemon's sandboxes: create (`POST
//! /sandboxes`, `/v2/sandboxes`), get, list (`GET /v2/sandboxes`, `/sandboxes`: metadata and
//! state filters, paging by `nextToken` and `X-Next-Token`), kill, timeout, pause, resume and
//! connect, metrics. An E2B template is the Airlock template of that name; metadata are labels;
//! a timeout is the sandbox's lifetime from now (its idle TTL too: E2B sandboxes do not end
//! for being idle).

use std::collections::HashMap;
use std::sync::Arc;

use airlock_api::v1::{
    CreateSandboxRequest, EgressRule, FilePolicy, NetworkPolicy, Sandbox, SandboxState, egress_rule,
};
use axum::Router;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ENVD_VERSION, Gateway, api_error, json, json_error};
use crate::error::ApiError;

type Gw = State<Arc<Gateway>>;

pub fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/metrics", get(metrics))
}

/// A create's body (E2B's `NewSandbox`; what is not here is ignored).
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u32>,
    metadata: Option<HashMap<String, String>>,
    env_vars: Option<HashMap<String, String>>,
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<NewNetwork>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct NewNetwork {
    allow_out: Vec<String>,
}

/// The tenant of a control-plane call, by its API key (a refusal is E2B's 401).
struct Caller(String);

impl FromRequestParts<Arc<Gateway>> for Caller {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, gw: &Arc<Gateway>) -> Result<Self, Response> {
        gw.tenant(&parts.headers).map(Caller)
    }
}

/// A JSON body (an empty one is the default); one that is not JSON is a 400 in E2B's shape,
/// not axum's text.
pub(super) struct JsonBody<T>(pub(super) T);

impl<T: serde::de::DeserializeOwned + Default, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Response> {
        let raw = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| json_error(StatusCode::BAD_REQUEST, &format!("request body: {e}")))?;
        if raw.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self(T::default()));
        }
        serde_json::from_slice(&raw)
            .map(Self)
            .map_err(|e| json_error(StatusCode::BAD_REQUEST, &format!("request body: {e}")))
    }
}

fn state_name(s: SandboxState) -> &'static str {
    match s {
        SandboxState::Paused => "paused",
        _ => "running",
    }
}

impl Gateway {
    fn domain(&self) -> Value {
        let d = &self.cfg.domain;
        if d.is_empty() { Value::Null } else { json!(d) }
    }

    /// E2B's `Sandbox` (create, connect).
    fn sandbox_json(&self, s: &Sandbox) -> Value {
        json!({
            "templateID": s.template,
            "sandboxID": s.id,
            "clientID": "airlock",
            "alias": s.template,
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.access_token(&s.id),
            "trafficAccessToken": self.traffic_token(&s.id),
            "domain": self.domain(),
        })
    }

    /// E2B's `SandboxDetail` / `ListedSandbox`.
    fn detail_json(&self, s: &Sandbox) -> Value {
        let end = s.created_unix_ms + i64::from(s.max_lifetime_s) * 1000;
        json!({
            "templateID": s.template,
            "sandboxID": s.id,
            "clientID": "airlock",
            "alias": s.template,
            "startedAt": airlock_api::utc_time(s.created_unix_ms),
            "endAt": airlock_api::utc_time(end),
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": self.access_token(&s.id),
            "cpuCount": s.vcpus,
            "memoryMB": s.memory_mib,
            "diskSizeMB": s.disk_mib,
            "state": state_name(s.state()),
            "metadata": s.labels,
            "domain": self.domain(),
        })
    }

    /// A live (running or paused) sandbox of `tenant`; ended ones are "not found", as on E2B.
    fn live(&self, tenant: &str, id: &str) -> Result<Sandbox, ApiError> {
        let s = self.daemon.sandboxes.get(tenant, id)?;
        match s.state() {
            SandboxState::Running | SandboxState::Paused | SandboxState::Starting => Ok(s),
            _ => Err(ApiError::SandboxNotFound(id.to_owned())),
        }
    }

    /// The network a create asks for: E2B's default (internet on) where the tenant's ceiling
    /// allows it, else none; `allowOut` entries as rules.
    fn network_of(&self, tenant: &str, n: &NewSandbox) -> Option<NetworkPolicy> {
        let allow: Vec<EgressRule> = n
            .network
            .as_ref()
            .map(|net| net.allow_out.as_slice())
            .unwrap_or_default()
            .iter()
            .map(|a| {
                let target = if a.parse::<std::net::IpAddr>().is_ok() || a.contains('/') {
                    egress_rule::Target::Cidr(a.clone())
                } else {
                    egress_rule::Target::Domain(a.clone())
                };
                EgressRule {
                    target: Some(target),
                    ..Default::default()
                }
            })
            .collect();
        if !allow.is_empty() {
            return Some(NetworkPolicy {
                allow,
                ..Default::default()
            });
        }
        if n.allow_internet_access == Some(false) {
            return None;
        }
        let open = NetworkPolicy {
            allow_internet: true,
            ..Default::default()
        };
        self.daemon
            .sandboxes
            .egress
            .check(tenant, &open)
            .is_ok()
            .then_some(open)
    }
}

/// E2B's code interpreter template's name, which its SDK asks for by default.
const CODE_INTERPRETER_ALIAS: &str = "code-interpreter-v1";

/// The template a create names: `base` when none; E2B's `code-interpreter-v1` is Airlock's
/// `code-interpreter` unless the tenant has a template of that name.
fn template_of(gw: &Gateway, tenant: &str, named: &str) -> String {
    resolve_template(named, |t| gw.daemon.templates.find(tenant, t).is_ok())
}

/// [`template_of`], with `exists` saying whether the tenant sees a template of a name.
fn resolve_template(named: &str, exists: impl Fn(&str) -> bool) -> String {
    match named {
        "" => "base".into(),
        CODE_INTERPRETER_ALIAS if !exists(named) => "code-interpreter".into(),
        _ => named.to_owned(),
    }
}

async fn create(
    State(gw): Gw,
    Caller(tenant): Caller,
    JsonBody(n): JsonBody<NewSandbox>,
) -> Response {
    let timeout = n
        .timeout
        .filter(|t| *t > 0)
        .unwrap_or(gw.cfg.default_timeout_s);
    let paths = gw.cfg.file_paths.clone();
    let req = CreateSandboxRequest {
        template: template_of(&gw, &tenant, &n.template_id),
        env: n.env_vars.clone().unwrap_or_default(),
        labels: n.metadata.clone().unwrap_or_default(),
        idle_ttl_s: timeout.min(gw.daemon.cfg.max_idle_ttl_s),
        max_lifetime_s: timeout,
        file_policy: Some(FilePolicy {
            writable: paths.clone(),
            exportable: paths,
            ..Default::default()
        }),
        network: gw.network_of(&tenant, &n),
        ..Default::default()
    };
    let (s, t) = (gw.daemon.sandboxes.clone(), tenant.clone());
    // On a task of its own: a create finishes (or cleans up) if the client goes away.
    let made = tokio::spawn(async move { s.create(&t, req).await }).await;
    match made {
        Ok(Ok(s)) => json(StatusCode::CREATED, &gw.sandbox_json(&s)),
        Ok(Err(ApiError::TemplateNotFound(name))) => json_error(
            StatusCode::NOT_FOUND,
            &format!(
                "template '{name}' not found (an E2B template is an Airlock template of that name)"
            ),
        ),
        Ok(Err(e)) => api_error(&tenant, "", "e2b.CreateSandbox", &e),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &format!("create: {e}")),
    }
}

async fn info(State(gw): Gw, Caller(tenant): Caller, Path(id): Path<String>) -> Response {
    match gw.live(&tenant, &id) {
        Ok(s) => json(StatusCode::OK, &gw.detail_json(&s)),
        Err(e) => api_error(&tenant, &id, "e2b.GetSandbox", &e),
    }
}

/// `metadata` as the SDKs send it: a form-encoded `k=v&...` whose keys and values are
/// percent-encoded once more.
fn metadata_filter(raw: &str) -> HashMap<String, String> {
    url::form_urlencoded::parse(raw.as_bytes())
        .map(|(k, v)| {
            let dec = |s: &str| percent_decode(s).unwrap_or_else(|| s.to_owned());
            (dec(&k), dec(&v))
        })
        .collect()
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(h, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

async fn list(
    State(gw): Gw,
    Caller(tenant): Caller,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let labels = q
        .get("metadata")
        .map(|m| metadata_filter(m))
        .unwrap_or_default();
    let mut states = Vec::new();
    for s in q
        .get("state")
        .map(String::as_str)
        .unwrap_or("running,paused")
        .split(',')
    {
        match s.trim() {
            "running" => {
                states.extend([SandboxState::Running as i32, SandboxState::Starting as i32])
            }
            "paused" => states.push(SandboxState::Paused as i32),
            "" => {}
            other => {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    &format!("state {other:?}: running or paused"),
                );
            }
        }
    }
    let mut found = match gw.daemon.sandboxes.list(&tenant, &labels, &states) {
        Ok(v) => v,
        Err(e) => return api_error(&tenant, "", "e2b.ListSandboxes", &e),
    };
    found.sort_by(|a, b| (a.created_unix_ms, &a.id).cmp(&(b.created_unix_ms, &b.id)));
    if q.get("order").is_some_and(|o| o == "desc") {
        found.reverse();
    }
    let start: usize = q.get("nextToken").and_then(|t| t.parse().ok()).unwrap_or(0);
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .unwrap_or(1000)
        .min(1000);
    let page: Vec<Value> = found
        .iter()
        .skip(start)
        .take(limit)
        .map(|s| gw.detail_json(s))
        .collect();
    let mut r = json(StatusCode::OK, &page);
    // `nextToken` is the caller's: a huge one must not overflow.
    let next = start.saturating_add(limit);
    if next < found.len()
        && let Ok(v) = HeaderValue::from_str(&next.to_string())
    {
        r.headers_mut().insert("x-next-token", v);
    }
    r
}

async fn kill(State(gw): Gw, Caller(tenant): Caller, Path(id): Path<String>) -> Response {
    if let Err(e) = gw.live(&tenant, &id) {
        return api_error(&tenant, &id, "e2b.Kill", &e);
    }
    let (s, t, i) = (gw.daemon.sandboxes.clone(), tenant.clone(), id.clone());
    match tokio::spawn(async move { s.destroy(&t, &i).await }).await {
        Ok(Ok(_)) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => api_error(&tenant, &id, "e2b.Kill", &e),
        Err(e) => json_error(StatusCode::INTERNAL_SERVER_ERROR, &format!("kill: {e}")),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Timeout {
    timeout: Option<u32>,
}

async fn set_timeout(
    State(gw): Gw,
    Caller(tenant): Caller,
    Path(id): Path<String>,
    JsonBody(t): JsonBody<Timeout>,
) -> Response {
    let Some(secs) = t.timeout else {
        return json_error(StatusCode::BAD_REQUEST, "timeout (seconds) is required");
    };
    match gw
        .live(&tenant, &id)
        .and_then(|_| gw.daemon.sandboxes.set_timeout(&tenant, &id, secs))
    {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => api_error(&tenant, &id, "e2b.SetTimeout", &e),
    }
}

async fn pause(State(gw): Gw, Caller(tenant): Caller, Path(id): Path<String>) -> Response {
    match gw.live(&tenant, &id) {
        Ok(s) if s.state() == SandboxState::Paused => {
            return json_error(
                StatusCode::CONFLICT,
                &format!("sandbox {id} is already paused"),
            );
        }
        Ok(_) => {}
        Err(e) => return api_error(&tenant, &id, "e2b.Pause", &e),
    }
    match gw.daemon.sandboxes.pause(&tenant, &id).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => api_error(&tenant, &id, "e2b.Pause", &e),
    }
}

/// Connect (and resume): a paused sandbox is resumed; a timeout given extends its life (never
/// shortens it). 201 when it was resumed, 200 when it ran.
async fn connect(
    State(gw): Gw,
    Caller(tenant): Caller,
    Path(id): Path<String>,
    JsonBody(t): JsonBody<Timeout>,
) -> Response {
    let mut s = match gw.live(&tenant, &id) {
        Ok(s) => s,
        Err(e) => return api_error(&tenant, &id, "e2b.Connect", &e),
    };
    let mut status = StatusCode::OK;
    if s.state() == SandboxState::Paused {
        s = match gw.daemon.sandboxes.resume(&tenant, &id).await {
            Ok(s) => s,
            Err(e) => return api_error(&tenant, &id, "e2b.Resume", &e),
        };
        status = StatusCode::CREATED;
    }
    if let Some(secs) = t.timeout.filter(|t| *t > 0) {
        let left_ms = (s.created_unix_ms + i64::from(s.max_lifetime_s) * 1000)
            .saturating_sub(crate::ids::now_ms());
        if i64::from(secs) * 1000 > left_ms {
            s = match gw.daemon.sandboxes.set_timeout(&tenant, &id, secs) {
                Ok(s) => s,
                Err(e) => return api_error(&tenant, &id, "e2b.Connect", &e),
            };
        }
    }
    json(status, &gw.sandbox_json(&s))
}

async fn metrics(State(gw): Gw, Caller(tenant): Caller, Path(id): Path<String>) -> Response {
    let s = match gw.live(&tenant, &id) {
        Ok(s) => s,
        Err(e) => return api_error(&tenant, &id, "e2b.Metrics", &e),
    };
    let now = crate::ids::now_ms();
    let age_us = (now - s.created_unix_ms).max(1) as f64 * 1000.0;
    let cpu_pct = s.cpu_usage_us as f64 * 100.0 / (age_us * f64::from(s.vcpus.max(1)));
    // One sample: the averages since the sandbox started, and its peak memory.
    let sample = json!({
        "timestamp": airlock_api::utc_time(now),
        "timestampUnix": now / 1000,
        "cpuCount": s.vcpus,
        "cpuUsedPct": (cpu_pct * 100.0).round() / 100.0,
        "memUsed": s.memory_peak_bytes,
        "memTotal": u64::from(s.memory_mib) << 20,
        "memCache": 0,
        "diskUsed": 0,
        "diskTotal": u64::from(s.disk_mib) << 20,
    });
    json(StatusCode::OK, &[sample])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2bs_code_interpreter_template_is_airlocks_unless_the_tenant_has_one_of_its_name() {
        assert_eq!(resolve_template("", |_| true), "base");
        assert_eq!(
            resolve_template("code-interpreter-v1", |_| false),
            "code-interpreter"
        );
        assert_eq!(
            resolve_template("code-interpreter-v1", |_| true),
            "code-interpreter-v1"
        );
        assert_eq!(
            resolve_template("code-interpreter-v1:x", |_| false),
            "code-interpreter-v1:x"
        );
        assert_eq!(resolve_template("mine", |_| false), "mine");
    }

    #[test]
    fn metadata_is_decoded_as_the_sdks_encode_it() {
        // {"user": "a b&c=d", "k/2": "v"}, as the SDK's urlencode(quote) arrives after the
        // query string's own decoding.
        let m = metadata_filter("user=a%2520b%2526c%253Dd&k%252F2=v");
        assert_eq!(m.get("user").map(String::as_str), Some("a b&c=d"));
        assert_eq!(m.get("k/2").map(String::as_str), Some("v"));
        let plain = metadata_filter("k1=v1&k2=v2");
        assert_eq!(plain.len(), 2);
    }
}
