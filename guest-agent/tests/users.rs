//! Executions and file requests as an unprivileged account (`Exec.user`, the file requests'
//! `user`), against the real agent in host mode. The agent must run as root (as it does as PID 1),
//! and the host must have the usual `nobody` account (uid 65534).

mod common;

use airlock_proto::Requests;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use airlock_proto::ClientError;
use airlock_proto::pb::{self, ErrorCode, request};
use common::*;

const NOBODY_UID: u32 = 65534;

fn require_root() {
    // SAFETY: geteuid(2) has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "these tests need root: the agent switches accounts as PID 1 does"
    );
}

/// The value of `field` in /proc/self/status as the execution saw it.
fn status_field(status: &str, field: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {field} in {status}"))
        .trim()
        .to_owned()
}

fn as_user(mut exec: pb::Exec, user: &str) -> pb::Exec {
    exec.user = user.into();
    exec
}

fn code<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ErrorCode {
    match r {
        Err(ClientError::Agent { code, .. }) => code,
        other => panic!("expected an agent error, got {other:?}"),
    }
}

/// Keeps root out of reach from now on (as the daemon does for a sandbox created with
/// `no_root`); the agent confirms it.
fn forbid_root(c: &mut impl Requests) {
    let done = c
        .reseed_with(pb::Reseed {
            entropy: vec![7; 32],
            no_root: true,
            ..Default::default()
        })
        .expect("Reseed with no_root");
    assert!(done.no_root, "{done:?}");
}

#[test]
fn an_account_runs_with_its_ids_and_no_capabilities_and_is_locked_down_without_root() {
    require_root();
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let status = || as_user(shell("cat /proc/self/status"), "nobody");
    let out = run(&mut c, status());
    assert_eq!(exit_code(&out.exit), Some(0), "{:?}", out.stderr);
    let before = out.stdout_str();
    let uids = status_field(&before, "Uid");
    assert_eq!(uids.split_whitespace().collect::<Vec<_>>(), ["65534"; 4]);
    assert_eq!(status_field(&before, "Groups"), "65534");
    for caps in ["CapInh", "CapPrm", "CapEff", "CapAmb"] {
        assert_eq!(status_field(&before, caps), "0000000000000000", "{caps}");
    }
    // Root is allowed (the default): the bounding set stays, so that sudo can work.
    assert_ne!(status_field(&before, "CapBnd"), "0000000000000000");
    assert_eq!(status_field(&before, "NoNewPrivs"), "0");
    forbid_root(&mut c);
    let after = run(&mut c, status()).stdout_str();
    for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(&after, caps), "0000000000000000", "{caps}");
    }
    assert_eq!(status_field(&after, "NoNewPrivs"), "1");
    let root = as_user(argv(&["true"]), "root");
    assert_eq!(code(c.start_exec(root)), ErrorCode::PermissionDenied);
    let read = pb::ReadFile {
        path: "/etc/hostname".into(),
        user: "root".into(),
        ..Default::default()
    };
    assert_eq!(
        code(c.call(request::Kind::ReadFile(read))),
        ErrorCode::PermissionDenied
    );
}

#[test]
fn an_account_gets_its_environment_and_its_home_or_slash_as_cwd() {
    require_root();
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let out = run(
        &mut c,
        as_user(shell("echo $HOME $USER $LOGNAME; pwd"), "nobody"),
    );
    // nobody's home, /nonexistent, does not exist: the cwd falls back to "/".
    assert_eq!(out.stdout_str(), "/nonexistent nobody nobody\n/\n");
    let out = run(&mut c, as_user(shell("echo $HOME; pwd; id -u"), "root"));
    assert_eq!(out.stdout_str(), "/root\n/root\n0\n");
}

#[test]
fn an_account_cannot_enter_a_cwd_it_may_not_and_root_can() {
    require_root();
    let agent = AgentProcess::start();
    let private = agent.dir.join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let mut c = agent.client();
    let mut exec = as_user(argv(&["true"]), "nobody");
    exec.cwd = private.to_str().unwrap().into();
    assert_eq!(
        code(c.start_exec(exec.clone())),
        ErrorCode::PermissionDenied
    );
    exec.user = "root".into();
    assert_eq!(exit_code(&run(&mut c, exec).exit), Some(0));
}

#[test]
fn a_setuid_binary_makes_an_account_root_unless_root_is_forbidden() {
    require_root();
    let agent = AgentProcess::start();
    // A setuid-root copy of `id` (as sudo is): it reports euid 0 where root is allowed.
    let id = agent.dir.join("id-setuid");
    std::fs::copy("/usr/bin/id", &id).unwrap();
    std::fs::set_permissions(&id, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let mut c = agent.client();
    let id_u = || as_user(argv(&[id.to_str().unwrap(), "-u"]), "nobody");
    let out = run(&mut c, id_u());
    assert_eq!(out.stdout_str(), "0\n", "{:?}", out.stderr);
    forbid_root(&mut c);
    let out = run(&mut c, id_u());
    assert_eq!(
        out.stdout_str(),
        format!("{NOBODY_UID}\n"),
        "{:?}",
        out.stderr
    );
}

#[test]
fn an_account_cannot_signal_or_trace_root_processes() {
    require_root();
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let script = format!(
        "kill -0 {} 2>/dev/null && echo signalled || echo refused",
        agent.pid()
    );
    let out = run(&mut c, as_user(shell(&script), "nobody"));
    assert_eq!(out.stdout_str(), "refused\n");
    let script = format!(
        "cat /proc/{}/environ >/dev/null 2>&1 && echo read || echo refused",
        agent.pid()
    );
    let out = run(&mut c, as_user(shell(&script), "nobody"));
    assert_eq!(out.stdout_str(), "refused\n");
}

#[test]
fn unknown_and_malformed_accounts_are_refused() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let unknown = as_user(argv(&["true"]), "no-such-account");
    assert_eq!(code(c.start_exec(unknown)), ErrorCode::NotFound);
    let bad = as_user(argv(&["true"]), "../etc");
    assert_eq!(code(c.start_exec(bad)), ErrorCode::InvalidArgument);
}

fn write(path: &str, user: &str) -> request::Kind {
    request::Kind::WriteFile(pb::WriteFile {
        path: path.into(),
        data: b"x".to_vec(),
        truncate: true,
        user: user.into(),
        ..Default::default()
    })
}

#[test]
fn file_requests_act_with_the_accounts_permissions_and_own_what_they_create() {
    require_root();
    let agent = AgentProcess::start();
    let shared = agent.dir.join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let mut c = agent.client();

    // The agent's temporary directory is root's, 0755: nobody may not create files there.
    let denied = c.call(write(&agent.dir.str("root-only"), "nobody"));
    assert_eq!(code(denied), ErrorCode::PermissionDenied);
    assert!(!agent.dir.join("root-only").exists());

    let mine = shared.join("mine");
    c.call(write(mine.to_str().unwrap(), "nobody")).unwrap();
    let meta = std::fs::metadata(&mine).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (NOBODY_UID, 65534));

    // The connection thread is root again afterwards.
    c.call(write(&agent.dir.str("root-only"), "")).unwrap();
    assert_eq!(
        std::fs::metadata(agent.dir.join("root-only"))
            .unwrap()
            .uid(),
        0
    );

    let read_root = request::Kind::ReadFile(pb::ReadFile {
        path: "/etc/shadow".into(),
        user: "nobody".into(),
        ..Default::default()
    });
    assert_eq!(code(c.call(read_root)), ErrorCode::PermissionDenied);
}
