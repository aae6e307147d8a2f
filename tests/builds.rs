//! System test of Dockerfile builds (BuildTemplate) through a live daemon: a Dockerfile FROM
//! base with ARG, ENV, WORKDIR, COPY of a file and a directory from the uploaded context, a RUN
//! that fetches a wheel from the test's pypiserver (`packages/registries.rs`) through the
//! package proxy, and a server started with a ready check; a rebuild that changes only the last
//! line; refusals. The RUN fetches with curl and unpacks with unzip, not pip: the guest's own
//! pip through the proxy is proven once, in `packages.rs` (a pip start costs minutes in the
//! emulated guest kernel of the build machines), and what a build adds is that its steps reach
//! the proxy under the build's policy.
#![allow(clippy::unwrap_used)] // a failed step is a failed test

use airlock_api::v1::{CreateSandboxRequest, Template};
use airlock_system_tests::TempDir;
use airlock_system_tests::harness::{self, run_as};
use airlock_system_tests::shared::{Shared, scenario};

#[path = "packages/debrepo.rs"]
mod debrepo;
#[path = "packages/registries.rs"]
#[allow(dead_code)] // the pypiserver part serves here
mod registries;

/// The shared daemon's settings: the package registries of `packages/registries.rs`.
fn config() -> String {
    registries::registries().config()
}

const DOCKERFILE: &str = r##"# The app's toolchain.
FROM base
ARG GREETING=hello
ARG PROXY=http://100.96.0.1:3141
ENV APP_HOME=/home/user/app
WORKDIR /home/user/app
COPY app.py ./
COPY data/ data/
RUN curl -fsS "$PROXY/r/pypi/simple/airlock-demo/" | grep -o '/f/[^"#]*\.whl' > wheel && \
    curl -fsS -o /tmp/demo.whl "$PROXY$(head -n1 wheel)" && unzip -q /tmp/demo.whl && \
    chmod -R a+rX airlock_demo && rm wheel /tmp/demo.whl && echo "unpacked airlock-demo 1.0"
RUN echo "$GREETING, built" > built.txt
CMD ["python3", "app.py"]
"##;

async fn build_dockerfile(
    s: &Shared,
    name: &str,
    dockerfile: &str,
    context: &std::path::Path,
) -> Result<(Vec<(String, String)>, Template), tonic::Status> {
    let mut c = s.client(None).await;
    let req = airlock_api::v1::BuildTemplateRequest {
        name: name.into(),
        dockerfile: dockerfile.into(),
        context: context_tar(context),
        start: "busybox httpd -f -p 8000".into(),
        ready_url: "http://127.0.0.1:8000/built.txt".into(),
        ..Default::default()
    };
    let mut events = c.build_template(req).await?.into_inner();
    let mut seen = Vec::new();
    let mut template = None;
    while let Some(ev) = events.message().await? {
        if ev.phase != "output" {
            eprintln!(
                "[{:6.1} s] {name}: {}: {}",
                ev.elapsed_ms as f64 / 1e3,
                ev.phase,
                ev.message
            );
        }
        seen.push((ev.phase.clone(), ev.message.clone()));
        if let Some(t) = ev.template {
            template = Some(t);
        }
    }
    Ok((seen, template.expect("the last event carries the template")))
}

/// The context directory as the CLI sends it: an uncompressed tar.
fn context_tar(dir: &std::path::Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

/// A Dockerfile becomes a template: FROM base, ARG, ENV, WORKDIR, COPY of a file and of a
/// directory from the uploaded context, a RUN that fetches a package through the package proxy
/// (its output streamed), and a server started with a ready check before the snapshot. A
/// sandbox of the template has the files, the package, the environment and the working
/// directory, and the server already answering. A second build that changes only the last
/// line takes every earlier step from the cache and re-runs that one; an unsupported
/// instruction and a failing RUN are refused naming their lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dockerfile_becomes_a_template_and_a_rebuild_reruns_only_the_changed_step() {
    let (_serial, s) = scenario(&config()).await;
    let ctx = TempDir::new("build-ctx");
    std::fs::write(
        ctx.0.join("app.py"),
        "import airlock_demo\nprint(airlock_demo.VALUE)\nprint(open('data/note.txt').read().strip())\n",
    )
    .unwrap();
    std::fs::create_dir_all(ctx.0.join("data")).unwrap();
    std::fs::write(ctx.0.join("data/note.txt"), "a note from the context\n").unwrap();

    let (events, t) = build_dockerfile(s, "app-built", DOCKERFILE, &ctx.0)
        .await
        .unwrap_or_else(|e| panic!("build: {e:?}\n{}", s.log_tail()));
    let output: String = events
        .iter()
        .filter(|(p, _)| p == "output")
        .map(|(_, m)| m.as_str())
        .collect();
    assert!(output.contains("unpacked airlock-demo 1.0"), "{events:?}");
    assert!(t.source.starts_with("dockerfile:sha256:"), "{t:?}");
    let d = t.image_defaults.clone().unwrap();
    assert_eq!(d.working_dir, "/home/user/app");
    assert_eq!(d.cmd, ["python3", "app.py"]);
    assert!(
        d.env.contains(&"APP_HOME=/home/user/app".to_string()),
        "{d:?}"
    );

    let mut c = s.client(None).await;
    let sb = c
        .create_sandbox(CreateSandboxRequest {
            template: "app-built".into(),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create: {e:?}\n{}", s.log_tail()))
        .into_inner();
    let script = "pwd; echo \"$APP_HOME\"; cat built.txt; python3 app.py; \
                  curl -fsS http://127.0.0.1:8000/built.txt";
    let (out, err, ex) = run_as(&mut c, &sb.id, "", &["sh", "-c", script]).await;
    assert_eq!(ex.exit_code, 0, "{out}{err}");
    assert_eq!(
        out,
        "/home/user/app\n/home/user/app\nhello, built\nhello from airlock-demo 1.0\n\
         a note from the context\nhello, built\n",
        "{err}"
    );
    s.clean(&[]).await;

    // Only the last line changes: every step before it comes from the cache.
    let changed = DOCKERFILE.replace("built\" > built.txt", "rebuilt\" > built.txt");
    let (events, _) = build_dockerfile(s, "app-rebuilt", &changed, &ctx.0)
        .await
        .unwrap_or_else(|e| panic!("rebuild: {e:?}\n{}", s.log_tail()));
    let steps: Vec<&str> = events
        .iter()
        .filter(|(p, _)| p == "step")
        .map(|(_, m)| m.as_str())
        .collect();
    for cached in ["COPY app.py", "COPY data/", "RUN curl"] {
        assert!(
            steps
                .iter()
                .any(|m| m.contains(cached) && m.ends_with("(cached)")),
            "{cached} from the cache: {steps:?}"
        );
    }
    assert!(
        steps
            .iter()
            .any(|m| m.starts_with("step 4/4") && m.contains("rebuilt")),
        "{steps:?}"
    );
    assert!(
        !events
            .iter()
            .any(|(p, m)| p == "output" && m.contains("airlock-demo")),
        "the fetch did not run again"
    );

    // Refused before anything runs, and a failing step.
    let mut c = s.client(None).await;
    let refused = build_dockerfile(s, "bad", "FROM base\nEXPOSE 80\n", &ctx.0)
        .await
        .unwrap_err();
    assert_eq!(harness::reason(&refused).0, "INVALID_ARGUMENT");
    assert!(
        refused.message().contains("line 2: EXPOSE"),
        "{}",
        refused.message()
    );
    let failed = build_dockerfile(s, "bad", "FROM base\nRUN true\nRUN exit 7\n", &ctx.0)
        .await
        .unwrap_err();
    let (reason, meta) = harness::reason(&failed);
    assert_eq!(
        (reason.as_str(), meta["line"].as_str()),
        ("BUILD_STEP_FAILED", "3")
    );
    assert!(
        failed.message().contains("exited with 7"),
        "{}",
        failed.message()
    );
    let live = c
        .list_sandboxes(airlock_api::v1::ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert!(live.is_empty(), "build sandboxes are destroyed: {live:?}");
}
