//! Protocol tests of Reseed against the real agent in host mode: validation, what host mode
//! does and must not do (never this machine's RNG or host name), the sandbox id file, its
//! export to later executions and to Ready, and the capability.

mod common;

use airlock_proto::pb::ErrorCode;
use airlock_proto::{MAX_RESEED_ENTROPY, MIN_RESEED_ENTROPY, Requests};
use common::*;

const ENTROPY: [u8; 32] = [0x5a; 32];

fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .expect("read the host name")
        .trim()
        .to_owned()
}

fn reseed_error(c: &mut Client, entropy: &[u8], hostname: &str, id: &str) -> Option<ErrorCode> {
    c.reseed(entropy, hostname, id).err().map(|e| {
        e.agent_code()
            .unwrap_or_else(|| panic!("not an agent error: {e}"))
    })
}

#[test]
fn reseed_and_attach_are_advertised() {
    let agent = AgentProcess::start();
    let c = agent.client();
    let caps = &c.ready().capabilities;
    assert!(caps.iter().any(|c| c == "reseed"), "{caps:?}");
    assert!(caps.iter().any(|c| c == "attach"), "{caps:?}");
    assert_eq!(c.ready().sandbox_id, "");
}

#[test]
fn entropy_must_be_16_to_512_bytes() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let invalid = Some(ErrorCode::InvalidArgument);
    for len in [0, 1, MIN_RESEED_ENTROPY - 1, MAX_RESEED_ENTROPY + 1, 4096] {
        assert_eq!(
            reseed_error(&mut c, &vec![1; len], "", ""),
            invalid,
            "{len}"
        );
    }
    for len in [MIN_RESEED_ENTROPY, MAX_RESEED_ENTROPY] {
        assert_eq!(reseed_error(&mut c, &vec![1; len], "", ""), None, "{len}");
    }
}

#[test]
fn bad_host_names_are_invalid() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let long_label = "a".repeat(64);
    let too_long = format!("{}.{}", "a".repeat(40), "b".repeat(30));
    for bad in [
        "-lead",
        "trail-",
        "under_score",
        "two..dots",
        "sp ace",
        "slash/",
        long_label.as_str(),
        too_long.as_str(),
    ] {
        assert_eq!(
            reseed_error(&mut c, &ENTROPY, bad, ""),
            Some(ErrorCode::InvalidArgument),
            "{bad:?}"
        );
    }
}

#[test]
fn bad_sandbox_ids_are_invalid() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let too_long = "x".repeat(65);
    for bad in [
        "a/b",
        "../x",
        "sp ace",
        "new\nline",
        "colon:",
        too_long.as_str(),
    ] {
        assert_eq!(
            reseed_error(&mut c, &ENTROPY, "", bad),
            Some(ErrorCode::InvalidArgument),
            "{bad:?}"
        );
    }
}

#[test]
fn an_invalid_field_means_nothing_is_done() {
    let agent = AgentProcess::start_with_state_dir();
    let mut c = agent.client();
    let err = reseed_error(&mut c, &ENTROPY, "bad_name", "sb-1");
    assert_eq!(err, Some(ErrorCode::InvalidArgument));
    let state = agent.state_dir.as_ref().expect("state dir");
    assert!(!state.join("sandbox-id").exists());
    let out = run(&mut c, shell("echo \"[$AIRLOCK_SANDBOX_ID]\""));
    assert_eq!(out.stdout_str(), "[]\n");
}

#[test]
fn host_mode_never_touches_this_machines_rng_or_host_name() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let before = machine_hostname();
    let done = c
        .reseed(&ENTROPY, "airlock-reseed-test", "")
        .expect("reseed");
    assert!(!done.rng_reseeded, "{done:?}");
    assert!(!done.hostname_set, "{done:?}");
    assert!(!done.sandbox_id_set, "{done:?}");
    assert_eq!(done.sandbox_id_file, "");
    assert_eq!(machine_hostname(), before);
    assert_eq!(agent.client().ready().hostname, before);
}

#[test]
fn the_sandbox_id_is_written_and_exported_to_later_executions_and_ready() {
    let agent = AgentProcess::start_with_state_dir();
    let state = agent.state_dir.clone().expect("state dir");
    let mut c = agent.client();
    let done = c.reseed(&ENTROPY, "", "sb-42.a_b").expect("reseed");
    assert!(done.sandbox_id_set, "{done:?}");
    let file = state.join("sandbox-id");
    assert_eq!(done.sandbox_id_file, file.to_str().expect("utf-8"));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "sb-42.a_b\n");
    let script = format!("echo \"$AIRLOCK_SANDBOX_ID\"; cat {}", file.display());
    let out = run(&mut c, shell(&script));
    assert_eq!(out.stdout_str(), "sb-42.a_b\nsb-42.a_b\n");
    assert_eq!(agent.client().ready().sandbox_id, "sb-42.a_b");
    // A later Reseed replaces it whole; Exec.env still overrides it.
    c.reseed(&ENTROPY, "", "sb-43").expect("second reseed");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "sb-43\n");
    let mut exec = shell("echo \"$AIRLOCK_SANDBOX_ID\"");
    exec.env
        .insert("AIRLOCK_SANDBOX_ID".into(), "overridden".into());
    assert_eq!(run(&mut c, exec).stdout_str(), "overridden\n");
    assert_eq!(
        run(&mut c, shell("echo \"$AIRLOCK_SANDBOX_ID\"")).stdout_str(),
        "sb-43\n"
    );
    // Only the file itself is left behind, no temporary.
    let names: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, ["sandbox-id"]);
}

#[test]
fn without_a_state_dir_the_sandbox_id_is_exported_but_not_written() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let done = c.reseed(&ENTROPY, "", "sb-7").expect("reseed");
    assert!(done.sandbox_id_set);
    assert_eq!(done.sandbox_id_file, "");
    let out = run(&mut c, shell("echo \"$AIRLOCK_SANDBOX_ID\""));
    assert_eq!(out.stdout_str(), "sb-7\n");
}
