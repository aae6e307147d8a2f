//! System tests of secrets and the audit trail through airlockd, in real VMs: a secret printed
//! by the code is redacted in the live stream, the stored output and the record (also split
//! over two writes, and base64- or hex-encoded); a file secret is readable by its account
//! only; a TTL removes a variable; snapshotting a sandbox with secrets is refused; RemoveSecrets
//! deletes the file. The audit trail of a tenant verifies with `airlock audit verify`, an
//! edited or removed event (in the store or in an export) is reported, and another tenant sees
//! none of its events.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use std::process::Command;

use airlock_api::v1::{
    CreateSandboxRequest, ListAuditEventsRequest, RemoveSecretsRequest, Sandbox, Secret, SecretEnv,
    SecretFile, SnapshotSandboxRequest, WriteFileHeader, WriteFileRequest, secret,
    write_file_request,
};
use airlock_system_tests::binary;
use airlock_system_tests::harness::{Client, execution_with_output, reason, run, run_as};
use airlock_system_tests::shared::{Shared, scenario};

const TOKEN: &str = "secrets-test-token-acme";
const CONFIG: &str = "pool_size = 1\n[tenants.acme]\ntokens = [\"secrets-test-token-acme\"]\n";
const KEY: &str = "sk-test-abcdef123456";
const FILE_VALUE: &str = "file-secret-0123456789";

fn env_secret(name: &str, value: &str, ttl_s: u32) -> Secret {
    Secret {
        name: name.into(),
        value: value.into(),
        delivery: Some(secret::Delivery::Env(SecretEnv::default())),
        ttl_s,
    }
}

async fn create(c: &mut Client, secrets: Vec<Secret>) -> Sandbox {
    c.create_sandbox(CreateSandboxRequest {
        secrets,
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
}

async fn destroy(c: &mut Client, id: &str) {
    let _ = c
        .destroy_sandbox(airlock_api::v1::DestroySandboxRequest {
            sandbox_id: id.into(),
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_are_redacted_everywhere_private_in_files_expire_and_block_snapshots() {
    let (_guard, s) = scenario(CONFIG).await;
    s.clean(&[TOKEN]).await;
    let mut c = s.client(None).await;
    let file = Secret {
        name: "TOKEN".into(),
        value: FILE_VALUE.into(),
        delivery: Some(secret::Delivery::File(SecretFile::default())),
        ttl_s: 0,
    };
    let sb = create(
        &mut c,
        vec![
            env_secret("API_KEY", KEY, 0),
            file,
            env_secret("SHORT", "short-lived-value", 3),
        ],
    )
    .await;
    assert_eq!(sb.secrets.len(), 3);
    let shown = format!("{sb:?}");
    assert!(
        !shown.contains(KEY) && !shown.contains(FILE_VALUE),
        "{shown}"
    );

    // Printed raw, base64, hex, split over two writes, and quoted in the code itself.
    let code = format!(
        "import base64, os, sys, time\n\
         k = os.environ['API_KEY']\n\
         print('raw', k)\n\
         print('b64', base64.b64encode(k.encode()).decode())\n\
         print('hex', k.encode().hex())\n\
         sys.stdout.write('split ' + k[:7]); sys.stdout.flush(); time.sleep(0.5)\n\
         sys.stdout.write(k[7:] + '\\n'); sys.stdout.flush()\n\
         print('literal', '{KEY}' == k)\n\
         sys.stderr.write('err ' + k + '\\n')\n"
    );
    let (out, err, record) = run(&mut c, &sb.id, &["python3", "-c", &code]).await;
    assert_eq!(record.exit_code, 0, "{out}{err}");
    for line in ["raw ", "b64 ", "hex ", "split "] {
        assert!(
            out.contains(&format!("{line}[REDACTED:API_KEY]")),
            "{line}: {out}"
        );
    }
    assert!(out.contains("literal True"), "{out}");
    assert!(err.contains("err [REDACTED:API_KEY]"), "{err}");
    let b64 = "c2stdGVzdC1hYmNkZWYxMjM0NTY=";
    for text in [&out, &err] {
        assert!(!text.contains(KEY) && !text.contains(b64), "{text}");
    }
    let stored = execution_with_output(&mut c, &record.id).await;
    let stored_out = String::from_utf8_lossy(&stored.stdout).into_owned();
    assert_eq!(stored_out, out);
    let rec = format!("{:?}", stored.execution);
    assert!(!rec.contains(KEY), "the record: {rec}");
    assert!(
        rec.contains("API_KEY"),
        "the record names the secrets: {rec}"
    );

    // The file: the default account's alone.
    let (out, _, _) = run(
        &mut c,
        &sb.id,
        &["stat", "-c", "%a %U", "/run/secrets/TOKEN"],
    )
    .await;
    assert_eq!(out.trim(), "400 user");
    let (out, _, _) = run(&mut c, &sb.id, &["cat", "/run/secrets/TOKEN"]).await;
    assert_eq!(out, "[REDACTED:TOKEN]");
    let (_, err, rec) = run_as(&mut c, &sb.id, "nobody", &["cat", "/run/secrets/TOKEN"]).await;
    assert_ne!(rec.exit_code, 0, "another account read the file: {err}");

    // A snapshot is refused.
    let e = c
        .snapshot_sandbox(SnapshotSandboxRequest {
            sandbox_id: sb.id.clone(),
            template_name: "with-secrets".into(),
            shared: false,
        })
        .await
        .unwrap_err();
    assert_eq!(reason(&e).0, "SECRETS_PRESENT", "{e:?}");

    // The TTL: SHORT is gone from later executions.
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    let (out, _, _) = run(&mut c, &sb.id, &["sh", "-c", "echo \"[$SHORT]\""]).await;
    assert_eq!(out.trim(), "[]");
    // RemoveSecrets deletes the file.
    let after = c
        .remove_secrets(RemoveSecretsRequest {
            sandbox_id: sb.id.clone(),
            names: vec!["TOKEN".into()],
        })
        .await
        .unwrap()
        .into_inner();
    assert!(after.secrets.iter().any(|x| x.name == "TOKEN" && x.removed));
    let (_, _, rec) = run(&mut c, &sb.id, &["test", "-e", "/run/secrets/TOKEN"]).await;
    assert_eq!(rec.exit_code, 1, "the file is still there");
    // The daemon's log never shows a value.
    let log = std::fs::read_to_string(&s.log).unwrap();
    assert!(!log.contains(KEY) && !log.contains(FILE_VALUE));
    destroy(&mut c, &sb.id).await;
}

fn cli(s: &Shared, args: &[&str]) -> (i32, String) {
    let out = Command::new(binary("airlock"))
        .args(args)
        .env("AIRLOCK_ADDR", format!("unix://{}", s.socket.display()))
        .env("AIRLOCK_TOKEN", TOKEN)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_trail_verifies_finds_edits_and_removals_and_is_the_tenants_own() {
    let (_guard, s) = scenario(CONFIG).await;
    s.clean(&[TOKEN]).await;
    let mut c = s.client(Some(TOKEN)).await;
    let sb = create(&mut c, vec![env_secret("API_KEY", KEY, 0)]).await;
    let code = "print('secret code 42')";
    let (_, _, rec) = run(&mut c, &sb.id, &["python3", "-c", code]).await;
    assert_eq!(rec.exit_code, 0);
    let header = WriteFileRequest {
        part: Some(write_file_request::Part::Header(WriteFileHeader {
            sandbox_id: sb.id.clone(),
            path: "/tmp/audited.txt".into(),
            ..Default::default()
        })),
    };
    let data = WriteFileRequest {
        part: Some(write_file_request::Part::Data(b"hello audit".to_vec())),
    };
    c.write_file(tokio_stream::iter(vec![header, data]))
        .await
        .unwrap();
    destroy(&mut c, &sb.id).await;

    let all = c
        .list_audit_events(ListAuditEventsRequest {
            sandbox_id: sb.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let kinds: Vec<&str> = all.events.iter().map(|e| e.kind.as_str()).collect();
    for want in [
        "sandbox.create",
        "exec.start",
        "secret.use",
        "exec.end",
        "file.write",
        "sandbox.end",
    ] {
        assert!(kinds.contains(&want), "{want} missing from {kinds:?}");
    }
    let start = all.events.iter().find(|e| e.kind == "exec.start").unwrap();
    assert!(
        !start.detail_json.contains("secret code 42"),
        "raw code in {start:?}"
    );
    let text = format!("{:?}", all.events);
    assert!(!text.contains(KEY), "a secret value in the trail");
    let end = all.events.iter().find(|e| e.kind == "sandbox.end").unwrap();
    assert!(end.detail_json.contains("\"vmm_ended\":true"), "{end:?}");

    // Another tenant sees none of it.
    let mut other = s.client(None).await;
    let theirs = other
        .list_audit_events(ListAuditEventsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        theirs
            .events
            .iter()
            .all(|e| e.tenant != "acme" && e.sandbox_id != sb.id)
    );

    // Verified through the CLI; an export edited or cut is reported.
    let (code, out) = cli(s, &["audit", "verify"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("ok:"), "{out}");
    let (code, export) = cli(s, &["audit", "export"]);
    assert_eq!(code, 0, "{export}");
    let lines: Vec<&str> = export.lines().collect();
    assert!(lines.len() >= 6);
    let dir = std::env::temp_dir().join(format!("airlock-audit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let edited = dir.join("edited.jsonl");
    let mut changed: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    changed[2] = changed[2].replacen("\"detail_json\":\"{", "\"detail_json\":\"{\\\"x\\\":1,", 1);
    assert_ne!(changed[2], lines[2]);
    std::fs::write(&edited, changed.join("\n")).unwrap();
    let (code, out) = cli(s, &["audit", "verify", "--file", edited.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("edited"), "{out}");
    let cut = dir.join("cut.jsonl");
    let mut fewer: Vec<&str> = lines.clone();
    fewer.remove(3);
    std::fs::write(&cut, fewer.join("\n")).unwrap();
    let (code, out) = cli(s, &["audit", "verify", "--file", cut.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("missing"), "{out}");

    // An event edited in the daemon's store is found too.
    let db = rusqlite::Connection::open(s.data_dir.join("airlock.db")).unwrap();
    let seq: i64 = db
        .query_row(
            "SELECT MIN(seq) FROM audit_events WHERE tenant = 'acme' AND kind = 'file.write'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    db.execute(
        "UPDATE audit_events SET detail = '{\"path\":\"/tmp/other\"}' WHERE tenant = 'acme' AND seq = ?1",
        [seq],
    )
    .unwrap();
    drop(db);
    let (code, out) = cli(s, &["audit", "verify"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains(&format!("event {seq}:")), "{out}");
}
