//! System test of what the base image offers a coding agent, in a real VM: the guest's own
//! `git` clones a repository from a host its egress policy allows (the test's upstream,
//! `egress/upstream.rs`, serves it over git's "dumb" HTTP protocol from a directory the test
//! fills with the host's git), `make` and `gcc` build what it cloned, `curl` reaches the host,
//! and the other tools users expect are the real ones. Traffic stays on this machine. (One
//! guest script: a compiler's start is tens of seconds of emulated guest kernel work on the
//! nested build machines.)
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use airlock_api::v1::CreateSandboxRequest;
use airlock_system_tests::harness::run_as;
use airlock_system_tests::shared::scenario;

#[path = "egress/upstream.rs"]
mod upstream;
use upstream::*;

/// The base image has what a coding agent reaches for first: `git clone` of a repository on an
/// allowed host (served by the test's upstream), `make` and `gcc` building what it cloned, `curl`
/// on the allowed host, and `wget`, `unzip`, `ps`, `less` and `sudo` on the PATH (the real
/// tools, not busybox's applets), and `python` as python3. One guest script, as the default
/// user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_clones_from_an_allowed_host_and_the_base_image_builds_the_clone() {
    let up = upstream();
    let (_serial, s) = scenario(&config(up)).await;
    let mut c = s.client(None).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            network: Some(domains(&["allowed.test"], &[80])),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    let work = up.dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(
        work.join("hello.c"),
        "#include <stdio.h>\nint main(void) { puts(\"built in the sandbox\"); return 0; }\n",
    )
    .unwrap();
    std::fs::write(
        work.join("Makefile"),
        "hello: hello.c\n\tgcc -O1 -o $@ $<\n",
    )
    .unwrap();
    let git = |dir: &std::path::Path, args: &[&str]| {
        let st = std::process::Command::new("git")
            .args([
                "-c",
                "user.name=Airlock test",
                "-c",
                "user.email=test@airlock.invalid",
            ])
            .arg("-C")
            .arg(dir)
            .args(args)
            .status()
            .expect("git on the host (apt install git)");
        assert!(st.success(), "git {args:?}");
    };
    git(&work, &["init", "-q", "-b", "main"]);
    git(&work, &["add", "."]);
    git(&work, &["commit", "-q", "-m", "a program to build"]);
    let bare = up.git_root().join("hello.git");
    let _ = std::fs::remove_dir_all(&bare);
    git(
        &up.dir,
        &["clone", "-q", "--bare", "work", bare.to_str().unwrap()],
    );
    git(&bare, &["update-server-info"]);
    let script = r#"set -e
cd /tmp
git clone -q http://allowed.test/git/hello.git
cd hello
git log --format=%s
make -s
./hello
curl -sS http://allowed.test/
echo
for tool in wget unzip ps less sudo; do
  p=$(command -v "$tool") || { echo "no $tool"; continue; }
  case $(readlink -f "$p") in */busybox) echo "$tool is busybox's applet" ;; esac
done
readlink -f "$(command -v python)"
"#;
    let (out, err, rec) = run_as(&mut c, &sb.id, "", &["bash", "-c", script]).await;
    assert_eq!(
        rec.exit_code,
        0,
        "{rec:?}\nstdout: {out}\nstderr: {err}\n{}",
        s.log_tail()
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[..3.min(lines.len())],
        [
            "a program to build",
            "built in the sandbox",
            "hello allowed.test"
        ],
        "stderr: {err}"
    );
    // Nothing missing, and `python` is python3.
    assert_eq!(lines.len(), 4, "{out}");
    assert!(lines[3].starts_with("/usr/bin/python3"), "{out}");
    let seen = up.seen();
    assert!(seen.contains("git /git/hello.git/info/refs"), "{seen}");
}
