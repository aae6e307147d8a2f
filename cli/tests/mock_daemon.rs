//! The `airlock` binary against an in-process mock of the daemon's API on a Unix socket: what
//! it prints (text and `--json`), its exit codes, and the requests it sends.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Output as ProcOutput;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use airlock_api::v1::airlock_server::{Airlock, AirlockServer};
use airlock_api::v1::*;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

type Answer<T> = Result<Response<T>, Status>;
type Events<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn events<T: Send + 'static>(items: Vec<T>) -> Events<T> {
    Box::pin(tokio_stream::iter(items.into_iter().map(Ok)))
}

/// What the mock saw.
#[derive(Debug, Default)]
struct Seen {
    create: Option<CreateSandboxRequest>,
    exec: Option<ExecRequest>,
    template: Option<CreateTemplateRequest>,
    build: Option<BuildTemplateRequest>,
    rebuild: Option<RebuildTemplateRequest>,
    list: Option<ListSandboxesRequest>,
    files: HashMap<String, (u32, Vec<u8>)>,
    net: Option<SetNetworkPolicyRequest>,
    egress: Vec<GetEgressLogRequest>,
    installs: Vec<GetInstallLogRequest>,
    expose: Option<ExposePortRequest>,
    /// Volumes made so far (name, size).
    volumes: Vec<(String, u32)>,
    /// The `fs` calls, as text.
    fs: Vec<String>,
    /// GetSandbox calls for `sb-ending`: running at the first, destroyed after.
    ending_polls: usize,
    /// The last RunCode request.
    run_code: Option<RunCodeRequest>,
    /// The code-context calls, as text.
    code_contexts: Vec<String>,
    /// The contexts made and not removed.
    contexts: Vec<CodeContext>,
}

#[derive(Debug, Default, Clone)]
struct Mock(Arc<Mutex<Seen>>);

fn sandbox(id: &str) -> Sandbox {
    Sandbox {
        id: id.into(),
        template: "base".into(),
        state: SandboxState::Running as i32,
        vcpus: 1,
        memory_mib: 256,
        ..Default::default()
    }
}

fn template(name: &str) -> Template {
    Template {
        name: name.into(),
        id: format!("tpl-{name}"),
        vcpus: 1,
        memory_mib: 256,
        ..Default::default()
    }
}

fn output(stream: StreamKind, data: &str) -> ExecutionEvent {
    ExecutionEvent {
        event: Some(execution_event::Event::Output(Output {
            stream: stream as i32,
            offset: 0,
            data: data.as_bytes().to_vec(),
        })),
    }
}

fn exit(state: ExecutionState, exit_code: i32, reason: &str) -> ExecutionEvent {
    ExecutionEvent {
        event: Some(execution_event::Event::Exit(Execution {
            state: state as i32,
            exit_code,
            error_reason: reason.into(),
            error_message: if reason.is_empty() {
                ""
            } else {
                "it took too long"
            }
            .into(),
            ..Default::default()
        })),
    }
}

fn egress_event(
    seq: u64,
    kind: EgressKind,
    name: &str,
    address: &str,
    port: u32,
    allowed: bool,
) -> EgressEvent {
    EgressEvent {
        seq,
        time_unix_ms: 1_700_000_000_000 + seq as i64,
        kind: kind as i32,
        name: name.into(),
        // A DNS event's addresses are its answer's.
        address: if kind == EgressKind::Dns { "" } else { address }.into(),
        answers: if kind == EgressKind::Dns {
            vec![address.into()]
        } else {
            vec![]
        },
        port,
        bytes_out: if kind == EgressKind::Dns { 0 } else { 517 },
        bytes_in: if kind == EgressKind::Dns { 0 } else { 4096 },
        duration_ms: 12.5,
        allowed,
        verdict: if allowed {
            "api.example.com:443".into()
        } else {
            "no rule allows it".into()
        },
        query_type: if kind == EgressKind::Dns { "A" } else { "" }.into(),
    }
}

fn install_event(
    seq: u64,
    package: &str,
    version: &str,
    outcome: InstallOutcome,
    message: &str,
) -> InstallEvent {
    let file = if version.is_empty() {
        String::new()
    } else {
        format!("{}-{version}-py3-none-any.whl", package.replace('-', "_"))
    };
    InstallEvent {
        seq,
        time_unix_ms: 1_700_000_000_000 + seq as i64,
        tenant: "default".into(),
        sandbox_id: "sb-1".into(),
        registry: "pypi".into(),
        kind: "pypi".into(),
        package: package.into(),
        version: version.into(),
        bytes: if file.is_empty() { 0 } else { 64_928 },
        sha256: if file.is_empty() {
            String::new()
        } else {
            "5e".repeat(32)
        },
        file,
        outcome: outcome as i32,
        message: message.into(),
    }
}

#[tonic::async_trait]
impl Airlock for Mock {
    type CreateTemplateStream = Events<TemplateEvent>;
    type BuildTemplateStream = Events<TemplateEvent>;
    type RebuildTemplateStream = Events<TemplateEvent>;
    type StreamExecutionStream = Events<ExecutionEvent>;
    type ReadFileStream = Events<FileChunk>;
    type RunCodeStream = Events<RunCodeEvent>;

    async fn create_template(
        &self,
        r: Request<CreateTemplateRequest>,
    ) -> Answer<Events<TemplateEvent>> {
        let r = r.into_inner();
        let t = template(&r.name);
        self.0.lock().unwrap().template = Some(r);
        let booting = TemplateEvent {
            phase: "booting".into(),
            message: "cold boot".into(),
            ..Default::default()
        };
        let ready = TemplateEvent {
            phase: "ready".into(),
            elapsed_ms: 1500,
            message: "done".into(),
            template: Some(t),
        };
        Ok(Response::new(events(vec![booting, ready])))
    }
    async fn build_template(
        &self,
        r: Request<BuildTemplateRequest>,
    ) -> Answer<Events<TemplateEvent>> {
        let r = r.into_inner();
        let t = template(&r.name);
        self.0.lock().unwrap().build = Some(r);
        let ev = |phase: &str, message: &str, template| TemplateEvent {
            phase: phase.into(),
            message: message.into(),
            template,
            ..Default::default()
        };
        Ok(Response::new(events(vec![
            ev("step", "step 1/1, line 2: RUN make", None),
            ev("output", "compiling\n", None),
            ev("ready", "done", Some(t)),
        ])))
    }
    async fn rebuild_template(
        &self,
        r: Request<RebuildTemplateRequest>,
    ) -> Answer<Events<TemplateEvent>> {
        let r = r.into_inner();
        let mut t = template(r.name.split(':').next().unwrap_or_default());
        t.tag = r.tag.clone();
        self.0.lock().unwrap().rebuild = Some(r);
        Ok(Response::new(events(vec![TemplateEvent {
            phase: "ready".into(),
            message: "done".into(),
            template: Some(t),
            ..Default::default()
        }])))
    }
    async fn get_template_sbom(
        &self,
        r: Request<GetTemplateSbomRequest>,
    ) -> Answer<GetTemplateSbomResponse> {
        let r = r.into_inner();
        Ok(Response::new(GetTemplateSbomResponse {
            document: format!("{{\"format\":\"{}\"}}", r.format),
            packages: vec![SbomPackage {
                ecosystem: "deb".into(),
                name: "git".into(),
                version: "1:2.39".into(),
                purl: String::new(),
            }],
        }))
    }
    async fn get_template_log(
        &self,
        r: Request<GetTemplateLogRequest>,
    ) -> Answer<GetTemplateLogResponse> {
        if r.into_inner().name != "py:v1" {
            return Err(Status::not_found("TEMPLATE_NOT_FOUND"));
        }
        Ok(Response::new(GetTemplateLogResponse {
            log: "[     1.0s] booting: cold boot\n".into(),
            truncated: false,
        }))
    }
    async fn list_templates(
        &self,
        _: Request<ListTemplatesRequest>,
    ) -> Answer<ListTemplatesResponse> {
        Ok(Response::new(ListTemplatesResponse {
            templates: vec![template("base")],
        }))
    }
    async fn delete_template(
        &self,
        _: Request<DeleteTemplateRequest>,
    ) -> Answer<DeleteTemplateResponse> {
        Ok(Response::new(DeleteTemplateResponse {}))
    }
    async fn create_sandbox(&self, r: Request<CreateSandboxRequest>) -> Answer<Sandbox> {
        let r = r.into_inner();
        if r.packages
            .as_ref()
            .is_some_and(|p| p.registries.iter().any(|n| n == "corp"))
        {
            return Err(Status::permission_denied("PACKAGES_NOT_ALLOWED"));
        }
        let mut s = sandbox("sb-1");
        s.labels = r.labels.clone();
        // The policy in force: the request's over a ceiling of pypi and npm, 1 GiB.
        let mut packages = r.packages.clone().unwrap_or_default();
        if packages.registries.is_empty() {
            packages.registries = vec!["npm".into(), "pypi".into()];
        }
        if packages.max_download_bytes == 0 {
            packages.max_download_bytes = 1 << 30;
        }
        s.packages = Some(packages);
        self.0.lock().unwrap().create = Some(r);
        Ok(Response::new(s))
    }
    async fn get_sandbox(&self, r: Request<GetSandboxRequest>) -> Answer<Sandbox> {
        match r.into_inner().sandbox_id.as_str() {
            "sb-1" => Ok(Response::new(sandbox("sb-1"))),
            "sb-ending" => {
                let mut seen = self.0.lock().unwrap();
                seen.ending_polls += 1;
                let mut s = sandbox("sb-ending");
                if seen.ending_polls > 1 {
                    s.state = SandboxState::Destroyed as i32;
                }
                Ok(Response::new(s))
            }
            id => Err(Status::not_found(format!("no sandbox {id}"))),
        }
    }
    async fn list_sandboxes(
        &self,
        r: Request<ListSandboxesRequest>,
    ) -> Answer<ListSandboxesResponse> {
        self.0.lock().unwrap().list = Some(r.into_inner());
        Ok(Response::new(ListSandboxesResponse {
            sandboxes: vec![sandbox("sb-1")],
        }))
    }
    async fn pause_sandbox(&self, _: Request<PauseSandboxRequest>) -> Answer<Sandbox> {
        let mut s = sandbox("sb-1");
        s.state = SandboxState::Paused as i32;
        Ok(Response::new(s))
    }
    async fn resume_sandbox(&self, _: Request<ResumeSandboxRequest>) -> Answer<Sandbox> {
        Ok(Response::new(sandbox("sb-1")))
    }
    async fn snapshot_sandbox(&self, r: Request<SnapshotSandboxRequest>) -> Answer<Template> {
        Ok(Response::new(template(&r.into_inner().template_name)))
    }
    async fn destroy_sandbox(
        &self,
        _: Request<DestroySandboxRequest>,
    ) -> Answer<DestroySandboxResponse> {
        Ok(Response::new(DestroySandboxResponse { destroyed: true }))
    }
    async fn exec(&self, r: Request<ExecRequest>) -> Answer<ExecResponse> {
        let r = r.into_inner();
        if r.sandbox_id != "sb-1" {
            return Err(Status::not_found("SANDBOX_NOT_FOUND"));
        }
        let timed_out = r.timeout_ms > 0;
        self.0.lock().unwrap().exec = Some(r);
        let execution_id = if timed_out { "ex-timeout" } else { "ex-7" }.into();
        Ok(Response::new(ExecResponse { execution_id }))
    }
    async fn stream_execution(
        &self,
        r: Request<StreamExecutionRequest>,
    ) -> Answer<Events<ExecutionEvent>> {
        let evs = match r.into_inner().execution_id.as_str() {
            "ex-timeout" => vec![exit(ExecutionState::TimedOut, -1, "EXEC_TIMEOUT")],
            "ex-7" => vec![
                output(StreamKind::Stdout, "hi\n"),
                output(StreamKind::Stderr, "err\n"),
                exit(ExecutionState::Exited, 7, ""),
            ],
            _ => return Err(Status::not_found("EXECUTION_NOT_FOUND")),
        };
        Ok(Response::new(events(evs)))
    }
    async fn get_execution(&self, _: Request<GetExecutionRequest>) -> Answer<GetExecutionResponse> {
        Err(Status::unimplemented("mock"))
    }
    async fn kill_execution(
        &self,
        _: Request<KillExecutionRequest>,
    ) -> Answer<KillExecutionResponse> {
        Ok(Response::new(KillExecutionResponse { signalled: true }))
    }
    async fn write_stdin(&self, _: Request<WriteStdinRequest>) -> Answer<WriteStdinResponse> {
        Ok(Response::new(WriteStdinResponse {}))
    }
    async fn write_file(
        &self,
        r: Request<Streaming<WriteFileRequest>>,
    ) -> Answer<WriteFileResponse> {
        let mut s = r.into_inner();
        let (mut path, mut mode, mut data) = (String::new(), 0, Vec::new());
        while let Some(m) = s.message().await? {
            match m.part {
                Some(write_file_request::Part::Header(h)) => (path, mode) = (h.path, h.mode),
                Some(write_file_request::Part::Data(d)) => data.extend(d),
                None => {}
            }
        }
        if !path.starts_with("/tmp/") {
            return Err(Status::permission_denied("PATH_NOT_ALLOWED"));
        }
        let n = data.len() as u64;
        self.0.lock().unwrap().files.insert(path, (mode, data));
        Ok(Response::new(WriteFileResponse { bytes_written: n }))
    }
    async fn read_file(&self, r: Request<ReadFileRequest>) -> Answer<Events<FileChunk>> {
        let path = r.into_inner().path;
        let Some((_, data)) = self.0.lock().unwrap().files.get(&path).cloned() else {
            return Err(Status::not_found("no such file"));
        };
        let size = data.len() as u64;
        Ok(Response::new(events(vec![FileChunk { data, size }])))
    }
    async fn list_files(&self, r: Request<ListFilesRequest>) -> Answer<ListFilesResponse> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        seen.fs
            .push(format!("ls {} {} {}", r.path, r.recursive, r.max_entries));
        let entries = vec![
            FileEntry {
                name: "a".into(),
                is_dir: true,
                mode: 0o755,
                uid: 1000,
                gid: 1000,
                ..Default::default()
            },
            FileEntry {
                name: "a/b.txt".into(),
                size: 12,
                mode: 0o644,
                uid: 1000,
                gid: 1000,
                ..Default::default()
            },
        ];
        Ok(Response::new(ListFilesResponse {
            entries,
            truncated: r.max_entries == 1,
        }))
    }

    async fn stat_file(&self, r: Request<StatFileRequest>) -> Answer<FileEntry> {
        let r = r.into_inner();
        self.0.lock().unwrap().fs.push(format!("stat {}", r.path));
        Ok(Response::new(FileEntry {
            name: r.path,
            size: 5,
            mode: 0o600,
            ..Default::default()
        }))
    }

    async fn make_dir(&self, r: Request<MakeDirRequest>) -> Answer<MakeDirResponse> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        seen.fs
            .push(format!("mkdir {} {} {}", r.path, r.parents, r.user));
        Ok(Response::new(MakeDirResponse {}))
    }

    async fn remove_file(&self, r: Request<RemoveFileRequest>) -> Answer<RemoveFileResponse> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        seen.fs.push(format!("rm {} {}", r.path, r.recursive));
        Ok(Response::new(RemoveFileResponse {}))
    }

    async fn rename_file(&self, r: Request<RenameFileRequest>) -> Answer<RenameFileResponse> {
        let r = r.into_inner();
        self.0
            .lock()
            .unwrap()
            .fs
            .push(format!("mv {} {}", r.from, r.to));
        Ok(Response::new(RenameFileResponse {}))
    }

    async fn set_network_policy(&self, r: Request<SetNetworkPolicyRequest>) -> Answer<Sandbox> {
        let r = r.into_inner();
        if r.sandbox_id != "sb-1" {
            return Err(Status::not_found("SANDBOX_NOT_FOUND"));
        }
        if r.network.as_ref().is_some_and(|n| {
            n.allow
                .iter()
                .any(|rule| rule.target == Some(egress_rule::Target::Cidr("10.0.0.0/8".into())))
        }) {
            return Err(Status::permission_denied("NETWORK_NOT_ALLOWED"));
        }
        let mut s = sandbox("sb-1");
        s.network = r.network.clone();
        self.0.lock().unwrap().net = Some(r);
        Ok(Response::new(s))
    }
    async fn get_egress_log(
        &self,
        r: Request<GetEgressLogRequest>,
    ) -> Answer<GetEgressLogResponse> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        seen.egress.push(r.clone());
        // Three events; `sb-ending` logs a fourth once it has been seen running.
        let mut log = vec![
            egress_event(
                1,
                EgressKind::Dns,
                "api.example.com",
                "203.0.113.7",
                53,
                true,
            ),
            egress_event(
                2,
                EgressKind::Tcp,
                "api.example.com",
                "203.0.113.7",
                443,
                true,
            ),
            egress_event(3, EgressKind::Tcp, "", "198.51.100.1", 22, false),
        ];
        match r.sandbox_id.as_str() {
            // A caller's connection to a port exposed before.
            "sb-1" if seen.expose.is_some() => {
                log.push(egress_event(
                    4,
                    EgressKind::Expose,
                    "",
                    "127.0.0.1",
                    51234,
                    true,
                ));
            }
            "sb-1" => {}
            "sb-ending" if seen.ending_polls >= 1 => {
                log.push(egress_event(
                    4,
                    EgressKind::Dns,
                    "late.example.com",
                    "",
                    0,
                    false,
                ));
            }
            "sb-ending" => {}
            _ => return Err(Status::not_found("SANDBOX_NOT_FOUND")),
        }
        let limit = if r.limit == 0 { 1000 } else { r.limit as usize };
        let events: Vec<_> = log
            .into_iter()
            .filter(|e| e.seq > r.after_seq)
            .take(limit)
            .collect();
        Ok(Response::new(GetEgressLogResponse { events, dropped: 5 }))
    }
    async fn remove_secrets(&self, _: Request<RemoveSecretsRequest>) -> Answer<Sandbox> {
        Err(Status::unimplemented("not in the mock"))
    }
    async fn list_audit_events(
        &self,
        _: Request<ListAuditEventsRequest>,
    ) -> Answer<ListAuditEventsResponse> {
        Err(Status::unimplemented("not in the mock"))
    }
    async fn get_install_log(
        &self,
        r: Request<GetInstallLogRequest>,
    ) -> Answer<GetInstallLogResponse> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        seen.installs.push(r.clone());
        // Three events; `sb-ending` logs a fourth once it has been seen running.
        let mut log = vec![
            install_event(
                1,
                "requests",
                "2.32.3",
                InstallOutcome::Fetched,
                "fetched from pypi, sha256 verified",
            ),
            install_event(
                2,
                "urllib3",
                "2.2.3",
                InstallOutcome::Cached,
                "served from the cache",
            ),
            install_event(
                3,
                "evil-pkg",
                "",
                InstallOutcome::Denied,
                "evil-pkg: denied by the deny list (evil-*)",
            ),
        ];
        match r.sandbox_id.as_str() {
            "sb-1" => {}
            "sb-ending" if seen.ending_polls >= 1 => {
                log.push(install_event(
                    4,
                    "numpy",
                    "2.1.0",
                    InstallOutcome::OverCap,
                    "over the sandbox's download cap (1048576 bytes)",
                ));
            }
            "sb-ending" => {}
            _ => return Err(Status::not_found("SANDBOX_NOT_FOUND")),
        }
        let limit = if r.limit == 0 { 1000 } else { r.limit as usize };
        let events: Vec<_> = log
            .into_iter()
            .filter(|e| e.seq > r.after_seq)
            .take(limit)
            .collect();
        Ok(Response::new(GetInstallLogResponse { events, dropped: 2 }))
    }
    async fn expose_port(&self, r: Request<ExposePortRequest>) -> Answer<Exposure> {
        let r = r.into_inner();
        if r.sandbox_id != "sb-1" {
            return Err(Status::not_found("SANDBOX_NOT_FOUND"));
        }
        let ttl_s = if r.ttl_s == 0 { 300 } else { r.ttl_s };
        let e = Exposure {
            sandbox_id: r.sandbox_id.clone(),
            guest_port: r.guest_port,
            address: "127.0.0.1:40123".into(),
            token: "tok-8f3a".into(),
            expires_unix_ms: 1_700_000_000_000 + i64::from(ttl_s) * 1000,
        };
        self.0.lock().unwrap().expose = Some(r);
        Ok(Response::new(e))
    }

    async fn create_volume(&self, r: Request<CreateVolumeRequest>) -> Answer<Volume> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        if seen.volumes.iter().any(|(n, _)| *n == r.name) {
            return Err(Status::already_exists(format!("volume {} exists", r.name)));
        }
        seen.volumes.push((r.name.clone(), r.size_mib));
        Ok(Response::new(Volume {
            name: r.name,
            size_mib: r.size_mib,
            ..Default::default()
        }))
    }

    async fn list_volumes(&self, _: Request<ListVolumesRequest>) -> Answer<ListVolumesResponse> {
        let seen = self.0.lock().unwrap();
        let volumes = seen
            .volumes
            .iter()
            .map(|(name, size_mib)| Volume {
                name: name.clone(),
                size_mib: *size_mib,
                used_bytes: 3 << 20,
                attached_to: vec!["sb-1".into()],
                ..Default::default()
            })
            .collect();
        Ok(Response::new(ListVolumesResponse { volumes }))
    }

    async fn delete_volume(&self, r: Request<DeleteVolumeRequest>) -> Answer<DeleteVolumeResponse> {
        let name = r.into_inner().name;
        let mut seen = self.0.lock().unwrap();
        let before = seen.volumes.len();
        seen.volumes.retain(|(n, _)| *n != name);
        Ok(Response::new(DeleteVolumeResponse {
            deleted: seen.volumes.len() < before,
        }))
    }

    async fn run_code(&self, r: Request<RunCodeRequest>) -> Answer<Events<RunCodeEvent>> {
        let r = r.into_inner();
        if r.sandbox_id != "sb-1" {
            return Err(Status::not_found("SANDBOX_NOT_FOUND"));
        }
        let evs = code::cell_events(&r);
        self.0.lock().unwrap().run_code = Some(r);
        Ok(Response::new(events(evs)))
    }
    async fn create_code_context(
        &self,
        r: Request<CreateCodeContextRequest>,
    ) -> Answer<CodeContext> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        seen.code_contexts
            .push(format!("create {} {}", r.language, r.cwd));
        let id = format!("ctx-{}", seen.code_contexts.len());
        let c = code::context(&id, &r.language, &r.cwd);
        seen.contexts.push(c.clone());
        Ok(Response::new(c))
    }
    async fn list_code_contexts(
        &self,
        _: Request<ListCodeContextsRequest>,
    ) -> Answer<ListCodeContextsResponse> {
        let contexts = self.0.lock().unwrap().contexts.clone();
        Ok(Response::new(ListCodeContextsResponse { contexts }))
    }
    async fn restart_code_context(
        &self,
        r: Request<RestartCodeContextRequest>,
    ) -> Answer<CodeContext> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        seen.code_contexts.push(format!("restart {}", r.context_id));
        match seen.contexts.iter().find(|c| c.id == r.context_id) {
            Some(c) => Ok(Response::new(c.clone())),
            None => Err(Status::not_found("CONTEXT_NOT_FOUND")),
        }
    }
    async fn remove_code_context(
        &self,
        r: Request<RemoveCodeContextRequest>,
    ) -> Answer<RemoveCodeContextResponse> {
        let r = r.into_inner();
        let mut seen = self.0.lock().unwrap();
        seen.code_contexts.push(format!("rm {}", r.context_id));
        let before = seen.contexts.len();
        seen.contexts.retain(|c| c.id != r.context_id);
        if seen.contexts.len() == before {
            return Err(Status::not_found("CONTEXT_NOT_FOUND"));
        }
        Ok(Response::new(RemoveCodeContextResponse {}))
    }

    async fn list_nodes(&self, _: Request<ListNodesRequest>) -> Answer<ListNodesResponse> {
        let node = |name: &str, tag: &str, n| Node {
            name: name.into(),
            tag: tag.into(),
            address: format!("http://{name}:7101"),
            sandboxes: n,
            max_sandboxes: 256,
            templates: vec!["/base".into()],
            ..Default::default()
        };
        let nodes = vec![node("node-a", "1a2b", 3), node("node-b", "3c4d", 0)];
        Ok(Response::new(ListNodesResponse { nodes }))
    }

    async fn get_usage(&self, _: Request<GetUsageRequest>) -> Answer<Usage> {
        Ok(Response::new(Usage {
            tenant: "default".into(),
            live_sandboxes: 2,
            max_sandboxes: 64,
            output_bytes: 1234,
            ..Default::default()
        }))
    }
}

#[path = "mock_daemon/code.rs"]
mod code;
#[path = "mock_daemon/net.rs"]
mod net;
#[path = "mock_daemon/nodes.rs"]
mod nodes;
#[path = "mock_daemon/packages.rs"]
mod packages;

/// `fs ls|stat|mkdir|rm|mv` send what they are given and print what they get.
#[tokio::test]
async fn fs_commands_name_a_sandbox_path() {
    let d = Daemon::start();
    let p = d.airlock(&["fs", "ls", "sb-1:/tmp", "-r"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(
        text(&p.stdout),
        "d0755  1000:1000             0 a\n-0644  1000:1000            12 a/b.txt\n"
    );
    let p = d
        .airlock(&["--json", "fs", "ls", "sb-1:/tmp", "--max", "1"])
        .await;
    assert_eq!(json(&p.stdout)[1]["name"], "a/b.txt");
    assert!(text(&p.stderr).is_empty(), "JSON mode: no notice");
    for args in [
        &["fs", "stat", "sb-1:/tmp/x"][..],
        &["fs", "mkdir", "sb-1:/tmp/d", "-p", "--user", "root"],
        &["fs", "rm", "sb-1:/tmp/d", "-r"],
        &["fs", "mv", "sb-1:/tmp/a", "/tmp/b"],
    ] {
        let p = d.airlock(args).await;
        assert_eq!(p.status.code(), Some(0), "{args:?}: {}", text(&p.stderr));
    }
    assert_eq!(
        d.seen().fs,
        [
            "ls /tmp true 0",
            "ls /tmp false 1",
            "stat /tmp/x",
            "mkdir /tmp/d true root",
            "rm /tmp/d true",
            "mv /tmp/a /tmp/b"
        ]
    );
    let p = d.airlock(&["fs", "ls", "/tmp"]).await;
    assert_eq!(p.status.code(), Some(1), "a path with no sandbox");
}

/// `volume create|ls|rm` and `create --volume`.
#[tokio::test]
async fn volumes_are_made_listed_mounted_and_deleted() {
    let d = Daemon::start();
    let p = d
        .airlock(&["volume", "create", "work", "--size-mib", "64"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stdout), "work\n");
    let p = d.airlock(&["volume", "ls"]).await;
    let out = text(&p.stdout);
    assert!(out.starts_with("NAME "), "{out}");
    assert!(
        out.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["work", "64", "3", "sb-1"]),
        "{out}"
    );
    let p = d.airlock(&["--json", "volume", "ls"]).await;
    assert_eq!(json(&p.stdout)[0]["size_mib"], 64);
    let p = d
        .airlock(&[
            "create",
            "--volume",
            "work:/data",
            "--volume",
            "ref:/ref:ro",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let vols = d.seen().create.clone().unwrap().volumes;
    assert_eq!(
        vols.iter()
            .map(|v| (v.name.as_str(), v.mount_path.as_str(), v.read_only))
            .collect::<Vec<_>>(),
        [("work", "/data", false), ("ref", "/ref", true)]
    );
    let p = d.airlock(&["create", "--volume", "work"]).await;
    assert_eq!(p.status.code(), Some(2), "a volume needs a path");
    let p = d.airlock(&["--json", "volume", "rm", "work"]).await;
    assert_eq!(json(&p.stdout)["deleted"], true);
    let p = d
        .airlock(&["volume", "create", "x", "--size-mib", "16"])
        .await;
    assert_eq!(p.status.code(), Some(0));
    let p = d.airlock(&["volume", "create", "x"]).await;
    assert_eq!(p.status.code(), Some(1), "a name twice: the daemon's error");
}

/// A scratch directory of this test.
fn scratch() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::SeqCst);
    let d = std::env::temp_dir().join(format!("airlock-cli-test-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A mock daemon on a Unix socket in a scratch directory.
struct Daemon {
    dir: PathBuf,
    mock: Mock,
}

impl Daemon {
    fn start() -> Self {
        let dir = scratch();
        let listener = tokio::net::UnixListener::bind(dir.join("d.sock")).unwrap();
        let mock = Mock::default();
        let service = AirlockServer::new(mock.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
        );
        Daemon { dir, mock }
    }

    async fn airlock(&self, args: &[&str]) -> ProcOutput {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_airlock"))
            .args(args)
            .env(
                "AIRLOCK_ADDR",
                format!("unix://{}", self.dir.join("d.sock").display()),
            )
            .env_remove("AIRLOCK_TOKEN")
            .current_dir(&self.dir)
            .output()
            .await
            .unwrap()
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.mock.0.lock().unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", text(b)))
}

#[tokio::test]
async fn create_prints_the_id_or_the_record() {
    let d = Daemon::start();
    let p = d
        .airlock(&["create", "--label", "demo=cli", "--env", "WHO=cli"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stdout), "sb-1\n");
    assert!(text(&p.stderr).starts_with("ready in "));

    std::fs::write(d.dir.join("in.py"), "print(1)\n").unwrap();
    let p = d
        .airlock(&[
            "--json",
            "create",
            "--disk-mib",
            "64",
            "--file",
            "in.py:/tmp/in.py:600",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    let v = json(&p.stdout);
    assert_eq!(
        (v["id"].as_str(), v["state"].as_str()),
        (Some("sb-1"), Some("running"))
    );
    let req = d.seen().create.clone().unwrap();
    assert_eq!(req.disk_mib, 64);
    assert_eq!(req.files.len(), 1);
    assert_eq!(
        (req.files[0].mode, req.files[0].content.as_slice()),
        (0o600, &b"print(1)\n"[..])
    );

    let p = d.airlock(&["create", "--file", "absent:/tmp/x"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(
        text(&p.stderr).starts_with("airlock: absent: "),
        "{}",
        text(&p.stderr)
    );
}

#[tokio::test]
async fn exec_streams_and_exits_with_the_remote_code() {
    let d = Daemon::start();
    let p = d
        .airlock(&["exec", "sb-1", "--", "sh", "-c", "exit 7"])
        .await;
    assert_eq!(p.status.code(), Some(7));
    assert_eq!(
        (text(&p.stdout), text(&p.stderr)),
        ("hi\n".into(), "err\n".into())
    );

    let p = d.airlock(&["--json", "exec", "sb-1", "--", "true"]).await;
    assert_eq!(p.status.code(), Some(7));
    assert_eq!(text(&p.stdout), "hi\n");
    let first = text(&p.stderr).lines().next().unwrap().to_owned();
    assert_eq!(json(first.as_bytes())["execution_id"], "ex-7");

    let p = d
        .airlock(&["exec", "sb-1", "--timeout", "2", "--", "sleep", "60"])
        .await;
    assert_eq!(p.status.code(), Some(124));
    assert!(text(&p.stderr).contains("EXEC_TIMEOUT"));
    assert_eq!(d.seen().exec.as_ref().unwrap().timeout_ms, 2000);

    let p = d.airlock(&["logs", "ex-7"]).await;
    assert_eq!((p.status.code(), text(&p.stdout)), (Some(7), "hi\n".into()));

    let p = d.airlock(&["exec", "sb-0", "--", "true"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(text(&p.stderr).contains("SANDBOX_NOT_FOUND"));
}

#[tokio::test]
async fn exec_sends_stdin_shell_and_code() {
    let d = Daemon::start();
    std::fs::write(d.dir.join("input"), "data").unwrap();
    let p = d
        .airlock(&["exec", "sb-1", "--stdin", "input", "--shell", "cat"])
        .await;
    assert_eq!(p.status.code(), Some(7), "{}", text(&p.stderr));
    let req = d.seen().exec.clone().unwrap();
    assert_eq!(req.stdin, b"data");
    assert_eq!(
        req.command,
        Some(exec_request::Command::Shell("cat".into()))
    );

    let p = d
        .airlock(&["exec", "sb-1", "--code", "print(1)", "--language", "python"])
        .await;
    assert_eq!(p.status.code(), Some(7), "{}", text(&p.stderr));
    let cmd = d.seen().exec.clone().unwrap().command;
    assert!(matches!(cmd, Some(exec_request::Command::Code(c)) if c.language == "python"));
}

#[tokio::test]
async fn lists_and_records() {
    let d = Daemon::start();
    let p = d.airlock(&["ls"]).await;
    assert!(text(&p.stdout).starts_with("ID "), "{}", text(&p.stdout));
    assert!(text(&p.stdout).contains("sb-1"));
    let v = json(
        &d.airlock(&["ls", "--json", "--state", "paused"])
            .await
            .stdout,
    );
    assert_eq!(v[0]["id"], "sb-1");
    assert_eq!(
        d.seen().list.as_ref().unwrap().states,
        [SandboxState::Paused as i32]
    );

    assert!(text(&d.airlock(&["template", "ls"]).await.stdout).contains("base"));
    assert_eq!(
        json(&d.airlock(&["--json", "template", "ls"]).await.stdout)[0]["name"],
        "base"
    );
    assert_eq!(
        json(&d.airlock(&["--json", "get", "sb-1"]).await.stdout)["id"],
        "sb-1"
    );
    let got = text(&d.airlock(&["get", "sb-1"]).await.stdout);
    assert!(got.contains("running"), "{got}");
    assert!(
        got.lines().any(|l| l == "network          deny-all"),
        "{got}"
    );
    assert!(text(&d.airlock(&["usage"]).await.stdout).contains("sandboxes      2 of 64"));
    let u = json(&d.airlock(&["--json", "usage"]).await.stdout);
    assert_eq!(
        (u["live_sandboxes"].as_u64(), u["output_bytes"].as_u64()),
        (Some(2), Some(1234))
    );
    let p = d.airlock(&["get", "sb-2"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(text(&p.stderr).starts_with("airlock: NotFound: no sandbox sb-2"));
}

#[tokio::test]
async fn quiet_commands_print_json_objects() {
    let d = Daemon::start();
    for (args, key) in [
        (&["pause", "sb-1"][..], "state"),
        (&["resume", "sb-1"], "state"),
        (&["rm", "sb-1"], "destroyed"),
        (&["template", "rm", "x"], "deleted"),
        (&["kill", "ex-7"], "signalled"),
        (&["snapshot", "sb-1", "snap"], "name"),
    ] {
        let p = d.airlock(args).await;
        assert_eq!(p.status.code(), Some(0), "{args:?}: {}", text(&p.stderr));
        if key != "name" {
            assert!(p.stdout.is_empty(), "{args:?} prints nothing as text");
        }
        let p = d.airlock(&[&["--json"][..], args].concat()).await;
        assert!(
            json(&p.stdout).get(key).is_some(),
            "{args:?}: {}",
            text(&p.stdout)
        );
    }
    assert_eq!(
        json(&d.airlock(&["--json", "pause", "sb-1"]).await.stdout)["state"],
        "paused"
    );
}

#[tokio::test]
async fn cp_both_ways() {
    let d = Daemon::start();
    std::fs::write(d.dir.join("in.txt"), "payload\n").unwrap();
    let p = d
        .airlock(&["cp", "--mode", "0640", "in.txt", "sb-1:/tmp/in.txt"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stderr), "8 bytes written\n");
    assert_eq!(d.seen().files["/tmp/in.txt"].0, 0o640);
    let p = d
        .airlock(&["--json", "cp", "sb-1:/tmp/in.txt", "out.txt"])
        .await;
    assert_eq!(json(&p.stdout)["bytes_read"], 8);
    assert_eq!(
        std::fs::read_to_string(d.dir.join("out.txt")).unwrap(),
        "payload\n"
    );
    let p = d.airlock(&["cp", "in.txt", "sb-1:/etc/in.txt"]).await;
    assert_eq!(p.status.code(), Some(1));
    assert!(text(&p.stderr).contains("PATH_NOT_ALLOWED"));
    let p = d.airlock(&["cp", "a", "b"]).await;
    assert_eq!(p.status.code(), Some(1));
}

#[tokio::test]
async fn template_create_shows_progress() {
    let d = Daemon::start();
    let p = d
        .airlock(&["template", "create", "py", "--vcpus", "2", "--no-warmup"])
        .await;
    assert_eq!(p.status.code(), Some(0));
    assert_eq!(text(&p.stdout), "py (tpl-py)\n");
    assert!(text(&p.stderr).contains("booting: cold boot"));
    let req = d.seen().template.clone().unwrap();
    assert!(req.no_warmup && req.vcpus == 2);
}

#[tokio::test]
async fn template_build_sends_the_dockerfile_and_its_context() {
    let d = Daemon::start();
    let ctx = d.dir.join("ctx");
    std::fs::create_dir_all(ctx.join("src")).unwrap();
    std::fs::write(ctx.join("Dockerfile"), "FROM base\nRUN make\n").unwrap();
    std::fs::write(ctx.join("src/main.c"), "int main;\n").unwrap();
    let ctx_arg = ctx.display().to_string();
    let p = d
        .airlock(&[
            "template",
            "build",
            "app",
            &ctx_arg,
            "--build-arg",
            "V=1",
            "--ready-url",
            "http://localhost:8080/",
            "--allow-domain",
            "pypi.org",
        ])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stdout), "app (tpl-app)\n");
    let err = text(&p.stderr);
    assert!(
        err.contains("step: step 1/1") && err.contains("compiling\n"),
        "{err}"
    );
    let req = d.seen().build.clone().unwrap();
    assert_eq!(req.dockerfile, "FROM base\nRUN make\n");
    assert_eq!(req.build_args["V"], "1");
    assert_eq!(req.ready_url, "http://localhost:8080/");
    assert!(req.network.is_some());
    let mut names = Vec::new();
    let mut archive = tar::Archive::new(req.context.as_slice());
    for e in archive.entries().unwrap() {
        names.push(e.unwrap().path().unwrap().display().to_string());
    }
    assert_eq!(names, ["Dockerfile", "src", "src/main.c"]);
    let p = d
        .airlock(&["template", "build", "app", "/nonexistent"])
        .await;
    assert_eq!(p.status.code(), Some(1));
    assert!(text(&p.stderr).contains("/nonexistent/Dockerfile"));
}

#[tokio::test]
async fn template_rebuild_and_log_name_a_version() {
    let d = Daemon::start();
    let p = d
        .airlock(&["template", "rebuild", "py:v1", "--tag", "v2"])
        .await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stdout), "py:v2 (tpl-py)\n");
    let req = d.seen().rebuild.clone().unwrap();
    assert_eq!((req.name.as_str(), req.tag.as_str()), ("py:v1", "v2"));
    let p = d.airlock(&["template", "log", "py:v1"]).await;
    assert_eq!(p.status.code(), Some(0), "{}", text(&p.stderr));
    assert_eq!(text(&p.stdout), "[     1.0s] booting: cold boot\n");
    let p = d.airlock(&["template", "log", "py:v9"]).await;
    assert_eq!(p.status.code(), Some(1));
    let p = d
        .airlock(&["template", "sbom", "py:v1", "--format", "spdx"])
        .await;
    assert_eq!(text(&p.stdout), "{\"format\":\"spdx\"}\n");
    let p = d
        .airlock(&["template", "sbom", "py:v1", "--packages"])
        .await;
    assert_eq!(text(&p.stdout), "deb git 1:2.39\n");
}

#[tokio::test]
async fn usage_errors_exit_2_and_no_daemon_exits_1() {
    let d = Daemon::start();
    for args in [
        &[][..],
        &["exec", "sb-1"],
        &["create", "--env", "X"],
        &["nope"],
    ] {
        let p = d.airlock(args).await;
        assert_eq!(p.status.code(), Some(2), "{args:?}");
    }
    let p = d.airlock(&["completions", "bash"]).await;
    assert_eq!(p.status.code(), Some(0));
    assert!(text(&p.stdout).contains("airlock"));

    let p = d
        .airlock(&["--addr", "unix:///nonexistent/none.sock", "ls"])
        .await;
    assert_eq!(p.status.code(), Some(1));
    assert!(text(&p.stderr).contains("cannot reach airlockd"));
}
