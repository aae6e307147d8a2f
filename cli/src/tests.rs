//! Parsing of the command line and the requests built from it.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;

use airlock_api::v1::{
    Argv, Code, EgressEvent, EgressKind, EgressRule, Execution, ExecutionState, Exposure,
    FilePolicy, FileToPlace, NetworkPolicy, SandboxState, egress_rule, exec_request,
};
use clap::CommandFactory;
use clap::Parser;
use clap::error::ErrorKind;

use crate::args::{
    Cli, Command, FileSpec, TemplateCommand, When, parse_cidr, parse_domain, parse_file_spec,
    parse_kv, parse_mode, parse_when,
};
use crate::commands::exec::exit_code;
use crate::commands::files::{Remote, write_messages};
use crate::output::{
    egress_line, exposure_json, exposure_text, network_json, network_text, utc_time,
};
use crate::request::{
    MAX_CREATE_FILE_BYTES, create_request, exec_request, expose_request, list_request, net_request,
    template_request,
};

mod code;
mod net;
mod packages;

fn parse(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("airlock").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

fn parse_err(args: &[&str]) -> ErrorKind {
    match Cli::try_parse_from(std::iter::once("airlock").chain(args.iter().copied())) {
        Ok(c) => panic!("{args:?} parsed: {c:?}"),
        Err(e) => e.kind(),
    }
}

/// A `read` for the requests: the file's name as its content; `missing` fails.
fn fake_read(p: &Path) -> Result<Vec<u8>, String> {
    let name = p.to_string_lossy();
    if name == "missing" {
        return Err("missing: No such file".into());
    }
    Ok(format!("content of {name}").into_bytes())
}

fn pairs(v: &[(&str, &str)]) -> HashMap<String, String> {
    v.iter()
        .map(|(k, val)| ((*k).to_owned(), (*val).to_owned()))
        .collect()
}

#[test]
fn the_command_tree_is_consistent() {
    Cli::command().debug_assert();
}

#[test]
fn completions_generate_for_every_shell() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let cli = parse(&["completions", shell]);
        let Command::Completions(a) = cli.command else {
            panic!("not completions")
        };
        let mut out = Vec::new();
        crate::completions(a.shell, &mut out);
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("airlock"), "{shell}");
        assert!(text.contains("memory-mib"), "{shell}: the flags are in it");
    }
    assert_eq!(parse_err(&["completions", "tcsh"]), ErrorKind::InvalidValue);
}

#[test]
fn every_create_flag_reaches_the_request() {
    let cli = parse(&[
        "create",
        "--template",
        "py",
        "--vcpus",
        "2",
        "--memory-mib",
        "512",
        "--disk-mib",
        "64",
        "--env",
        "A=1",
        "--env",
        "B=x=y",
        "--label",
        "suite=cli",
        "--idle-ttl",
        "30",
        "--lifetime",
        "600",
        "--file",
        "in.py:/tmp/in.py",
        "--file",
        "run.sh:/work/run.sh:755",
        "--writable",
        "/tmp",
        "--writable",
        "/work",
        "--exportable",
        "/out",
    ]);
    let Command::Create(a) = cli.command else {
        panic!("not create")
    };
    let req = create_request(&a, &fake_read).unwrap();
    assert_eq!(req.template, "py");
    assert_eq!((req.vcpus, req.memory_mib, req.disk_mib), (2, 512, 64));
    assert_eq!(req.env, pairs(&[("A", "1"), ("B", "x=y")]));
    assert_eq!(req.labels, pairs(&[("suite", "cli")]));
    assert_eq!((req.idle_ttl_s, req.max_lifetime_s), (30, 600));
    assert_eq!(
        req.files,
        vec![
            FileToPlace {
                path: "/tmp/in.py".into(),
                content: b"content of in.py".to_vec(),
                mode: 0,
            },
            FileToPlace {
                path: "/work/run.sh".into(),
                content: b"content of run.sh".to_vec(),
                mode: 0o755,
            },
        ]
    );
    assert_eq!(
        req.file_policy,
        Some(FilePolicy {
            writable: vec!["/tmp".into(), "/work".into()],
            exportable: vec!["/out".into()],
            ..Default::default()
        })
    );
}

#[test]
fn create_without_flags_leaves_everything_to_the_daemon() {
    let Command::Create(a) = parse(&["create"]).command else {
        panic!("not create")
    };
    let req = create_request(&a, &fake_read).unwrap();
    assert_eq!(req, Default::default());
    let Command::Create(a) = parse(&["create", "--max-lifetime", "5"]).command else {
        panic!("not create")
    };
    assert_eq!(create_request(&a, &fake_read).unwrap().max_lifetime_s, 5);
}

#[test]
fn create_fails_on_an_unreadable_file() {
    let Command::Create(a) = parse(&["create", "--file", "missing:/tmp/x"]).command else {
        panic!("not create")
    };
    assert!(
        create_request(&a, &fake_read)
            .unwrap_err()
            .contains("missing")
    );
}

#[test]
fn create_refuses_files_too_large_for_one_request_and_names_cp() {
    let Command::Create(a) = parse(&["create", "--file", "big:/tmp/big"]).command else {
        panic!("not create")
    };
    let big = |_: &std::path::Path| Ok(vec![0u8; MAX_CREATE_FILE_BYTES + 1]);
    let e = create_request(&a, &big).unwrap_err();
    assert!(e.contains("airlock cp"), "{e}");
    let fits = |_: &std::path::Path| Ok(vec![0u8; MAX_CREATE_FILE_BYTES]);
    assert_eq!(
        create_request(&a, &fits).unwrap().files[0].content.len(),
        MAX_CREATE_FILE_BYTES
    );
}

#[test]
fn create_rejects_bad_values() {
    for bad in [
        &["create", "--env", "NOEQUALS"][..],
        &["create", "--env", "=v"],
        &["create", "--label", "x"],
        &["create", "--vcpus", "two"],
        &["create", "--file", "local-only"],
        &["create", "--file", "x:relative/path"],
        &["create", "--file", "x:/tmp/y:999"],
        &["create", "--writable", "tmp"],
    ] {
        assert_eq!(parse_err(bad), ErrorKind::ValueValidation, "{bad:?}");
    }
    assert_eq!(
        parse_err(&["create", "--bogus"]),
        ErrorKind::UnknownArgument
    );
    assert_eq!(
        parse_err(&["create", "--memory-mib", "-1"]),
        ErrorKind::UnknownArgument
    );
    assert_eq!(parse_err(&["create", "--env"]), ErrorKind::InvalidValue);
}

#[test]
fn every_exec_flag_reaches_the_request() {
    let cli = parse(&[
        "exec",
        "sb-1",
        "--timeout",
        "2",
        "--cwd",
        "/tmp",
        "--env",
        "WHO=cli",
        "--memory-mib",
        "64",
        "--stdin",
        "input.txt",
        "--user",
        "root",
        "--",
        "sh",
        "-c",
        "echo hi; exit 7",
    ]);
    let Command::Exec(a) = cli.command else {
        panic!("not exec")
    };
    let req = exec_request(&a, &fake_read).unwrap();
    assert_eq!(req.sandbox_id, "sb-1");
    assert_eq!(
        req.command,
        Some(exec_request::Command::Argv(Argv {
            args: vec!["sh".into(), "-c".into(), "echo hi; exit 7".into()],
        }))
    );
    assert_eq!(req.cwd, "/tmp");
    assert_eq!(req.env, pairs(&[("WHO", "cli")]));
    assert_eq!(req.timeout_ms, 2000);
    assert_eq!(req.stdin, b"content of input.txt");
    assert_eq!(req.memory_limit_mib, 64);
    assert_eq!(req.user, "root");
}

#[test]
fn exec_leaves_defaults_to_the_daemon() {
    let Command::Exec(a) = parse(&["exec", "sb-1", "--", "true"]).command else {
        panic!("not exec")
    };
    let req = exec_request(&a, &fake_read).unwrap();
    assert_eq!((req.timeout_ms, req.memory_limit_mib), (0, 0));
    assert!(req.cwd.is_empty() && req.env.is_empty() && req.stdin.is_empty());
    assert!(req.user.is_empty());
}

fn argv_of(args: &[&str]) -> Vec<String> {
    let Command::Exec(a) = parse(args).command else {
        panic!("not exec")
    };
    match exec_request(&a, &fake_read).unwrap().command {
        Some(exec_request::Command::Argv(Argv { args })) => args,
        other => panic!("{other:?}"),
    }
}

#[test]
fn exec_dash_dash_handling() {
    // Everything after `--` is the remote command's, flags of ours included.
    assert_eq!(
        argv_of(&["exec", "sb-1", "--", "ls", "--json", "--timeout", "-la"]),
        ["ls", "--json", "--timeout", "-la"]
    );
    // Flags before `--`, after the id (the README's form) or before it.
    assert_eq!(
        argv_of(&["exec", "sb-1", "--timeout", "2", "--", "sleep", "60"]),
        ["sleep", "60"]
    );
    assert_eq!(
        argv_of(&["exec", "--timeout", "2", "sb-1", "--", "sleep", "60"]),
        ["sleep", "60"]
    );
    // Without `--` (as before): the command starts at the first word after the id, and its
    // own dashes stay with it.
    assert_eq!(
        argv_of(&[
            "exec",
            "sb-1",
            "python3",
            "-c",
            "print(1)",
            "--timeout",
            "3"
        ]),
        ["python3", "-c", "print(1)", "--timeout", "3"]
    );
    // A second `--` is the remote command's.
    assert_eq!(
        argv_of(&["exec", "sb-1", "--", "a", "--", "b"]),
        ["a", "--", "b"]
    );
    let cli = parse(&["exec", "sb-1", "--", "echo", "--json"]);
    assert!(!cli.json, "--json after -- is the command's");
}

#[test]
fn exec_shell_and_code() {
    let Command::Exec(a) = parse(&["exec", "sb-1", "--shell", "echo $HOME"]).command else {
        panic!("not exec")
    };
    let req = exec_request(&a, &fake_read).unwrap();
    assert_eq!(
        req.command,
        Some(exec_request::Command::Shell("echo $HOME".into()))
    );

    let args = ["exec", "sb-1", "--code", "print(1)"];
    let Command::Exec(a) = parse(&args).command else {
        panic!("not exec")
    };
    let req = exec_request(&a, &fake_read).unwrap();
    assert_eq!(
        req.command,
        Some(exec_request::Command::Code(Code {
            language: String::new(),
            source: "print(1)".into(),
        }))
    );

    let args = ["exec", "sb-1", "--code", "echo 1", "--language", "sh"];
    let Command::Exec(a) = parse(&args).command else {
        panic!("not exec")
    };
    let req = exec_request(&a, &fake_read).unwrap();
    assert_eq!(
        req.command,
        Some(exec_request::Command::Code(Code {
            language: "sh".into(),
            source: "echo 1".into(),
        }))
    );
}

#[test]
fn exec_needs_exactly_one_command() {
    assert_eq!(
        parse_err(&["exec", "sb-1"]),
        ErrorKind::MissingRequiredArgument
    );
    assert_eq!(parse_err(&["exec"]), ErrorKind::MissingRequiredArgument);
    assert_eq!(
        parse_err(&["exec", "sb-1", "--shell", "x", "--", "true"]),
        ErrorKind::ArgumentConflict
    );
    assert_eq!(
        parse_err(&["exec", "sb-1", "--shell", "x", "--code", "y"]),
        ErrorKind::ArgumentConflict
    );
    assert_eq!(
        parse_err(&["exec", "sb-1", "--language", "sh", "--", "true"]),
        ErrorKind::ArgumentConflict
    );
    assert_eq!(
        parse_err(&["exec", "sb-1", "--language", "sh", "--shell", "true"]),
        ErrorKind::ArgumentConflict
    );
    assert_eq!(
        parse_err(&["exec", "sb-1", "--language", "sh"]),
        ErrorKind::MissingRequiredArgument
    );
    assert_eq!(
        parse_err(&["exec", "sb-1", "--code", "x", "--language", "ruby"]),
        ErrorKind::InvalidValue
    );
    assert_eq!(
        parse_err(&["exec", "sb-1", "--env", "X", "--", "true"]),
        ErrorKind::ValueValidation
    );
}

#[test]
fn exec_fails_on_an_unreadable_stdin() {
    let args = ["exec", "sb-1", "--stdin", "missing", "--", "cat"];
    let Command::Exec(a) = parse(&args).command else {
        panic!("not exec")
    };
    assert!(
        exec_request(&a, &fake_read)
            .unwrap_err()
            .contains("missing")
    );
}

#[test]
fn json_addr_and_token_are_global() {
    for args in [
        &["--json", "ls"][..],
        &["ls", "--json"],
        &["template", "--json", "ls"],
        &["template", "ls", "--json"],
        &["exec", "sb-1", "--json", "--", "true"],
    ] {
        assert!(parse(args).json, "{args:?}");
    }
    assert!(!parse(&["ls"]).json);
    let cli = parse(&["--addr", "unix:///tmp/a.sock", "ls", "--token", "t0k"]);
    assert_eq!(cli.addr.as_deref(), Some("unix:///tmp/a.sock"));
    assert_eq!(cli.token.as_deref(), Some("t0k"));
}

#[test]
fn template_create_keeps_its_flags() {
    let cli = parse(&[
        "template",
        "create",
        "py",
        "--vcpus",
        "2",
        "--memory-mib",
        "512",
        "--kernel",
        "/k/vmlinux",
        "--rootfs",
        "/r/rootfs.ext4",
        "--warmup",
        "python3 -c 1",
    ]);
    let Command::Template(TemplateCommand::Create(a)) = cli.command else {
        panic!("not template create")
    };
    let req = template_request(&a, String::new());
    assert_eq!(req.name, "py");
    assert_eq!(req.oci, None);
    assert_eq!((req.vcpus, req.memory_mib), (2, 512));
    assert_eq!(req.kernel_path, "/k/vmlinux");
    assert_eq!(req.rootfs_path, "/r/rootfs.ext4");
    assert_eq!(req.warmup, "python3 -c 1");
    assert!(!req.no_warmup);

    let cli = parse(&["template", "create", "--no-warmup", "base"]);
    let Command::Template(TemplateCommand::Create(a)) = cli.command else {
        panic!("not template create")
    };
    let req = template_request(&a, String::new());
    assert_eq!(req.name, "base");
    assert!(req.no_warmup && req.warmup.is_empty());

    let cli = parse(&[
        "template",
        "create",
        "app",
        "--image",
        "registry.example:5000/team/app:v1",
        "--registry-user",
        "bob",
    ]);
    let Command::Template(TemplateCommand::Create(a)) = cli.command else {
        panic!("not template create")
    };
    let req = template_request(&a, "pw".into());
    let oci = req.oci.expect("an image source");
    assert_eq!(oci.reference, "registry.example:5000/team/app:v1");
    assert_eq!(
        (oci.username.as_str(), oci.password.as_str()),
        ("bob", "pw")
    );
    assert!(req.image.is_empty());
    let cli = parse(&["template", "create", "py", "--from", "py312"]);
    let Command::Template(TemplateCommand::Create(a)) = cli.command else {
        panic!("not template create")
    };
    let req = template_request(&a, "ignored".into());
    assert_eq!((req.image.as_str(), req.oci.is_none()), ("py312", true));
    assert_eq!(
        parse_err(&["template", "create", "x", "--image", "a", "--from", "b"]),
        ErrorKind::ArgumentConflict
    );

    assert_eq!(
        parse_err(&["template", "create", "x", "--warmup", "true", "--no-warmup"]),
        ErrorKind::ArgumentConflict
    );
    assert_eq!(
        parse_err(&["template", "create"]),
        ErrorKind::MissingRequiredArgument
    );
}

#[test]
fn the_other_commands_parse() {
    assert!(matches!(
        parse(&["template", "ls"]).command,
        Command::Template(TemplateCommand::Ls)
    ));
    assert!(matches!(
        parse(&["template", "rm", "x"]).command,
        Command::Template(TemplateCommand::Rm(a)) if a.name == "x"
    ));
    assert!(
        matches!(parse(&["logs", "ex-1"]).command, Command::Logs(a) if a.execution_id == "ex-1")
    );
    assert!(matches!(parse(&["pause", "sb-1"]).command, Command::Pause(a) if a.id == "sb-1"));
    assert!(matches!(parse(&["resume", "sb-1"]).command, Command::Resume(a) if a.id == "sb-1"));
    assert!(matches!(parse(&["rm", "sb-1"]).command, Command::Rm(a) if a.id == "sb-1"));
    assert!(matches!(parse(&["get", "sb-1"]).command, Command::Get(a) if a.id == "sb-1"));
    assert!(matches!(parse(&["egress", "sb-1"]).command, Command::Egress(a) if a.id == "sb-1"));
    assert!(matches!(parse(&["installs", "sb-1"]).command, Command::Installs(a) if a.id == "sb-1"));
    assert!(matches!(parse(&["expose", "sb-1", "22"]).command, Command::Expose(a) if a.port == 22));
    assert!(matches!(
        parse(&["snapshot", "sb-1", "snap"]).command,
        Command::Snapshot(a) if a.id == "sb-1" && a.template == "snap"
    ));
    assert!(matches!(
        parse(&["kill", "ex-1", "--signal", "15"]).command,
        Command::Kill(a) if a.signal == Some(15)
    ));
    assert!(matches!(
        parse(&["cp", "--mode", "755", "a.sh", "sb-1:/tmp/a.sh"]).command,
        Command::Cp(a) if a.mode == Some(0o755) && a.from == "a.sh"
    ));
    assert_eq!(parse_err(&["pause"]), ErrorKind::MissingRequiredArgument);
    assert_eq!(
        parse_err(&["snapshot", "sb-1"]),
        ErrorKind::MissingRequiredArgument
    );
    assert_eq!(parse_err(&["cp", "a"]), ErrorKind::MissingRequiredArgument);
    assert_eq!(parse_err(&["frobnicate"]), ErrorKind::InvalidSubcommand);
    assert_eq!(
        parse_err(&[]),
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    );
    assert_eq!(parse_err(&["--help"]), ErrorKind::DisplayHelp);
    assert_eq!(parse_err(&["exec", "--help"]), ErrorKind::DisplayHelp);
}

#[test]
fn ls_filters() {
    let cli = parse(&[
        "ls", "--label", "a=b", "--state", "paused", "--state", "dead",
    ]);
    let Command::Ls(a) = cli.command else {
        panic!("not ls")
    };
    let req = list_request(&a);
    assert_eq!(req.labels, pairs(&[("a", "b")]));
    assert_eq!(
        req.states,
        [SandboxState::Paused as i32, SandboxState::Dead as i32]
    );
    assert_eq!(
        parse_err(&["ls", "--state", "gone"]),
        ErrorKind::InvalidValue
    );
}

#[test]
fn value_parsers() {
    assert_eq!(parse_kv("K=V").unwrap(), ("K".into(), "V".into()));
    assert_eq!(parse_kv("K=").unwrap(), ("K".into(), String::new()));
    assert!(parse_kv("K").is_err() && parse_kv("=V").is_err());
    assert_eq!(parse_mode("644").unwrap(), 0o644);
    assert_eq!(parse_mode("0755").unwrap(), 0o755);
    assert!(parse_mode("8").is_err() && parse_mode("").is_err() && parse_mode("77777").is_err());
    assert_eq!(
        parse_file_spec("a:b.txt:/tmp/x:y").unwrap(),
        FileSpec {
            local: "a:b.txt".into(),
            guest: "/tmp/x:y".into(),
            mode: 0,
        }
    );
    assert_eq!(parse_file_spec("f:/tmp/x:0600").unwrap().mode, 0o600);
    assert!(parse_file_spec(":/tmp/x").is_err());
    assert!(parse_file_spec("f:/tmp/x:").unwrap().guest == "/tmp/x:");
    for ok in [
        "api.example.com",
        "*.example.com",
        "localhost",
        "xn--bcher-kva.example",
        "example.com.",
    ] {
        assert_eq!(parse_domain(ok).unwrap(), ok);
    }
    for bad in [
        "", "*", "*.", ".", "a..b", "a.b..", "a b", "a/b", "*.*.a", "a:1", "http://a",
    ] {
        assert!(parse_domain(bad).is_err(), "{bad:?}");
    }
    for ok in [
        "203.0.113.0/24",
        "203.0.113.7",
        "0.0.0.0/0",
        "2001:db8::/32",
        "::1",
    ] {
        assert_eq!(parse_cidr(ok).unwrap(), ok);
    }
    for bad in [
        "",
        "10.0.0.0/",
        "10.0.0.0/33",
        "::/129",
        "10.0.0/8",
        "a.b/8",
        "1.2.3.4/+8",
    ] {
        assert!(parse_cidr(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn exit_codes() {
    let ended = |state: ExecutionState, exit_code: i32, signal: i32| Execution {
        state: state as i32,
        exit_code,
        signal,
        ..Default::default()
    };
    assert_eq!(exit_code(&ended(ExecutionState::Exited, 0, 0)), 0);
    assert_eq!(exit_code(&ended(ExecutionState::Exited, 7, 0)), 7);
    assert_eq!(exit_code(&ended(ExecutionState::Exited, 300, 0)), 255);
    assert_eq!(exit_code(&ended(ExecutionState::TimedOut, -1, 9)), 124);
    assert_eq!(exit_code(&ended(ExecutionState::Exited, -1, 15)), 143);
    assert_eq!(exit_code(&ended(ExecutionState::Killed, -1, 9)), 137);
    assert_eq!(exit_code(&ended(ExecutionState::Failed, -1, 0)), 1);
    assert_eq!(exit_code(&ended(ExecutionState::OomKilled, -1, 0)), 1);
}

fn remote(path: &str) -> Remote<'_> {
    Remote {
        id: "sb-1",
        path,
        user: "root",
    }
}

#[test]
fn uploads_are_chunked_after_a_header_that_names_the_account() {
    let data = vec![7u8; (1 << 20) + 5];
    let msgs = write_messages(&remote("/tmp/x"), 0o600, &data);
    assert_eq!(msgs.len(), 3);
    match &msgs[0].part {
        Some(airlock_api::v1::write_file_request::Part::Header(h)) => assert_eq!(h.user, "root"),
        other => panic!("{other:?}"),
    }
    assert_eq!(write_messages(&remote("/tmp/empty"), 0, &[]).len(), 1);
}

#[test]
fn json_records_keep_their_shape() {
    let s = airlock_api::v1::Sandbox {
        id: "sb-1".into(),
        state: SandboxState::Running as i32,
        ..Default::default()
    };
    let v = crate::output::sandbox_json(&s);
    assert_eq!(v["id"], "sb-1");
    assert_eq!(v["state"], "running");
    let keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
    assert_eq!(keys.len(), 21, "{keys:?}");
    assert_eq!(v["node"], "", "empty on a single host");
    assert_eq!(v["secrets"], serde_json::json!([]));
    assert_eq!(v["network"]["allow_internet"], false);
    assert_eq!(v["packages"]["offline"], false);
    assert_eq!(v["volumes"], serde_json::json!([]));
    let table = crate::output::sandbox_table(&[s]);
    assert!(table.starts_with("ID ") && table.contains("sb-1") && table.contains("running"));
}

#[test]
fn a_volume_is_name_colon_absolute_path_with_ro_last() {
    use crate::args::{VolumeSpec, parse_volume_spec};
    assert_eq!(
        parse_volume_spec("work:/data").unwrap(),
        VolumeSpec {
            name: "work".into(),
            path: "/data".into(),
            read_only: false
        }
    );
    assert!(parse_volume_spec("ref:/mnt/ref:ro").unwrap().read_only);
    for bad in ["work", ":/data", "work:data"] {
        assert!(parse_volume_spec(bad).is_err(), "{bad}");
    }
}

#[test]
fn audit_and_secret_flags_parse() {
    match parse(&["audit", "verify", "--file", "t.jsonl"]).command {
        Command::Audit(a) => {
            assert_eq!(a.action, "verify");
            assert_eq!(a.file.as_deref(), Some(std::path::Path::new("t.jsonl")));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(parse(&["audit"]).command, Command::Audit(a) if a.action == "list"));
    match parse(&[
        "audit", "--kind", "denial", "--since", "2h", "--until", "7d",
    ])
    .command
    {
        Command::Audit(a) => {
            assert_eq!(a.filter.kinds, ["denial"]);
            assert_eq!(a.filter.since, Some(When::Ago(7200)));
            assert_eq!(a.filter.until, Some(When::Ago(7 * 86_400)));
        }
        other => panic!("{other:?}"),
    }
    match parse(&[
        "installs",
        "sb-1",
        "--kind",
        "denied",
        "--since",
        "1733560000",
    ])
    .command
    {
        Command::Installs(a) => {
            assert_eq!(a.filter.kinds, ["denied"]);
            assert_eq!(a.filter.since, Some(When::At(1_733_560_000)));
            assert_eq!(When::At(2).unix_ms(0), 2000);
            assert_eq!(When::Ago(2).unix_ms(5000), 3000);
        }
        other => panic!("{other:?}"),
    }
    for bad in ["", "m", "-5", "0", "10x", "1.5h", "99999999999999999999d"] {
        assert!(parse_when(bad).is_err(), "{bad:?}");
    }
    match parse(&[
        "create",
        "--secret",
        "K",
        "--secret-file",
        "F",
        "--secret-ttl",
        "9",
        "--secret-broker",
        "GH=api.github.com,*.example.com",
        "--broker-https",
    ])
    .command
    {
        Command::Create(a) => {
            assert_eq!(a.secret_brokers, ["GH=api.github.com,*.example.com"]);
            assert!(a.broker_https);
            assert_eq!(a.secrets, ["K"]);
            assert_eq!(a.secret_files, ["F"]);
            assert_eq!(a.secret_ttl, Some(9));
        }
        other => panic!("{other:?}"),
    }
}
