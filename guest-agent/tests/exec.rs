//! Protocol tests of executions against the real agent in host mode (process groups, no
//! cgroups): argv and shell, streams and offsets, exit codes and signals, stdin, env, cwd,
//! timeout, Signal, big and binary output, the output cap, limits and errors.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use airlock_proto::pb::{self, ErrorCode, request, response};
use airlock_proto::{MAX_ARGV_ENV_BYTES, MAX_CONCURRENT_EXECS, MAX_OUTPUT_CHUNK, Requests};
use common::*;

#[test]
fn argv_runs_directly_and_reports_exit_zero() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let out = run(&mut c, argv(&["echo", "hello", "world"]));
    assert_eq!(out.stdout, b"hello world\n");
    assert!(out.stderr.is_empty());
    assert_eq!(exit_code(&out.exit), Some(0));
    assert_eq!(out.exit.stdout_bytes, 12);
    assert!(!out.exit.timed_out && !out.exit.killed && !out.exit.output_truncated);
    assert!(out.exit.wall_us > 0);
}

#[test]
fn shell_runs_with_bin_sh_and_exit_code_three() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let out = run(&mut c, shell("echo out; echo err >&2; exit 3"));
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(exit_code(&out.exit), Some(3));
    assert_eq!(out.exit.stderr_bytes, 4);
}

#[test]
fn stdout_and_stderr_arrive_separately_in_order_with_offsets() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(shell(
            "for i in 1 2 3 4 5; do echo o$i; echo e$i >&2; sleep 0.02; done",
        )))
        .unwrap();
    let started = c.exec_started(id).unwrap();
    let mut next_offset = [0u64; 2];
    let mut text = [String::new(), String::new()];
    loop {
        let resp = c.recv_for(id).unwrap();
        match resp.kind.unwrap() {
            response::Kind::Output(o) => {
                assert_eq!(o.exec_id, started.exec_id);
                let s = usize::try_from(o.stream - 1).unwrap();
                assert_eq!(o.offset, next_offset[s], "offsets must be contiguous");
                assert!(o.data.len() <= MAX_OUTPUT_CHUNK);
                next_offset[s] += o.data.len() as u64;
                text[s].push_str(std::str::from_utf8(&o.data).unwrap());
            }
            response::Kind::ExecExit(e) => {
                assert_eq!(e.stdout_bytes, next_offset[0]);
                assert_eq!(e.stderr_bytes, next_offset[1]);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(text[0], "o1\no2\no3\no4\no5\n");
    assert_eq!(text[1], "e1\ne2\ne3\ne4\ne5\n");
}

#[test]
fn a_process_killed_by_a_signal_reports_the_signal() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let out = run(&mut c, shell("kill -TERM $$"));
    assert_eq!(exit_signal(&out.exit), Some(libc::SIGTERM));
    assert!(!out.exit.killed);
}

#[test]
fn stdin_data_is_written_and_closed() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = argv(&["cat"]);
    exec.stdin = b"from the host\n".to_vec();
    let out = run(&mut c, exec);
    assert_eq!(out.stdout, b"from the host\n");
    assert_eq!(exit_code(&out.exit), Some(0));
}

#[test]
fn the_process_starts_with_no_blocked_signals_and_umask_022() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let out = run(&mut c, argv(&["grep", "SigBlk", "/proc/self/status"]));
    assert_eq!(out.stdout_str().trim(), "SigBlk:\t0000000000000000");
    let out = run(&mut c, shell("umask"));
    assert_eq!(out.stdout_str().trim(), "0022");
}

#[test]
fn a_shell_can_wait_for_its_background_jobs() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let out = run(&mut c, shell("(sleep 0.2; echo bg) & wait; echo after"));
    assert_eq!(out.stdout, b"bg\nafter\n");
}

#[test]
fn without_stdin_the_process_reads_eof() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let out = run(&mut c, shell("cat; echo done"));
    assert_eq!(out.stdout, b"done\n");
}

#[test]
fn stdin_open_takes_stdin_requests_until_eof() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = argv(&["cat"]);
    exec.stdin = b"first ".to_vec();
    exec.stdin_open = true;
    let id = c.send_kind(request::Kind::Exec(exec)).unwrap();
    let started = c.exec_started(id).unwrap();
    c.stdin(started.exec_id, b"second ", false).unwrap();
    c.stdin(started.exec_id, b"third", true).unwrap();
    // After eof, stdin is closed for good.
    let err = c.stdin(started.exec_id, b"late", false).unwrap_err();
    assert!(
        matches!(
            err.agent_code(),
            Some(ErrorCode::InvalidArgument | ErrorCode::NotFound)
        ),
        "{err:?}"
    );
    let mut stdout = Vec::new();
    let exit = loop {
        match c.recv_for(id).unwrap().kind.unwrap() {
            response::Kind::Output(o) => stdout.extend(o.data),
            response::Kind::ExecExit(e) => break e,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(stdout, b"first second third");
    assert_eq!(exit_code(&exit), Some(0));
}

#[test]
fn stdin_to_an_execution_without_open_stdin_is_refused() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(argv(&["sleep", "5"])))
        .unwrap();
    let started = c.exec_started(id).unwrap();
    let err = c.stdin(started.exec_id, b"x", false).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::InvalidArgument));
    c.signal(started.exec_id, libc::SIGKILL).unwrap();
}

#[test]
fn stdin_and_signal_for_an_unknown_execution_are_not_found() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let err = c.stdin(999, b"x", false).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::NotFound));
    let err = c.signal(999, libc::SIGTERM).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::NotFound));
}

#[test]
fn env_starts_from_the_base_and_takes_overrides() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = argv(&["env"]);
    exec.env.insert("FOO".into(), "bar baz".into());
    exec.env.insert("HOME".into(), "/tmp".into());
    let out = run(&mut c, exec);
    let mut lines: Vec<_> = out.stdout_str().lines().map(String::from).collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "FOO=bar baz",
            "HOME=/tmp",
            "LANG=C.UTF-8",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "TERM=dumb",
        ]
    );
}

#[test]
fn cwd_is_used_and_defaults_to_root() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = argv(&["pwd"]);
    exec.cwd = agent.dir.path().to_str().unwrap().to_owned();
    let out = run(&mut c, exec);
    assert_eq!(out.stdout_str().trim(), agent.dir.path().to_str().unwrap());
    let out = run(&mut c, argv(&["pwd"]));
    assert_eq!(out.stdout_str().trim(), "/");
}

#[test]
fn missing_program_is_not_found_without_exec_started() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(argv(&["/nonexistent/program"])))
        .unwrap();
    let resp = c.recv_for(id).unwrap();
    match resp.kind.unwrap() {
        response::Kind::Error(e) => assert_eq!(e.code, ErrorCode::NotFound as i32),
        other => panic!("expected Error, got {other:?}"),
    }
    // The agent is still fine.
    assert_eq!(exit_code(&run(&mut c, argv(&["true"])).exit), Some(0));
}

#[test]
fn program_looked_up_in_path_missing_is_not_found() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let err = c
        .exec_collect(argv(&["airlock-no-such-program"]), |_, _| {})
        .unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::NotFound));
}

#[test]
fn missing_cwd_is_not_found() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = argv(&["true"]);
    exec.cwd = "/nonexistent-dir".into();
    let err = c.exec_collect(exec, |_, _| {}).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::NotFound));
}

#[test]
fn non_executable_program_is_permission_denied() {
    let agent = AgentProcess::start();
    let script = agent.dir.join("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
    let mut c = agent.client();
    let err = c
        .exec_collect(argv(&[script.to_str().unwrap()]), |_, _| {})
        .unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::PermissionDenied));
}

#[test]
fn empty_exec_is_invalid_argument() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let err = c.exec_collect(pb::Exec::default(), |_, _| {}).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::InvalidArgument));
}

#[test]
fn argv_larger_than_one_mib_is_too_large() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let big = "x".repeat(MAX_ARGV_ENV_BYTES);
    let err = c
        .exec_collect(argv(&["echo", &big]), |_, _| {})
        .unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::TooLarge));
    let mut exec = argv(&["true"]);
    exec.env.insert("BIG".into(), big);
    let err = c.exec_collect(exec, |_, _| {}).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::TooLarge));
}

#[test]
fn timeout_kills_the_process_group_in_about_the_timeout() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = argv(&["sleep", "600"]);
    exec.timeout_ms = 1000;
    let id = c.send_kind(request::Kind::Exec(exec)).unwrap();
    let began = Instant::now();
    let started = c.exec_started(id).unwrap();
    let exit = wait_exit(&mut c, id);
    let took = began.elapsed();
    assert!(exit.timed_out, "{exit:?}");
    assert!(!exit.killed);
    assert_eq!(exit_signal(&exit), Some(libc::SIGKILL));
    assert!(took >= Duration::from_millis(900), "ended after {took:?}");
    assert!(took < Duration::from_secs(10), "ended after {took:?}");
    assert!(
        (900_000..10_000_000).contains(&exit.wall_us),
        "{}",
        exit.wall_us
    );
    assert!(!exists(started.pid), "the process is still there");
    // Descendants die with it, and are reaped by the agent (their subreaper) shortly after.
    assert!(
        eventually(Duration::from_secs(10), || group_members(started.pid)
            .is_empty()),
        "{:?}",
        group_members(started.pid)
    );
}

#[test]
fn extreme_timeout_and_cap_values_are_harmless() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = argv(&["echo", "fine"]);
    exec.timeout_ms = u64::MAX;
    exec.max_output_bytes = u64::MAX;
    let out = run(&mut c, exec);
    assert_eq!(out.stdout, b"fine\n");
    assert!(!out.exit.timed_out);
}

#[test]
fn sigkill_kills_the_shell_and_its_background_child() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(shell("sleep 600 & echo $!; sleep 600")))
        .unwrap();
    let started = c.exec_started(id).unwrap();
    let background = first_stdout_line(&mut c, id).parse::<u32>().unwrap();
    assert!(alive(background));
    c.signal(started.exec_id, libc::SIGKILL).unwrap();
    let exit = wait_exit(&mut c, id);
    assert!(exit.killed, "{exit:?}");
    assert!(!exit.timed_out);
    assert_eq!(exit_signal(&exit), Some(libc::SIGKILL));
    // The orphaned background sleep was killed and, the agent being its subreaper, reaped.
    assert!(
        eventually(Duration::from_secs(10), || !exists(background)),
        "background child {background} survived"
    );
    // The foreground sleep was killed too; it may still wait to be reaped for a moment.
    assert!(
        eventually(Duration::from_secs(10), || group_members(started.pid)
            .is_empty()),
        "{:?}",
        group_members(started.pid)
    );
}

#[test]
fn sigterm_is_delivered_to_the_process_group() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(shell(
            "trap 'echo got-term; exit 7' TERM; echo ready; while :; do sleep 0.05; done",
        )))
        .unwrap();
    let started = c.exec_started(id).unwrap();
    assert_eq!(first_stdout_line(&mut c, id), "ready");
    c.signal(started.exec_id, libc::SIGTERM).unwrap();
    let (stdout, exit) = collect_rest(&mut c, id);
    assert_eq!(stdout, b"got-term\n");
    assert_eq!(exit_code(&exit), Some(7));
    assert!(!exit.killed);
}

#[test]
fn invalid_signal_number_is_invalid_argument() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let id = c
        .send_kind(request::Kind::Exec(argv(&["sleep", "5"])))
        .unwrap();
    let started = c.exec_started(id).unwrap();
    let err = c.signal(started.exec_id, 1000).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::InvalidArgument));
    c.signal(started.exec_id, libc::SIGKILL).unwrap();
    assert!(wait_exit(&mut c, id).killed);
}

#[test]
fn leftover_background_processes_die_with_the_main_process() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let began = Instant::now();
    let out = run(&mut c, shell("sleep 600 & echo $!"));
    assert!(began.elapsed() < Duration::from_secs(10));
    assert_eq!(exit_code(&out.exit), Some(0));
    let background: u32 = out.stdout_str().trim().parse().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || !exists(background)),
        "background child {background} survived its execution"
    );
}

#[test]
fn ten_megabytes_of_output_arrive_intact() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let data = pseudo_random(10 << 20);
    let path = agent.dir.str("big.bin");
    c.write_file(&path, &data).unwrap();
    let out = run(&mut c, argv(&["cat", &path]));
    assert_eq!(out.exit.stdout_bytes, data.len() as u64);
    assert!(out.stdout == data, "10 MB output differs");
    assert!(!out.exit.output_truncated);
}

#[test]
fn every_byte_value_passes_through_stdin_and_stdout_untouched() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let all: Vec<u8> = (0..=255u8).collect();
    let mut exec = argv(&["cat"]);
    exec.stdin.clone_from(&all);
    let out = run(&mut c, exec);
    assert_eq!(out.stdout, all);
    let path = agent.dir.str("bytes.bin");
    c.write_file(&path, &all).unwrap();
    let out = run(&mut c, argv(&["cat", &path]));
    assert_eq!(out.stdout, all);
}

#[test]
fn output_past_the_cap_is_counted_but_not_sent() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut exec = shell("head -c 100000 /dev/zero; head -c 10 /dev/zero >&2");
    exec.max_output_bytes = 1000;
    let out = run(&mut c, exec);
    assert_eq!(out.stdout.len(), 1000);
    assert_eq!(out.stderr.len(), 10);
    assert_eq!(out.exit.stdout_bytes, 100_000);
    assert_eq!(out.exit.stderr_bytes, 10);
    assert!(out.exit.output_truncated);
    assert_eq!(exit_code(&out.exit), Some(0));
}

#[test]
fn concurrent_executions_interleave_without_mixing() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut ids = HashMap::new();
    for name in ["a", "b", "c"] {
        let script = format!("for i in 1 2 3 4 5 6 7 8; do echo {name}$i; sleep 0.03; done");
        let id = c.send_kind(request::Kind::Exec(shell(&script))).unwrap();
        ids.insert(id, name);
    }
    let mut text: HashMap<u64, String> = HashMap::new();
    let mut exits = 0;
    while exits < ids.len() {
        let resp = c.recv().unwrap();
        assert!(ids.contains_key(&resp.id), "response to {}", resp.id);
        match resp.kind.unwrap() {
            response::Kind::Output(o) => text
                .entry(resp.id)
                .or_default()
                .push_str(std::str::from_utf8(&o.data).unwrap()),
            response::Kind::ExecExit(e) => {
                assert_eq!(exit_code(&e), Some(0));
                exits += 1;
            }
            response::Kind::ExecStarted(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    for (id, name) in ids {
        let expected: String = (1..=8).map(|i| format!("{name}{i}\n")).collect();
        assert_eq!(text[&id], expected);
    }
}

#[test]
fn more_than_sixty_four_executions_at_once_is_limit_exceeded() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let mut started = Vec::new();
    for _ in 0..MAX_CONCURRENT_EXECS {
        let id = c
            .send_kind(request::Kind::Exec(argv(&["sleep", "600"])))
            .unwrap();
        started.push((id, c.exec_started(id).unwrap().exec_id));
    }
    let err = c.exec_collect(argv(&["true"]), |_, _| {}).unwrap_err();
    assert_eq!(err.agent_code(), Some(ErrorCode::LimitExceeded));
    for &(_, exec_id) in &started {
        c.signal(exec_id, libc::SIGKILL).unwrap();
    }
    for &(id, _) in &started {
        assert!(wait_exit(&mut c, id).killed);
    }
    // Places are given back before ExecExit is sent.
    assert_eq!(exit_code(&run(&mut c, argv(&["true"])).exit), Some(0));
}

#[test]
fn exec_accounting_reports_cpu_time_of_a_busy_process() {
    let agent = AgentProcess::start();
    let mut c = agent.client();
    let out = run(
        &mut c,
        shell("i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"),
    );
    assert_eq!(exit_code(&out.exit), Some(0));
    assert!(
        out.exit.cpu_user_us + out.exit.cpu_system_us > 0,
        "{:?}",
        out.exit
    );
    assert!(out.exit.peak_memory_bytes > 0);
}

/// Reads responses to exec request `id` until the first complete stdout line.
fn first_stdout_line(c: &mut Client, id: u64) -> String {
    let mut buf = Vec::new();
    while !buf.contains(&b'\n') {
        match next_kind(c, id) {
            response::Kind::Output(o) if o.stream == pb::StreamKind::Stdout as i32 => {
                buf.extend(o.data);
            }
            response::Kind::Output(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    String::from_utf8_lossy(line).into_owned()
}

/// Reads stdout and the exit of exec request `id`.
fn collect_rest(c: &mut Client, id: u64) -> (Vec<u8>, pb::ExecExit) {
    let mut stdout = Vec::new();
    loop {
        match next_kind(c, id) {
            response::Kind::Output(o) if o.stream == pb::StreamKind::Stdout as i32 => {
                stdout.extend(o.data);
            }
            response::Kind::Output(_) => {}
            response::Kind::ExecExit(e) => return (stdout, e),
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn wait_exit(c: &mut Client, id: u64) -> pb::ExecExit {
    collect_rest(c, id).1
}

/// Deterministic bytes that do not compress to a pattern.
fn pseudo_random(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
