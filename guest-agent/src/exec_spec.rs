//! A validated Exec request: the command, its environment, and the limits asked for.
//!
//! Everything the host sends is checked here, before any process or cgroup exists: argv, env
//! and cwd (no NUL bytes, valid names, at most [`MAX_ARGV_ENV_BYTES`] together), and the
//! environment is built from [`BASE_ENV`] (plus the sandbox id, see [`base_env`]) with the
//! request's variables on top.

use std::collections::HashMap;
use std::time::Duration;

use airlock_proto::pb::{self, ErrorCode, exec};
use airlock_proto::{DEFAULT_MAX_OUTPUT_BYTES, MAX_ARGV_ENV_BYTES};

use crate::error::ReqError;
use crate::users::Account;

/// The environment every execution starts from (Exec.env adds to and overrides it).
pub const BASE_ENV: [(&str, &str); 4] = [
    (
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    ),
    ("HOME", "/root"),
    ("LANG", "C.UTF-8"),
    ("TERM", "dumb"),
];
/// The variable that carries the sandbox id (Reseed) into executions.
pub const SANDBOX_ID_ENV: &str = "AIRLOCK_SANDBOX_ID";

/// The environment executions start from: [`BASE_ENV`], plus [`SANDBOX_ID_ENV`] once a
/// sandbox id is set.
pub fn base_env(sandbox_id: &str) -> Vec<(String, String)> {
    let mut env: Vec<_> = BASE_ENV
        .iter()
        .map(|&(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    if !sandbox_id.is_empty() {
        env.push((SANDBOX_ID_ENV.to_owned(), sandbox_id.to_owned()));
    }
    env
}

/// A validated Exec request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecSpec {
    /// argv\[0\] first.
    pub argv: Vec<String>,
    /// The full environment, sorted by name.
    pub env: Vec<(String, String)>,
    pub cwd: String,
    pub stdin: Vec<u8>,
    pub stdin_open: bool,
    pub timeout: Option<Duration>,
    pub max_output_bytes: u64,
    pub keep_on_disconnect: bool,
    /// The cgroup's memory.max, if one was asked for.
    pub memory_max: Option<u64>,
    /// The account it runs as; none: the agent's own.
    pub account: Option<Account>,
}

impl ExecSpec {
    /// Checks `req`, to run as `account` (none: as the agent); the environment is `base` (see
    /// [`base_env`]), then the account's HOME, USER and LOGNAME, then `req.env`.
    pub fn validate(
        req: pb::Exec,
        base: Vec<(String, String)>,
        account: Option<Account>,
    ) -> Result<Self, ReqError> {
        let argv = match req.command {
            Some(exec::Command::Argv(a)) => a.args,
            Some(exec::Command::Shell(s)) => vec!["/bin/sh".into(), "-c".into(), s],
            None => return Err(ReqError::invalid("exec needs argv or shell")),
        };
        if argv.first().is_none_or(String::is_empty) {
            return Err(ReqError::invalid("argv is empty"));
        }
        check_size(&argv, &req.env)?;
        let strings = argv.iter().chain(req.env.keys()).chain(req.env.values());
        if strings.chain([&req.cwd]).any(|s| s.contains('\0')) {
            return Err(ReqError::invalid(
                "argv, env and cwd must not contain NUL bytes",
            ));
        }
        if let Some(bad) = req.env.keys().find(|k| k.is_empty() || k.contains('=')) {
            return Err(ReqError::invalid(format!(
                "invalid environment name {bad:?}"
            )));
        }
        let mut env: HashMap<String, String> = base.into_iter().collect();
        if let Some(a) = &account {
            env.insert("HOME".into(), a.home.clone());
            env.insert("USER".into(), a.name.clone());
            env.insert("LOGNAME".into(), a.name.clone());
        }
        env.extend(req.env);
        let mut env: Vec<_> = env.into_iter().collect();
        env.sort();
        Ok(Self {
            argv,
            env,
            cwd: if req.cwd.is_empty() {
                default_cwd(account.as_ref())
            } else {
                req.cwd
            },
            stdin: req.stdin,
            stdin_open: req.stdin_open,
            timeout: (req.timeout_ms > 0).then(|| Duration::from_millis(req.timeout_ms)),
            max_output_bytes: match req.max_output_bytes {
                0 => DEFAULT_MAX_OUTPUT_BYTES,
                n => n,
            },
            keep_on_disconnect: req.keep_on_disconnect,
            memory_max: (req.memory_max_bytes > 0).then_some(req.memory_max_bytes),
            account,
        })
    }
}

/// The account's home if it is a directory, else "/".
fn default_cwd(account: Option<&Account>) -> String {
    account
        .map(|a| a.home.as_str())
        .filter(|h| h.starts_with('/') && std::path::Path::new(h).is_dir())
        .unwrap_or("/")
        .to_owned()
}

/// argv plus env, each string with its terminating NUL (as the kernel counts them).
fn check_size(argv: &[String], env: &HashMap<String, String>) -> Result<(), ReqError> {
    let args: usize = argv.iter().map(|a| a.len() + 1).sum();
    let vars: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    let total = args + vars;
    if total > MAX_ARGV_ENV_BYTES {
        return Err(ReqError::new(
            ErrorCode::TooLarge,
            format!("argv and env take {total} bytes, limit {MAX_ARGV_ENV_BYTES}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_proto::pb::Argv;

    fn validate(req: pb::Exec) -> Result<ExecSpec, ReqError> {
        ExecSpec::validate(req, base_env(""), None)
    }

    fn argv(args: &[&str]) -> pb::Exec {
        pb::Exec {
            command: Some(exec::Command::Argv(Argv {
                args: args.iter().map(|s| (*s).to_owned()).collect(),
            })),
            ..Default::default()
        }
    }

    #[test]
    fn shell_becomes_bin_sh_dash_c() {
        let req = pb::Exec {
            command: Some(exec::Command::Shell("echo hi".into())),
            ..Default::default()
        };
        let spec = validate(req).unwrap();
        assert_eq!(spec.argv, ["/bin/sh", "-c", "echo hi"]);
        assert_eq!(spec.cwd, "/");
        assert_eq!(spec.max_output_bytes, DEFAULT_MAX_OUTPUT_BYTES);
        assert_eq!(spec.timeout, None);
    }

    #[test]
    fn env_overrides_base_and_is_sorted() {
        let mut req = argv(&["env"]);
        req.env.insert("HOME".into(), "/tmp".into());
        req.env.insert("A".into(), "1".into());
        let spec = validate(req).unwrap();
        let names: Vec<_> = spec.env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["A", "HOME", "LANG", "PATH", "TERM"]);
        assert!(spec.env.contains(&("HOME".into(), "/tmp".into())));
    }

    #[test]
    fn missing_or_empty_command_is_invalid() {
        let none = validate(pb::Exec::default()).unwrap_err();
        assert_eq!(none.code, ErrorCode::InvalidArgument);
        let empty = validate(argv(&[])).unwrap_err();
        assert_eq!(empty.code, ErrorCode::InvalidArgument);
        let blank = validate(argv(&[""])).unwrap_err();
        assert_eq!(blank.code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn nul_bytes_and_bad_env_names_are_invalid() {
        let nul = validate(argv(&["a\0b"])).unwrap_err();
        assert_eq!(nul.code, ErrorCode::InvalidArgument);
        let mut req = argv(&["true"]);
        req.env.insert("A=B".into(), "1".into());
        assert_eq!(validate(req).unwrap_err().code, ErrorCode::InvalidArgument);
    }

    #[test]
    fn argv_and_env_past_one_mib_is_too_large() {
        let big = "x".repeat(MAX_ARGV_ENV_BYTES / 2);
        let mut req = argv(&["true", &big]);
        req.env.insert("BIG".into(), big.clone());
        assert_eq!(validate(req).unwrap_err().code, ErrorCode::TooLarge);
        let just_fits = "x".repeat(MAX_ARGV_ENV_BYTES - "true".len() - 2);
        assert!(validate(argv(&["true", &just_fits])).is_ok());
    }

    #[test]
    fn timeout_and_output_cap_are_taken() {
        let mut req = argv(&["true"]);
        req.timeout_ms = 1500;
        req.max_output_bytes = 10;
        let spec = validate(req).unwrap();
        assert_eq!(spec.timeout, Some(Duration::from_millis(1500)));
        assert_eq!(spec.max_output_bytes, 10);
    }

    #[test]
    fn a_sandbox_id_joins_the_base_environment_and_env_can_override_it() {
        let spec = ExecSpec::validate(argv(&["env"]), base_env("sb-1"), None).unwrap();
        assert!(spec.env.contains(&(SANDBOX_ID_ENV.into(), "sb-1".into())));
        let mut req = argv(&["env"]);
        req.env.insert(SANDBOX_ID_ENV.into(), "mine".into());
        let spec = ExecSpec::validate(req, base_env("sb-1"), None).unwrap();
        assert!(spec.env.contains(&(SANDBOX_ID_ENV.into(), "mine".into())));
        let spec = validate(argv(&["env"])).unwrap();
        assert!(!spec.env.iter().any(|(k, _)| k == SANDBOX_ID_ENV));
    }

    #[test]
    fn an_account_brings_its_home_user_and_default_cwd() {
        let account = Account {
            name: "user".into(),
            uid: 1000,
            gid: 1000,
            groups: vec![1000],
            home: "/".into(),
            lock_down: false,
        };
        let mut req = argv(&["env"]);
        req.env.insert("USER".into(), "mine".into());
        let spec = ExecSpec::validate(req, base_env(""), Some(account.clone())).unwrap();
        assert!(spec.env.contains(&("HOME".into(), "/".into())));
        assert!(spec.env.contains(&("LOGNAME".into(), "user".into())));
        assert!(spec.env.contains(&("USER".into(), "mine".into())));
        assert_eq!(spec.cwd, "/");
        let gone = Account {
            home: "/nonexistent/home".into(),
            ..account
        };
        let spec = ExecSpec::validate(argv(&["true"]), base_env(""), Some(gone)).unwrap();
        assert_eq!(spec.cwd, "/");
        assert_eq!(spec.account.unwrap().uid, 1000);
    }

    #[test]
    fn keep_on_disconnect_is_taken() {
        let spec = validate(argv(&["true"]).with_keep_on_disconnect(true)).unwrap();
        assert!(spec.keep_on_disconnect);
        assert!(!validate(argv(&["true"])).unwrap().keep_on_disconnect);
    }
}
