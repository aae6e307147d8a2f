//! `airlock run-code` and `airlock code-context` against the mock: streamed output, text
//! results, images saved to files, errors, exit codes, `--json` lines, and the requests sent.

use super::*;

/// A 1x1 PNG, base64 (as Jupyter sends image/png).
pub const PNG_B64: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==";

fn ev(e: run_code_event::Event) -> RunCodeEvent {
    RunCodeEvent { event: Some(e) }
}

fn out(text: &str, ns: i64) -> CodeOutput {
    CodeOutput {
        text: text.into(),
        timestamp_unix_ns: ns,
    }
}

fn result(data: &[(&str, &str)], main: bool, chart: &str) -> run_code_event::Event {
    run_code_event::Event::Result(CodeResult {
        data: data
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
        is_main_result: main,
        chart: chart.into(),
        extra: String::new(),
    })
}

fn end(state: CodeState, count: u32, reason: &str) -> run_code_event::Event {
    run_code_event::Event::End(CodeEnd {
        state: state as i32,
        execution_count: count,
        context_id: "ctx-py".into(),
        error_reason: reason.into(),
        error_message: if reason.is_empty() {
            ""
        } else {
            "the cell took too long"
        }
        .into(),
        duration_ms: 42,
    })
}

/// The events of a cell, chosen by its source: `raise`, `sleep` (with a timeout), `oom`, and
/// otherwise a cell that prints, plots, shows a table and ends with a value.
pub fn cell_events(r: &RunCodeRequest) -> Vec<RunCodeEvent> {
    use run_code_event::Event as E;
    let evs = if r.code.contains("raise") {
        vec![
            E::Stdout(out("before\n", 1)),
            E::Error(CodeError {
                name: "ZeroDivisionError".into(),
                value: "division by zero".into(),
                traceback: "Traceback (most recent call last):\n  Cell In[3], line 2\n    1/0\n"
                    .into(),
            }),
            end(CodeState::Error, 3, ""),
        ]
    } else if r.timeout_ms > 0 {
        vec![
            E::Stdout(out("tick\n", 1)),
            end(CodeState::TimedOut, 4, "EXEC_TIMEOUT"),
        ]
    } else if r.code.contains("oom") {
        vec![
            E::Error(CodeError {
                name: "OomKilled".into(),
                value: "the kernel was killed by the memory limit".into(),
                traceback: String::new(),
            }),
            end(CodeState::OomKilled, 0, "OOM_KILLED"),
        ]
    } else {
        vec![
            E::Stdout(out("hello\n", 1_700_000_000_000_000_001)),
            E::Stderr(out("warn\n", 1_700_000_000_000_000_002)),
            result(
                &[
                    ("text/plain", "<Figure size 640x480 with 1 Axes>"),
                    ("image/png", PNG_B64),
                    (
                        "image/svg+xml",
                        "<svg xmlns=\"http://www.w3.org/2000/svg\"/>",
                    ),
                ],
                false,
                r#"{"type":"line","title":"t"}"#,
            ),
            result(&[("text/html", "<table></table>")], false, ""),
            result(&[("text/plain", "2"), ("text/markdown", "**2**")], true, ""),
            end(CodeState::Ok, 1, ""),
        ]
    };
    evs.into_iter().map(ev).collect()
}

pub fn context(id: &str, language: &str, cwd: &str) -> CodeContext {
    CodeContext {
        id: id.into(),
        language: if language.is_empty() {
            "python"
        } else {
            language
        }
        .into(),
        cwd: if cwd.is_empty() { "/home/user" } else { cwd }.into(),
    }
}

#[tokio::test]
async fn run_code_streams_prints_text_and_saves_images() {
    let d = Daemon::start();
    std::fs::write(d.dir.join("cell.py"), "print('hello')\n1+1\n").unwrap();
    let p = d
        .airlock(&[
            "run-code",
            "sb-1",
            "cell.py",
            "--context",
            "ctx-py",
            "--env",
            "A=1",
            "--out-dir",
            "figs",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(
        text(&p.stdout),
        "hello\n<Figure size 640x480 with 1 Axes>\nfigs/result-1.png\nfigs/result-1.svg\n2\n"
    );
    assert_eq!(
        text(&p.stderr),
        "warn\nairlock: result 2 has no text or file (text/html); --json shows it\n"
    );
    let png = std::fs::read(d.dir.join("figs/result-1.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        std::fs::read_to_string(d.dir.join("figs/result-1.svg"))
            .unwrap()
            .starts_with("<svg")
    );
    let req = d.seen().run_code.clone().unwrap();
    assert_eq!(
        (
            req.sandbox_id.as_str(),
            req.code.as_str(),
            req.context_id.as_str(),
            req.language.as_str(),
            req.timeout_ms
        ),
        ("sb-1", "print('hello')\n1+1\n", "ctx-py", "", 0)
    );
    assert_eq!(req.env.get("A").map(String::as_str), Some("1"));

    // The default out dir is the current one.
    let p = d.airlock(&["run-code", "sb-1", "cell.py"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert!(
        text(&p.stdout).contains("\nresult-1.png\n"),
        "{}",
        text(&p.stdout)
    );
    assert!(d.dir.join("result-1.png").is_file());
}

#[tokio::test]
async fn run_code_reads_stdin_and_prints_json_lines() {
    let d = Daemon::start();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_airlock"))
        .args(["--json", "run-code", "sb-1", "-", "--language", "bash"])
        .env(
            "AIRLOCK_ADDR",
            format!("unix://{}", d.dir.join("d.sock").display()),
        )
        .env_remove("AIRLOCK_TOKEN")
        .current_dir(&d.dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"echo hello\n").await.unwrap();
    }
    let p = child.wait_with_output().await.unwrap();
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let lines: Vec<serde_json::Value> = text(&p.stdout)
        .lines()
        .map(|l| json(l.as_bytes()))
        .collect();
    let kinds: Vec<&str> = lines.iter().map(|v| v["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["stdout", "stderr", "result", "result", "result", "end"]
    );
    assert_eq!(lines[0]["text"], "hello\n");
    assert_eq!(lines[0]["timestamp_unix_ns"], 1_700_000_000_000_000_001_i64);
    assert_eq!(lines[2]["data"]["image/png"], PNG_B64);
    assert_eq!(lines[2]["chart"]["type"], "line");
    assert_eq!(lines[4]["is_main_result"], true);
    assert_eq!(
        (
            lines[5]["state"].as_str(),
            lines[5]["execution_count"].as_u64()
        ),
        (Some("ok"), Some(1))
    );
    assert!(!d.dir.join("result-1.png").exists(), "--json saves nothing");
    let req = d.seen().run_code.clone().unwrap();
    assert_eq!(
        (req.code.as_str(), req.language.as_str()),
        ("echo hello\n", "bash")
    );
}

#[tokio::test]
async fn run_code_errors_timeouts_and_oom_have_their_exit_codes() {
    let d = Daemon::start();
    std::fs::write(d.dir.join("raise.py"), "print('before')\nraise 1/0\n").unwrap();
    let p = d.airlock(&["run-code", "sb-1", "raise.py"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert_eq!(text(&p.stdout), "before\n");
    let err = text(&p.stderr);
    assert!(
        err.starts_with("Traceback (most recent call last):\n"),
        "{err}"
    );
    assert!(
        err.ends_with("    1/0\nZeroDivisionError: division by zero\n"),
        "{err}"
    );

    std::fs::write(d.dir.join("slow.py"), "import time; time.sleep(60)\n").unwrap();
    let p = d
        .airlock(&["run-code", "sb-1", "slow.py", "--timeout", "2"])
        .await;
    assert_eq!(p.status.code(), Some(124));
    assert!(
        text(&p.stderr).contains("EXEC_TIMEOUT"),
        "{}",
        text(&p.stderr)
    );
    assert_eq!(d.seen().run_code.as_ref().unwrap().timeout_ms, 2000);

    std::fs::write(d.dir.join("oom.py"), "oom = bytearray(1 << 40)\n").unwrap();
    let p = d.airlock(&["run-code", "sb-1", "oom.py"]).await;
    assert_eq!(p.status.code(), Some(137));
    assert!(
        text(&p.stderr).contains("OomKilled: "),
        "{}",
        text(&p.stderr)
    );
    assert!(
        text(&p.stderr).contains("OOM_KILLED"),
        "{}",
        text(&p.stderr)
    );

    let p = d.airlock(&["run-code", "sb-0", "oom.py"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(text(&p.stderr).contains("SANDBOX_NOT_FOUND"));

    let p = d.airlock(&["run-code", "sb-1", "absent.py"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(text(&p.stderr).starts_with("airlock: absent.py: "));

    let p = d
        .airlock(&[
            "run-code",
            "sb-1",
            "oom.py",
            "--language",
            "python",
            "--context",
            "c",
        ])
        .await;
    assert_eq!(
        p.status.code(),
        Some(2),
        "--language and --context conflict"
    );
}

#[tokio::test]
async fn code_contexts_are_made_listed_restarted_and_removed() {
    let d = Daemon::start();
    let p = d
        .airlock(&[
            "code-context",
            "create",
            "sb-1",
            "--language",
            "javascript",
            "--cwd",
            "/tmp",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stdout), "ctx-1\n");
    let p = d
        .airlock(&["--json", "code-context", "create", "sb-1"])
        .await;
    assert_eq!(
        json(&p.stdout),
        serde_json::json!({"id": "ctx-2", "language": "python", "cwd": "/home/user"})
    );
    let p = d.airlock(&["code-context", "ls", "sb-1"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let out = text(&p.stdout);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].starts_with("CONTEXT"), "{out}");
    assert!(
        lines[1].starts_with("ctx-1")
            && lines[1].contains("javascript")
            && lines[1].ends_with("/tmp"),
        "{out}"
    );
    let p = d
        .airlock(&["code-context", "restart", "sb-1", "ctx-1"])
        .await;
    assert_eq!((p.status.code(), text(&p.stdout)), (Some(0), String::new()));
    let p = d
        .airlock(&["--json", "code-context", "rm", "sb-1", "ctx-1"])
        .await;
    assert_eq!(json(&p.stdout)["removed"], true);
    let j = json(
        &d.airlock(&["--json", "code-context", "ls", "sb-1"])
            .await
            .stdout,
    );
    assert_eq!(j.as_array().unwrap().len(), 1);
    assert_eq!(j[0]["id"], "ctx-2");
    let p = d.airlock(&["code-context", "rm", "sb-1", "ctx-9"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(
        text(&p.stderr).contains("CONTEXT_NOT_FOUND"),
        "{}",
        text(&p.stderr)
    );
    assert_eq!(
        d.seen().code_contexts,
        [
            "create javascript /tmp",
            "create  ",
            "restart ctx-1",
            "rm ctx-1",
            "rm ctx-9"
        ]
    );
}

#[tokio::test]
async fn help_and_completions_name_the_interpreter_commands() {
    let d = Daemon::start();
    let p = d.airlock(&["--help"]).await;
    assert!(text(&p.stdout).contains("run-code"), "{}", text(&p.stdout));
    assert!(text(&p.stdout).contains("code-context"));
    let p = d.airlock(&["run-code", "--help"]).await;
    assert_eq!(p.status.code(), Some(0));
    for flag in [
        "--language",
        "--context",
        "--env",
        "--timeout",
        "--out-dir",
        "Exit status",
    ] {
        assert!(
            text(&p.stdout).contains(flag),
            "{flag}: {}",
            text(&p.stdout)
        );
    }
    let p = d.airlock(&["code-context", "--help"]).await;
    for sub in ["create", "ls", "restart", "rm"] {
        assert!(text(&p.stdout).contains(sub), "{sub}");
    }
    let p = d.airlock(&["completions", "bash"]).await;
    assert!(text(&p.stdout).contains("run-code"));
    assert!(text(&p.stdout).contains("code-context"));
    assert!(text(&p.stdout).contains("--out-dir"));
}
