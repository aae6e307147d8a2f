//! Ids and names: sandbox, execution, template and VMM ids (`sb-`, `ex-`, `tpl-`, `vm-` and 16
//! random hex digits, made by the shared `airlock_proto::identity`), template names, and the
//! wall clock of records.

use std::time::{SystemTime, UNIX_EPOCH};

pub use airlock_proto::identity::well_formed;

use crate::error::{ApiError, ApiResult};

pub const SANDBOX: &str = "sb";
pub const EXECUTION: &str = "ex";
pub const TEMPLATE: &str = "tpl";
pub const VMM: &str = "vm";
pub const VOLUME: &str = "vol";

/// A new random id with `prefix`.
pub fn new_id(prefix: &str) -> ApiResult<String> {
    airlock_proto::identity::new_id(prefix)
        .map_err(|e| ApiError::Internal(format!("making an id: {e}")))
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Template names: `[a-z0-9][a-z0-9._-]{0,62}`.
pub fn valid_name(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ids_carry_their_prefix() {
        let a = new_id(SANDBOX).unwrap();
        assert!(well_formed(&a, SANDBOX));
        assert!(!well_formed(&a, EXECUTION));
    }

    #[test]
    fn template_names_are_checked() {
        assert!(valid_name("base"));
        assert!(valid_name("py3.12-data"));
        assert!(!valid_name(""));
        assert!(!valid_name("Base"));
        assert!(!valid_name("../x"));
        assert!(!valid_name(&"a".repeat(64)));
    }
}
