//! Tenant tokens. The daemon keeps only their SHA-256 digests (the config may give a token in
//! clear, `tokens`, or as its digest, `token_sha256`: `airlockd --hash-token` prints one), and a
//! presented token is hashed and compared with every known digest in constant time, so neither
//! the comparison's time nor its order tells anything about the tokens. Each listener's
//! interceptor (`Auth`) turns a call's token into its caller: the tenant, whether it may make
//! templates, or another node of the cluster forwarding a tenant's call.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::{Request, Status};

use crate::config::Config;
use crate::error::{ApiError, StartError};

/// A token's digest.
pub type TokenDigest = [u8; 32];

/// SHA-256 of `token`.
pub fn digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// Lower-case hex.
pub fn hex(d: &TokenDigest) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex(s: &str) -> Option<TokenDigest> {
    let s = s.strip_prefix("sha256:").unwrap_or(s);
    if s.len() != 64 {
        return None;
    }
    let mut d = [0u8; 32];
    for (i, byte) in d.iter_mut().enumerate() {
        *byte = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(d)
}

/// Whether two digests are equal, in constant time.
pub fn same(a: &TokenDigest, b: &TokenDigest) -> bool {
    a.ct_eq(b).into()
}

/// The tenants' token digests, each with whether it may make templates.
#[derive(Clone, Debug)]
pub struct Tokens {
    entries: Vec<(String, TokenDigest, bool)>,
}

impl Tokens {
    /// The digests of every tenant's tokens in `cfg`.
    pub fn from_config(cfg: &Config) -> Result<Self, StartError> {
        let mut entries = Vec::new();
        for (tenant, t) in &cfg.tenants {
            for (clear, hashed, templates) in [
                (&t.tokens, &t.token_sha256, true),
                (&t.run_tokens, &t.run_token_sha256, false),
            ] {
                for token in clear {
                    if token.is_empty() {
                        return Err(StartError::Setting(format!(
                            "tenant {tenant}: an empty token"
                        )));
                    }
                    entries.push((tenant.clone(), digest(token), templates));
                }
                for h in hashed {
                    let d = parse_hex(h).ok_or_else(|| {
                        StartError::Setting(format!(
                            "tenant {tenant}: {h:?} is not a SHA-256 in hex"
                        ))
                    })?;
                    entries.push((tenant.clone(), d, templates));
                }
            }
        }
        Ok(Self { entries })
    }

    /// The tenant `token` belongs to and whether it may make templates. Every known digest is
    /// compared (no early exit).
    pub fn caller_of(&self, token: &str) -> Option<(&str, bool)> {
        let presented = digest(token);
        let mut found = None;
        for (tenant, d, templates) in &self.entries {
            if same(&presented, d) && found.is_none() {
                found = Some((tenant.as_str(), *templates));
            }
        }
        found
    }
}

/// The header a forwarded call names its caller's tenant with (only honoured with the cluster
/// token).
pub const FORWARDED_TENANT: &str = "airlock-forwarded-tenant";

/// The caller's tenant, put into each request by the listener's interceptor.
#[derive(Clone, Debug)]
pub struct Tenant(pub String);

/// Authentication for one listener: on a Unix socket a call without a token is the default
/// tenant; on TCP every call needs a token. In cluster mode a call with the cluster token is
/// another node's, forwarded for the tenant it names.
#[derive(Clone, Debug)]
pub struct Auth {
    pub tokens: Arc<Tokens>,
    pub default_tenant: String,
    pub token_required: bool,
    /// Cluster mode: the digest of the node-to-node token.
    pub cluster_token: Option<TokenDigest>,
}

/// Whether the caller's token may make templates (a tenant's `run_tokens` may not).
#[derive(Clone, Copy, Debug)]
pub struct TemplateRight(pub bool);

/// Who calls.
#[derive(Clone, Debug)]
pub struct Caller {
    pub tenant: String,
    /// Forwarded by another node of the cluster.
    pub forwarded: bool,
    /// May make templates.
    pub templates: bool,
}

impl Auth {
    /// Whether `authorization` (the header's value) carries the cluster token.
    pub fn is_cluster_token(&self, authorization: Option<&str>) -> bool {
        let (Some(ours), Some(a)) = (&self.cluster_token, authorization) else {
            return false;
        };
        let t = a.strip_prefix("Bearer ").unwrap_or(a).trim();
        same(&digest(t), ours)
    }

    /// The caller of a call with `authorization` and, forwarded by a node, `forwarded_tenant`.
    pub fn caller(
        &self,
        authorization: Option<&str>,
        forwarded_tenant: Option<&str>,
    ) -> Result<Caller, Status> {
        if self.is_cluster_token(authorization) {
            let tenant = forwarded_tenant.filter(|t| !t.is_empty()).ok_or_else(|| {
                Status::from(ApiError::Unauthenticated(
                    "a node's call names no tenant".into(),
                ))
            })?;
            return Ok(Caller {
                tenant: tenant.to_owned(),
                forwarded: true,
                templates: true,
            });
        }
        let (tenant, templates) = match authorization {
            Some(t) => {
                let t = t.strip_prefix("Bearer ").unwrap_or(t).trim();
                self.tokens
                    .caller_of(t)
                    .map(|(tenant, right)| (tenant.to_owned(), right))
                    .ok_or_else(|| {
                        Status::from(ApiError::Unauthenticated("unknown token".into()))
                    })?
            }
            None if self.token_required => {
                return Err(ApiError::Unauthenticated(
                    "this listener needs a token (metadata `authorization: Bearer TOKEN`)".into(),
                )
                .into());
            }
            None => (self.default_tenant.clone(), true),
        };
        Ok(Caller {
            tenant,
            forwarded: false,
            templates,
        })
    }
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let md = req.metadata();
        let token = md
            .get("authorization")
            .map(|v| v.to_str().unwrap_or_default().trim().to_owned());
        let forwarded = md
            .get(FORWARDED_TENANT)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let caller = self.caller(token.as_deref(), forwarded.as_deref())?;
        req.extensions_mut().insert(Tenant(caller.tenant));
        req.extensions_mut().insert(TemplateRight(caller.templates));
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn tokens_are_kept_as_digests_and_found_in_either_form() {
        let h = hex(&digest("hashed-token"));
        let cfg: Config = toml::from_str(&format!(
            "[tenants.acme]\ntokens = [\"clear-token\"]\nrun_tokens = [\"run-token\"]\n\
             [tenants.zed]\ntoken_sha256 = [\"sha256:{h}\"]\n"
        ))
        .unwrap();
        let tokens = Tokens::from_config(&cfg).unwrap();
        assert_eq!(tokens.caller_of("hashed-token"), Some(("zed", true)));
        assert_eq!(tokens.caller_of("clear-token "), None);
        assert_eq!(tokens.caller_of(""), None);
        assert_eq!(tokens.caller_of("clear-token"), Some(("acme", true)));
        assert_eq!(tokens.caller_of("run-token"), Some(("acme", false)));
        assert!(
            !format!("{tokens:?}").contains("clear-token"),
            "no token in clear"
        );
        let bad: Config = toml::from_str("[tenants.x]\ntoken_sha256 = [\"abc\"]\n").unwrap();
        assert!(Tokens::from_config(&bad).is_err());
        assert_eq!(hex(&digest("")).len(), 64);
    }
}
