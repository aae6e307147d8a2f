//! Template versions beyond their records: how each was made (its recipe, the CreateTemplate
//! or BuildTemplate request without credentials, kept beside it for RebuildTemplate), the log
//! of its build, and rebuilds as new versions.

use std::path::Path;
use std::sync::Arc;

use airlock_api::v1::template_recipe::How;
use airlock_api::v1::{
    GetTemplateLogResponse, RebuildTemplateRequest, TemplateEvent, TemplateRecipe,
};
use prost::Message as _;
use tokio::sync::mpsc::Sender;
use tracing::warn;

use crate::daemon::Daemon;
use crate::error::{ApiError, ApiResult};
use crate::templates::{TemplateRt, tag_of};

/// The recipe's file in a template's directory (a `TemplateRecipe`, protobuf).
pub const RECIPE_FILE: &str = "recipe.pb";
/// The build log's file in a template's directory.
pub const LOG_FILE: &str = "build.log";
/// The most of a build log kept (its end).
pub const MAX_LOG_BYTES: usize = 1 << 20;
/// The first line of a log whose beginning was dropped.
const TRUNCATED: &str = "[earlier lines dropped]\n";

/// Makes the template `how` describes.
pub async fn make(
    d: &Arc<Daemon>,
    tenant: &str,
    how: How,
    tx: Sender<TemplateEvent>,
) -> ApiResult<TemplateRt> {
    match how {
        How::Create(req) => d.create_template(tenant, req, tx).await,
        How::Build(req) => crate::imagebuild::build(d, tenant, req, tx).await,
    }
}

/// Makes the template `how` describes, its progress sent to `out` (the event with the
/// template last, once its recipe and log are kept beside it: a client that asks for the log
/// at once finds it).
pub async fn make_and_keep(
    d: Arc<Daemon>,
    tenant: String,
    how: How,
    out: Sender<TemplateEvent>,
) -> ApiResult<TemplateRt> {
    let kept = keep_recipe(&how);
    let (ptx, mut prx) = tokio::sync::mpsc::channel::<TemplateEvent>(16);
    let build = tokio::spawn(async move { make(&d, &tenant, how, ptx).await });
    let mut log = BuildLog::default();
    let mut last = None;
    while let Some(ev) = prx.recv().await {
        log.push(&ev);
        if ev.template.is_some() {
            last = Some(ev);
        } else {
            let _ = out.send(ev).await;
        }
    }
    let t = build
        .await
        .map_err(|e| ApiError::Internal(format!("template build: {e}")))??;
    save(&t, &kept, log);
    if let Some(ev) = last {
        let _ = out.send(ev).await;
    }
    Ok(t)
}

/// What is kept of a request: everything but its credentials (and `replace`, which is the
/// rebuild's own choice).
pub fn keep_recipe(how: &How) -> TemplateRecipe {
    let mut how = how.clone();
    match &mut how {
        How::Create(r) => {
            if let Some(o) = &mut r.oci {
                o.username.clear();
                o.password.clear();
            }
            r.replace = false;
        }
        How::Build(r) => {
            r.registry_username.clear();
            r.registry_password.clear();
            r.replace = false;
        }
    }
    TemplateRecipe { how: Some(how) }
}

/// A build's progress as text, its last [`MAX_LOG_BYTES`].
#[derive(Debug, Default)]
pub struct BuildLog {
    text: String,
    truncated: bool,
}

impl BuildLog {
    pub fn push(&mut self, ev: &TemplateEvent) {
        let secs = ev.elapsed_ms as f64 / 1000.0;
        self.text
            .push_str(&format!("[{secs:8.1}s] {}: {}\n", ev.phase, ev.message));
        if self.text.len() > 2 * MAX_LOG_BYTES {
            self.trim();
        }
    }

    fn trim(&mut self) {
        if self.text.len() <= MAX_LOG_BYTES {
            return;
        }
        let mut cut = self.text.len() - MAX_LOG_BYTES;
        while !self.text.is_char_boundary(cut) {
            cut += 1;
        }
        // From the next whole line on.
        let cut = self.text[cut..].find('\n').map_or(cut, |i| cut + i + 1);
        self.text.drain(..cut);
        self.truncated = true;
    }

    /// The kept text (marked when its beginning was dropped).
    pub fn finish(mut self) -> String {
        self.trim();
        if self.truncated {
            format!("{TRUNCATED}{}", self.text)
        } else {
            self.text
        }
    }
}

/// Keeps `recipe` and `log` beside the template `t` (a failure is logged: the template is
/// usable without them).
pub fn save(t: &TemplateRt, recipe: &TemplateRecipe, log: BuildLog) {
    for (file, bytes) in [
        (RECIPE_FILE, recipe.encode_to_vec()),
        (LOG_FILE, log.finish().into_bytes()),
    ] {
        if let Err(e) = std::fs::write(t.dir.join(file), bytes) {
            warn!(template = %t.record.id, "keeping its {file}: {e}");
        }
    }
}

/// GetTemplateLog: the kept log of `t`'s build (empty for a template snapshotted from a
/// sandbox, or made before logs were kept).
pub fn log_of(t: &TemplateRt) -> GetTemplateLogResponse {
    let text = std::fs::read_to_string(t.dir.join(LOG_FILE)).unwrap_or_default();
    match text.strip_prefix(TRUNCATED) {
        Some(rest) => GetTemplateLogResponse {
            log: rest.to_owned(),
            truncated: true,
        },
        None => GetTemplateLogResponse {
            log: text,
            truncated: false,
        },
    }
}

/// The recipe of `tenant`'s version `r.name`, made into the request of its rebuild: NAME:TAG
/// (the old version's tag unless `r.tag`), replacing that tag, every Dockerfile step run anew,
/// with the rebuild's registry credentials.
pub fn rebuild_recipe(d: &Daemon, tenant: &str, r: RebuildTemplateRequest) -> ApiResult<How> {
    let t = d.templates.own(tenant, &r.name)?;
    let shown = crate::templates::reference(&t.record);
    let how = read_recipe(&t.dir).ok_or_else(|| {
        ApiError::InvalidArgument(format!(
            "template {shown} has no recipe to rebuild from: it was snapshotted from a sandbox \
             (or made before recipes were kept); make it again with CreateTemplate or \
             BuildTemplate"
        ))
    })?;
    let tag = if r.tag.is_empty() {
        tag_of(&t.record).to_owned()
    } else {
        r.tag
    };
    let name = format!("{}:{tag}", t.record.name);
    crate::templates::TemplateRef::parse(&name)?;
    Ok(match how {
        How::Create(mut c) => {
            c.name = name;
            c.replace = true;
            if let Some(o) = &mut c.oci {
                o.username = r.registry_username;
                o.password = r.registry_password;
            }
            How::Create(c)
        }
        How::Build(mut b) => {
            b.name = name;
            b.replace = true;
            b.no_cache = true;
            b.registry_username = r.registry_username;
            b.registry_password = r.registry_password;
            How::Build(b)
        }
    })
}

fn read_recipe(dir: &Path) -> Option<How> {
    let bytes = std::fs::read(dir.join(RECIPE_FILE)).ok()?;
    TemplateRecipe::decode(bytes.as_slice()).ok()?.how
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use airlock_api::v1::{BuildTemplateRequest, CreateTemplateRequest, OciImage};

    #[test]
    fn a_recipe_keeps_no_credentials() {
        let create = How::Create(CreateTemplateRequest {
            name: "py:v1".into(),
            oci: Some(OciImage {
                reference: "registry.local/py:3".into(),
                username: "me".into(),
                password: "secret".into(),
            }),
            replace: true,
            ..Default::default()
        });
        let kept = keep_recipe(&create).encode_to_vec();
        assert!(!kept.windows(6).any(|w| w == b"secret"));
        assert!(kept.windows(18).any(|w| w == b"registry.local/py:"));
        let build = How::Build(BuildTemplateRequest {
            name: "app".into(),
            dockerfile: "FROM base\n".into(),
            registry_username: "me".into(),
            registry_password: "secret".into(),
            ..Default::default()
        });
        let Some(How::Build(b)) = keep_recipe(&build).how else {
            panic!("a build's recipe")
        };
        assert!(b.registry_password.is_empty() && b.registry_username.is_empty());
        assert_eq!(b.dockerfile, "FROM base\n");
    }

    #[test]
    fn a_log_keeps_its_last_mebibyte_from_a_whole_line() {
        let mut log = BuildLog::default();
        let line = "x".repeat(1000);
        for i in 0..3000 {
            log.push(&TemplateEvent {
                phase: "output".into(),
                elapsed_ms: i,
                message: format!("{i} {line}"),
                template: None,
            });
        }
        let text = log.finish();
        assert!(text.len() <= MAX_LOG_BYTES + TRUNCATED.len());
        assert!(text.starts_with(TRUNCATED));
        let first = text[TRUNCATED.len()..].lines().next().unwrap();
        assert!(first.starts_with('['), "a whole line: {}", &first[..20]);
        assert!(text.ends_with(&format!("2999 {line}\n")));
        let mut short = BuildLog::default();
        short.push(&TemplateEvent {
            phase: "ready".into(),
            elapsed_ms: 1500,
            message: "ready after 1 s".into(),
            template: None,
        });
        assert_eq!(short.finish(), "[     1.5s] ready: ready after 1 s\n");
    }
}
