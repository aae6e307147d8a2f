//! Size caps on what a request carries (labels, environment, command, stdin): each is stored
//! or sent on to the guest, so none is bounded only by gRPC's message size.

use std::collections::HashMap;

use crate::error::{ApiError, ApiResult};

pub const MAX_LABELS: usize = 64;
pub const MAX_LABEL_KEY_BYTES: usize = 63;
pub const MAX_LABEL_VALUE_BYTES: usize = 256;
pub const MAX_ENV_ENTRIES: usize = 256;
/// Keys and values together.
pub const MAX_ENV_BYTES: usize = 64 << 10;
pub const MAX_ARGS: usize = 4096;
pub const MAX_ARGV_BYTES: usize = 256 << 10;
pub const MAX_STDIN_BYTES: usize = 8 << 20;
/// Stdin one WriteStdin call carries.
pub const MAX_STDIN_CHUNK: usize = 1 << 20;
pub const MAX_PATH_BYTES: usize = 4096;

fn too_big(what: &str, limit: usize) -> ApiError {
    ApiError::InvalidArgument(format!("{what}: at most {limit}"))
}

/// Labels: a bounded number of short keys (`[A-Za-z0-9._/-]`) with bounded values.
pub fn check_labels(labels: &HashMap<String, String>) -> ApiResult<()> {
    if labels.len() > MAX_LABELS {
        return Err(too_big("labels", MAX_LABELS));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= MAX_LABEL_KEY_BYTES
            && k.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"._/-".contains(&c));
        if !key_ok {
            return Err(ApiError::InvalidArgument(format!(
                "label key {k:?}: 1..={MAX_LABEL_KEY_BYTES} of [A-Za-z0-9._/-]"
            )));
        }
        if v.len() > MAX_LABEL_VALUE_BYTES {
            return Err(too_big(
                &format!("label {k}'s value (bytes)"),
                MAX_LABEL_VALUE_BYTES,
            ));
        }
    }
    Ok(())
}

/// An environment: names without `=` or NUL, values without NUL, bounded in number and bytes.
pub fn check_env(env: &HashMap<String, String>) -> ApiResult<()> {
    if env.len() > MAX_ENV_ENTRIES {
        return Err(too_big("environment entries", MAX_ENV_ENTRIES));
    }
    let mut bytes = 0;
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::InvalidArgument(format!(
                "bad environment entry {k:?}"
            )));
        }
        bytes += k.len() + v.len();
    }
    if bytes > MAX_ENV_BYTES {
        return Err(too_big("environment (bytes)", MAX_ENV_BYTES));
    }
    Ok(())
}

/// Longest guest account name (`useradd`'s limit).
const MAX_USER_BYTES: usize = 32;

/// A guest account name (empty: the default); the guest checks that it exists.
pub fn check_user(user: &str) -> ApiResult<()> {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
    if user.len() > MAX_USER_BYTES || user.starts_with('-') || !user.chars().all(ok) {
        return Err(ApiError::InvalidArgument(format!(
            "user {user:?}: a guest account name (letters, digits, '_', '-', '.'; at most \
             {MAX_USER_BYTES} bytes)"
        )));
    }
    Ok(())
}

/// A command line, its stdin and working directory.
pub fn check_command(argv: &[String], stdin: &[u8], cwd: &str) -> ApiResult<()> {
    if argv.first().is_none_or(String::is_empty) {
        return Err(ApiError::InvalidArgument("empty argv".into()));
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::InvalidArgument("NUL byte in the command".into()));
    }
    if argv.len() > MAX_ARGS {
        return Err(too_big("arguments", MAX_ARGS));
    }
    if argv.iter().map(String::len).sum::<usize>() > MAX_ARGV_BYTES {
        return Err(too_big("the command (bytes)", MAX_ARGV_BYTES));
    }
    if stdin.len() > MAX_STDIN_BYTES {
        return Err(too_big("stdin (bytes)", MAX_STDIN_BYTES));
    }
    if cwd.len() > MAX_PATH_BYTES || cwd.contains('\0') {
        return Err(too_big("cwd (bytes, no NUL)", MAX_PATH_BYTES));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names_are_checked() {
        for good in ["", "user", "root", "www-data", "a_b.c"] {
            assert!(check_user(good).is_ok(), "{good}");
        }
        for bad in ["-x", "a b", "a:b", "../etc", &"x".repeat(33)] {
            assert!(check_user(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn what_a_request_carries_is_bounded() {
        let map = |n: usize, k: &dyn Fn(usize) -> String, v: &str| -> HashMap<String, String> {
            (0..n).map(|i| (k(i), v.to_owned())).collect()
        };
        let key = |i: usize| format!("k{i}");
        assert!(check_labels(&map(MAX_LABELS, &key, "v")).is_ok());
        assert!(check_labels(&map(MAX_LABELS + 1, &key, "v")).is_err());
        assert!(check_labels(&map(1, &|_| "a b".into(), "v")).is_err());
        assert!(check_labels(&map(1, &|_| "x".repeat(64), "v")).is_err());
        assert!(check_labels(&map(1, &key, &"v".repeat(257))).is_err());
        assert!(check_env(&map(MAX_ENV_ENTRIES + 1, &key, "")).is_err());
        assert!(
            check_env(&map(2, &key, &"v".repeat(40 << 10))).is_err(),
            "80 KiB"
        );
        assert!(check_env(&map(1, &|_| "A=B".into(), "")).is_err());
        assert!(check_env(&map(3, &key, "value")).is_ok());
        let argv = |n: usize, len: usize| vec!["x".repeat(len); n];
        assert!(check_command(&argv(1, 10), b"", "/").is_ok());
        assert!(check_command(&argv(0, 1), b"", "").is_err());
        assert!(check_command(&argv(MAX_ARGS + 1, 1), b"", "").is_err());
        assert!(check_command(&argv(2, 200 << 10), b"", "").is_err());
        assert!(check_command(&argv(1, 1), &vec![0; MAX_STDIN_BYTES + 1], "").is_err());
        assert!(check_command(&argv(1, 1), b"", &"/".repeat(5000)).is_err());
    }
}
