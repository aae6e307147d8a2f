//! Tenant tokens. The daemon keeps only their SHA-256 digests (the config may give a token in
//! clear, `tokens`, or as its digest, `token_sha256`: `airlockd --hash-token` prints one), and a
//! presented token is hashed and compared with every known digest in constant time, so neither
//! the comparison's time nor its order tells anything about the tokens.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::Config;

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
    pub fn from_config(cfg: &Config) -> Result<Self, String> {
        let mut entries = Vec::new();
        for (tenant, t) in &cfg.tenants {
            for (clear, hashed, templates) in [
                (&t.tokens, &t.token_sha256, true),
                (&t.run_tokens, &t.run_token_sha256, false),
            ] {
                for token in clear {
                    if token.is_empty() {
                        return Err(format!("tenant {tenant}: an empty token"));
                    }
                    entries.push((tenant.clone(), digest(token), templates));
                }
                for h in hashed {
                    let d = parse_hex(h)
                        .ok_or_else(|| format!("tenant {tenant}: {h:?} is not a SHA-256 in hex"))?;
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
