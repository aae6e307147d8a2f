//! The interpreter commands' arguments, requests and output: `run-code`'s request, its saved
//! files, error text, exit codes and JSON lines; `code-context`'s parsing.

use airlock_api::v1::{
    CodeEnd, CodeError, CodeOutput, CodeResult, CodeState, RunCodeEvent, run_code_event,
};

use super::*;
use crate::args::CodeContextCommand;
use crate::commands::code::{
    end_exit_code, error_text, event_json, result_files, result_text, run_code_request,
};

fn run_code(args: &[&str]) -> crate::args::RunCodeArgs {
    let Command::RunCode(a) = parse(&[&["run-code"][..], args].concat()).command else {
        panic!("not run-code")
    };
    *a
}

fn bundle(data: &[(&str, &str)]) -> CodeResult {
    CodeResult {
        data: data
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
        ..Default::default()
    }
}

#[test]
fn run_code_request_carries_every_flag() {
    let a = run_code(&[
        "sb-1",
        "cell.py",
        "-c",
        "ctx-1",
        "--env",
        "A=1",
        "--env",
        "B=x=y",
        "--timeout",
        "3",
    ]);
    let read = |p: &Path| -> Result<Vec<u8>, String> {
        assert_eq!(p, Path::new("cell.py"));
        Ok(b"1+1\n".to_vec())
    };
    let r = run_code_request(&a, &read).unwrap();
    assert_eq!(
        (
            r.sandbox_id.as_str(),
            r.code.as_str(),
            r.context_id.as_str()
        ),
        ("sb-1", "1+1\n", "ctx-1")
    );
    assert_eq!((r.language.as_str(), r.timeout_ms), ("", 3000));
    assert_eq!(r.env.get("B").map(String::as_str), Some("x=y"));

    let a = run_code(&["sb-1", "-", "-l", "javascript"]);
    let read = |_: &Path| -> Result<Vec<u8>, String> { Ok(vec![0xff]) };
    assert!(
        run_code_request(&a, &read)
            .unwrap_err()
            .contains("not UTF-8")
    );
    assert_eq!(a.language.as_deref(), Some("javascript"));

    assert_eq!(
        parse_err(&["run-code", "sb-1", "x.py", "-l", "python", "-c", "c"]),
        ErrorKind::ArgumentConflict
    );
    assert_eq!(
        parse_err(&["run-code", "sb-1"]),
        ErrorKind::MissingRequiredArgument
    );
    assert_eq!(
        parse_err(&["run-code", "sb-1", "x.py", "--env", "NOEQ"]),
        ErrorKind::ValueValidation
    );
}

#[test]
fn code_context_commands_parse() {
    let Command::CodeContext(CodeContextCommand::Create(a)) = parse(&[
        "code-context",
        "create",
        "sb-1",
        "-l",
        "bash",
        "--cwd",
        "/tmp",
    ])
    .command
    else {
        panic!("not create")
    };
    assert_eq!(
        (a.id.as_str(), a.language.as_deref(), a.cwd.as_deref()),
        ("sb-1", Some("bash"), Some("/tmp"))
    );
    let Command::CodeContext(CodeContextCommand::Rm(a)) =
        parse(&["code-context", "rm", "sb-1", "ctx-1"]).command
    else {
        panic!("not rm")
    };
    assert_eq!((a.id.as_str(), a.context.as_str()), ("sb-1", "ctx-1"));
    assert_eq!(
        parse_err(&["code-context", "restart", "sb-1"]),
        ErrorKind::MissingRequiredArgument
    );
}

#[test]
fn results_print_their_text_and_save_their_images() {
    let r = bundle(&[("text/markdown", "**x**")]);
    assert_eq!(result_text(&r), Some("**x**"));
    let r = bundle(&[("text/plain", "1"), ("text/markdown", "**1**")]);
    assert_eq!(result_text(&r), Some("1"));
    assert_eq!(result_text(&bundle(&[("text/html", "<b/>")])), None);

    // Base64 wrapped in lines, as Jupyter may send it.
    let r = bundle(&[
        ("image/png", "iVBO\nRw0K\n"),
        ("image/jpeg", "/9j/"),
        ("image/svg+xml", "<svg/>"),
        ("application/pdf", "JVBERi0="),
        ("text/html", "<b/>"),
    ]);
    let files = result_files(4, &r).unwrap();
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "result-4.png",
            "result-4.jpg",
            "result-4.svg",
            "result-4.pdf"
        ]
    );
    assert_eq!(files[0].1, b"\x89PNG\r\n");
    assert_eq!(files[2].1, b"<svg/>");
    assert_eq!(files[3].1, b"%PDF-");
    let bad = bundle(&[("image/png", "not base64!")]);
    assert!(result_files(1, &bad).unwrap_err().contains("image/png"));
}

#[test]
fn errors_and_ends_map_to_text_and_exit_codes() {
    assert_eq!(
        error_text("ValueError", "bad", "Traceback:\n  line 1"),
        "Traceback:\n  line 1\nValueError: bad\n"
    );
    assert_eq!(error_text("KernelDied", "", ""), "KernelDied: \n");
    let end = |s: CodeState| CodeEnd {
        state: s as i32,
        ..Default::default()
    };
    assert_eq!(end_exit_code(&end(CodeState::Ok), false), 0);
    assert_eq!(end_exit_code(&end(CodeState::Ok), true), 1);
    assert_eq!(end_exit_code(&end(CodeState::Error), true), 1);
    assert_eq!(end_exit_code(&end(CodeState::TimedOut), false), 124);
    assert_eq!(end_exit_code(&end(CodeState::OomKilled), true), 137);
    assert_eq!(end_exit_code(&end(CodeState::Failed), false), 1);
    assert_eq!(end_exit_code(&end(CodeState::Unspecified), false), 1);
}

#[test]
fn events_become_json_lines() {
    let ev = |e| RunCodeEvent { event: Some(e) };
    let v = event_json(&ev(run_code_event::Event::Stderr(CodeOutput {
        text: "w\n".into(),
        timestamp_unix_ns: 5,
    })))
    .unwrap();
    assert_eq!(
        v,
        serde_json::json!({"type": "stderr", "text": "w\n", "timestamp_unix_ns": 5})
    );
    let mut r = bundle(&[("application/json", "{\"a\":1}")]);
    r.chart = "{\"type\":\"bar\"}".into();
    r.extra = "not json".into();
    let v = event_json(&ev(run_code_event::Event::Result(r))).unwrap();
    assert_eq!(v["data"]["application/json"], "{\"a\":1}");
    assert_eq!(v["chart"]["type"], "bar");
    assert_eq!(v["extra"], "not json");
    assert_eq!(v["is_main_result"], false);
    let v = event_json(&ev(run_code_event::Event::Error(CodeError {
        name: "E".into(),
        value: "v".into(),
        traceback: "t".into(),
    })))
    .unwrap();
    assert_eq!(
        (v["type"].as_str(), v["name"].as_str()),
        (Some("error"), Some("E"))
    );
    let v = event_json(&ev(run_code_event::Event::End(CodeEnd {
        state: CodeState::TimedOut as i32,
        execution_count: 7,
        error_reason: "EXEC_TIMEOUT".into(),
        ..Default::default()
    })))
    .unwrap();
    assert_eq!(
        (
            v["state"].as_str(),
            v["execution_count"].as_u64(),
            v["error_reason"].as_str()
        ),
        (Some("timed_out"), Some(7), Some("EXEC_TIMEOUT"))
    );
    assert!(event_json(&RunCodeEvent { event: None }).is_none());
}
