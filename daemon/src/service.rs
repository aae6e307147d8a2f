//! The gRPC service: authentication (tenant from the token), then one call into `Daemon` per
//! RPC, with a tracing span per call.

use std::sync::Arc;
use std::time::Duration;

use airlock_api::v1::airlock_server::Airlock;
use airlock_api::v1::*;
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::error::{ApiError, ApiResult};
use crate::exec;
use crate::files;
use crate::state::{Daemon, well_formed};

/// The caller's tenant, put into each request by the listener's interceptor.
#[derive(Clone, Debug)]
pub struct Tenant(pub String);

/// Authentication for one listener: on a Unix socket a call without a token is the default
/// tenant; on TCP every call needs a token.
#[derive(Clone, Debug)]
pub struct Auth {
    pub daemon: Arc<Daemon>,
    pub token_required: bool,
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        let token = req
            .metadata()
            .get("authorization")
            .map(|v| v.to_str().unwrap_or_default().trim().to_owned());
        let tenant = match token {
            Some(t) => {
                let t = t.strip_prefix("Bearer ").unwrap_or(&t).trim().to_owned();
                self.daemon
                    .cfg
                    .tenant_of(&t)
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        Status::from(ApiError::Unauthenticated("unknown token".into()))
                    })?
            }
            None if self.token_required => {
                return Err(ApiError::Unauthenticated(
                    "this listener needs a token (metadata `authorization: Bearer TOKEN`)".into(),
                )
                .into());
            }
            None => self.daemon.cfg.default_tenant.clone(),
        };
        req.extensions_mut().insert(Tenant(tenant));
        Ok(req)
    }
}

/// The service implementation.
#[derive(Clone, Debug)]
pub struct Service {
    pub daemon: Arc<Daemon>,
}

fn tenant<T>(req: &Request<T>) -> Result<String, Status> {
    req.extensions()
        .get::<Tenant>()
        .map(|t| t.0.clone())
        .ok_or_else(|| Status::unauthenticated("no tenant"))
}

type Stream<T> = ReceiverStream<Result<T, Status>>;

/// Runs `f` inside a span named after the call, logging failures.
async fn traced<T>(
    call: &'static str,
    tenant: &str,
    f: impl std::future::Future<Output = ApiResult<T>>,
) -> Result<Response<T>, Status> {
    let span = tracing::info_span!("call", call, tenant);
    match f.instrument(span.clone()).await {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            span.in_scope(|| tracing::info!(reason = e.reason(), "failed: {e}"));
            Err(e.into())
        }
    }
}

impl Service {
    fn execution(
        &self,
        tenant: &str,
        id: &str,
    ) -> ApiResult<(Execution, Option<Arc<exec::ExecRt>>)> {
        check_execution_id(id)?;
        let live = self
            .daemon
            .executions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
            .cloned();
        if let Some(rt) = live.filter(|r| r.tenant == tenant) {
            return Ok((rt.record(), Some(rt)));
        }
        match self.daemon.store.execution(id)? {
            Some(e) if e.tenant == tenant => Ok((e, None)),
            _ => Err(ApiError::ExecutionNotFound(id.to_owned())),
        }
    }
}

/// Reads `[offset, end)` of a file in chunks, sending each as an Output event.
async fn send_range(
    tx: &tokio::sync::mpsc::Sender<Result<ExecutionEvent, Status>>,
    path: &std::path::Path,
    stream: StreamKind,
    offset: &mut u64,
    end: u64,
) -> bool {
    if *offset >= end {
        return true;
    }
    let Ok(mut f) = tokio::fs::File::open(path).await else {
        return false;
    };
    if f.seek(std::io::SeekFrom::Start(*offset)).await.is_err() {
        return false;
    }
    while *offset < end {
        let n = ((end - *offset) as usize).min(64 << 10);
        let mut buf = vec![0u8; n];
        let Ok(got) = f.read(&mut buf).await else {
            return false;
        };
        if got == 0 {
            break;
        }
        buf.truncate(got);
        let ev = ExecutionEvent {
            event: Some(execution_event::Event::Output(Output {
                stream: stream as i32,
                offset: *offset,
                data: buf,
            })),
        };
        *offset += got as u64;
        if tx.send(Ok(ev)).await.is_err() {
            return false;
        }
    }
    true
}

#[tonic::async_trait]
impl Airlock for Service {
    type CreateTemplateStream = Stream<TemplateEvent>;

    async fn create_template(
        &self,
        req: Request<CreateTemplateRequest>,
    ) -> Result<Response<Self::CreateTemplateStream>, Status> {
        let tenant = tenant(&req)?;
        let req = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let (ptx, mut prx) = tokio::sync::mpsc::channel::<TemplateEvent>(16);
        let d = self.daemon.clone();
        let span = tracing::info_span!("call", call = "CreateTemplate", tenant = %tenant, name = %req.name);
        // The build goes on if the client leaves (a template is worth finishing).
        let build = tokio::spawn(
            async move {
                let r = d.create_template(&tenant, req, ptx).await;
                if let Ok(t) = &r {
                    let rt = d.find_template(&t.tenant, &t.name);
                    if let Ok(rt) = rt {
                        d.refill_pool(&rt);
                    }
                }
                r
            }
            .instrument(span),
        );
        tokio::spawn(async move {
            while let Some(ev) = prx.recv().await {
                let _ = tx.send(Ok(ev)).await;
            }
            match build.await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    let _ = tx.send(Err(e.into())).await;
                }
                Err(e) => {
                    let _ = tx
                        .send(Err(Status::internal(format!("template build: {e}"))))
                        .await;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn list_templates(
        &self,
        req: Request<ListTemplatesRequest>,
    ) -> Result<Response<ListTemplatesResponse>, Status> {
        let tenant = tenant(&req)?;
        let templates = self
            .daemon
            .templates_for(&tenant)
            .into_iter()
            .map(|t| t.record)
            .collect();
        Ok(Response::new(ListTemplatesResponse { templates }))
    }

    async fn delete_template(
        &self,
        req: Request<DeleteTemplateRequest>,
    ) -> Result<Response<DeleteTemplateResponse>, Status> {
        let tenant = tenant(&req)?;
        let name = req.into_inner().name;
        traced("DeleteTemplate", &tenant, async {
            self.daemon.delete_template(&tenant, &name)?;
            Ok(DeleteTemplateResponse {})
        })
        .await
    }

    async fn create_sandbox(
        &self,
        req: Request<CreateSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = tenant(&req)?;
        let req = req.into_inner();
        let d = self.daemon.clone();
        // The create finishes (or cleans up) even if the client goes away mid-call.
        let t = tenant.clone();
        let work = tokio::spawn(async move { d.create_sandbox(&t, req).await });
        traced("CreateSandbox", &tenant, async {
            work.await
                .map_err(|e| ApiError::Internal(format!("create task: {e}")))?
        })
        .await
    }

    async fn get_sandbox(
        &self,
        req: Request<GetSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = tenant(&req)?;
        let id = req.into_inner().sandbox_id;
        traced("GetSandbox", &tenant, async {
            self.daemon.get_sandbox(&tenant, &id)
        })
        .await
    }

    async fn list_sandboxes(
        &self,
        req: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        let tenant = tenant(&req)?;
        let r = req.into_inner();
        traced("ListSandboxes", &tenant, async {
            Ok(ListSandboxesResponse {
                sandboxes: self.daemon.list_sandboxes(&tenant, &r.labels, &r.states)?,
            })
        })
        .await
    }

    async fn pause_sandbox(
        &self,
        req: Request<PauseSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = tenant(&req)?;
        let id = req.into_inner().sandbox_id;
        traced("PauseSandbox", &tenant, self.daemon.pause(&tenant, &id)).await
    }

    async fn resume_sandbox(
        &self,
        req: Request<ResumeSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = tenant(&req)?;
        let id = req.into_inner().sandbox_id;
        traced("ResumeSandbox", &tenant, self.daemon.resume(&tenant, &id)).await
    }

    async fn snapshot_sandbox(
        &self,
        req: Request<SnapshotSandboxRequest>,
    ) -> Result<Response<Template>, Status> {
        let tenant = tenant(&req)?;
        let r = req.into_inner();
        let d = self.daemon.clone();
        traced("SnapshotSandbox", &tenant, async {
            let t = d
                .snapshot_sandbox(&tenant, &r.sandbox_id, &r.template_name)
                .await?;
            if let Ok(rt) = d.find_template(&tenant, &t.name) {
                d.refill_pool(&rt);
            }
            Ok(t)
        })
        .await
    }

    async fn destroy_sandbox(
        &self,
        req: Request<DestroySandboxRequest>,
    ) -> Result<Response<DestroySandboxResponse>, Status> {
        let tenant = tenant(&req)?;
        let id = req.into_inner().sandbox_id;
        let d = self.daemon.clone();
        let t = tenant.clone();
        let work = tokio::spawn(async move { d.destroy_sandbox(&t, &id).await });
        traced("DestroySandbox", &tenant, async {
            let destroyed = work
                .await
                .map_err(|e| ApiError::Internal(format!("destroy task: {e}")))??;
            Ok(DestroySandboxResponse { destroyed })
        })
        .await
    }

    async fn exec(&self, req: Request<ExecRequest>) -> Result<Response<ExecResponse>, Status> {
        let tenant = tenant(&req)?;
        let r = req.into_inner();
        traced("Exec", &tenant, async {
            let sb = self.daemon.running(&tenant, &r.sandbox_id)?;
            let execution_id = exec::start(&self.daemon, &sb, r)?;
            Ok(ExecResponse { execution_id })
        })
        .await
    }

    type StreamExecutionStream = Stream<ExecutionEvent>;

    async fn stream_execution(
        &self,
        req: Request<StreamExecutionRequest>,
    ) -> Result<Response<Self::StreamExecutionStream>, Status> {
        let tenant = tenant(&req)?;
        let r = req.into_inner();
        let (_, live) = self
            .execution(&tenant, &r.execution_id)
            .map_err(Status::from)?;
        let d = self.daemon.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(32);
        tokio::spawn(async move {
            let paths = exec::output_paths(&d, &r.execution_id);
            let mut offsets = [r.stdout_offset, r.stderr_offset];
            let mut changed = live.as_ref().map(|l| l.changed.subscribe());
            loop {
                // What is stored now, and whether it is the end.
                let (ends, finished) = match &live {
                    Some(l) => {
                        let fin = l.is_finished();
                        (l.stored(), fin)
                    }
                    None => {
                        let len = |p: &std::path::Path| {
                            std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
                        };
                        ([len(&paths[0]), len(&paths[1])], true)
                    }
                };
                for (i, kind) in [(0, StreamKind::Stdout), (1, StreamKind::Stderr)] {
                    if !send_range(&tx, &paths[i], kind, &mut offsets[i], ends[i]).await {
                        return;
                    }
                }
                if finished {
                    let record = match d.store.execution(&r.execution_id) {
                        Ok(Some(e)) => e,
                        _ => {
                            let _ = tx
                                .send(Err(Status::internal("execution record lost")))
                                .await;
                            return;
                        }
                    };
                    // Output written between the check and the end.
                    for (i, kind) in [(0, StreamKind::Stdout), (1, StreamKind::Stderr)] {
                        let end = std::fs::metadata(&paths[i]).map(|m| m.len()).unwrap_or(0);
                        if !send_range(&tx, &paths[i], kind, &mut offsets[i], end).await {
                            return;
                        }
                    }
                    let _ = tx
                        .send(Ok(ExecutionEvent {
                            event: Some(execution_event::Event::Exit(record)),
                        }))
                        .await;
                    return;
                }
                if let Some(c) = changed.as_mut() {
                    let _ = tokio::time::timeout(Duration::from_millis(500), c.changed()).await;
                }
                if tx.is_closed() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_execution(
        &self,
        req: Request<GetExecutionRequest>,
    ) -> Result<Response<GetExecutionResponse>, Status> {
        let tenant = tenant(&req)?;
        let r = req.into_inner();
        traced("GetExecution", &tenant, async {
            let (execution, _) = self.execution(&tenant, &r.execution_id)?;
            let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
            if r.include_output {
                let paths = exec::output_paths(&self.daemon, &r.execution_id);
                let limit = self.daemon.cfg.max_file_bytes;
                for (p, out) in paths.iter().zip([&mut stdout, &mut stderr]) {
                    let f = tokio::fs::File::open(p).await?;
                    f.take(limit).read_to_end(out).await?;
                }
            }
            Ok(GetExecutionResponse {
                execution: Some(execution),
                stdout,
                stderr,
            })
        })
        .await
    }

    async fn kill_execution(
        &self,
        req: Request<KillExecutionRequest>,
    ) -> Result<Response<KillExecutionResponse>, Status> {
        let tenant = tenant(&req)?;
        let r = req.into_inner();
        traced("KillExecution", &tenant, async {
            let (_, live) = self.execution(&tenant, &r.execution_id)?;
            let Some(rt) = live.filter(|l| !l.is_finished()) else {
                return Ok(KillExecutionResponse { signalled: false });
            };
            let signal = if r.signal == 0 {
                libc::SIGKILL
            } else {
                r.signal
            };
            if !(1..=64).contains(&signal) {
                return Err(ApiError::InvalidArgument(format!("signal {signal}")));
            }
            if signal == libc::SIGKILL {
                let d = self.daemon.clone();
                tokio::spawn(async move {
                    rt.end_by(
                        &d,
                        ExecutionState::Killed,
                        "KILLED",
                        "killed by KillExecution",
                        libc::SIGKILL,
                    )
                    .await;
                });
            } else {
                rt.signal(signal).map_err(ApiError::Internal)?;
            }
            Ok(KillExecutionResponse { signalled: true })
        })
        .await
    }

    async fn write_file(
        &self,
        req: Request<Streaming<WriteFileRequest>>,
    ) -> Result<Response<WriteFileResponse>, Status> {
        let tenant = tenant(&req)?;
        let mut stream = req.into_inner();
        let d = self.daemon.clone();
        traced("WriteFile", &tenant.clone(), async move {
            let header = match stream.message().await {
                Ok(Some(WriteFileRequest {
                    part: Some(write_file_request::Part::Header(h)),
                })) => h,
                Ok(_) => {
                    return Err(ApiError::InvalidArgument(
                        "the first message must be the header".into(),
                    ));
                }
                Err(s) => return Err(ApiError::InvalidArgument(format!("request stream: {s}"))),
            };
            let sb = d.running(&tenant, &header.sandbox_id)?;
            let (root, rel) = files::check_path(&header.path, &sb.policy.writable, "writable")?;
            let (root, rel) = (root.to_owned(), rel.to_owned());
            let vsock = sb
                .vmm()
                .ok_or_else(|| ApiError::Internal("no VMM".into()))?
                .vsock;
            let mode = if header.mode == 0 {
                0o644
            } else {
                header.mode & 0o7777
            };
            let limit = d.cfg.max_file_bytes;
            let disk_bytes = u64::from(sb.snapshot().disk_mib) << 20;
            let id = sb.id.clone();
            // The agent connection is synchronous: chunks go to a blocking task through a channel.
            let (ctx, mut crx) = tokio::sync::mpsc::channel::<Vec<u8>>(4);
            let writer =
                tokio::task::spawn_blocking(move || -> ApiResult<u64> {
                    let mut client = crate::agent::client(&vsock, Duration::from_secs(30))
                        .map_err(|m| ApiError::AgentUnavailable {
                            id: id.clone(),
                            message: m,
                        })?;
                    // A policy may name a directory the image lacks.
                    if root != "/" {
                        let _ = client.mkdir(&root, true);
                    }
                    let mut offset = 0u64;
                    let mut pending: Vec<u8> = Vec::new();
                    let mut first = true;
                    loop {
                        let next = crx.blocking_recv();
                        if let Some(data) = &next {
                            pending.extend_from_slice(data);
                        }
                        while pending.len() >= airlock_proto::MAX_FILE_CHUNK
                            || (next.is_none() && (!pending.is_empty() || first))
                        {
                            let n = pending.len().min(airlock_proto::MAX_FILE_CHUNK);
                            let chunk: Vec<u8> = pending.drain(..n).collect();
                            files::write_chunk(&mut client, &root, &rel, offset, chunk, mode)
                                .map_err(|m| {
                                    if m.contains("PathEscape") || m.contains("PATH_ESCAPE") {
                                        ApiError::PathNotAllowed {
                                            path: rel.clone(),
                                            why: m,
                                        }
                                    } else if m.contains("NoSpace") || m.contains("NO_SPACE") {
                                        ApiError::DiskQuota {
                                            limit: disk_bytes,
                                            message: m,
                                        }
                                    } else {
                                        ApiError::InvalidArgument(format!("writing {rel}: {m}"))
                                    }
                                })?;
                            offset += n as u64;
                            first = false;
                            if next.is_none() && pending.is_empty() {
                                break;
                            }
                        }
                        if next.is_none() {
                            return Ok(offset);
                        }
                    }
                });
            let mut total = 0u64;
            loop {
                match stream.message().await {
                    Ok(Some(WriteFileRequest {
                        part: Some(write_file_request::Part::Data(data)),
                    })) => {
                        total += data.len() as u64;
                        if total > limit {
                            drop(ctx);
                            let _ = writer.await;
                            return Err(ApiError::FileTooLarge { size: total, limit });
                        }
                        if ctx.send(data).await.is_err() {
                            break;
                        }
                    }
                    Ok(None) => break,
                    Ok(Some(_)) => {
                        return Err(ApiError::InvalidArgument(
                            "only data may follow the header".into(),
                        ));
                    }
                    Err(s) => {
                        return Err(ApiError::InvalidArgument(format!("request stream: {s}")));
                    }
                }
            }
            drop(ctx);
            let bytes_written = writer
                .await
                .map_err(|e| ApiError::Internal(format!("file task: {e}")))??;
            Ok(WriteFileResponse { bytes_written })
        })
        .await
    }

    type ReadFileStream = Stream<FileChunk>;

    async fn read_file(
        &self,
        req: Request<ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let tenant = tenant(&req)?;
        let r = req.into_inner();
        let sb = self
            .daemon
            .running(&tenant, &r.sandbox_id)
            .map_err(Status::from)?;
        let (root, rel) = files::check_path(&r.path, &sb.policy.exportable, "exportable")
            .map(|(a, b)| (a.to_owned(), b.to_owned()))
            .map_err(Status::from)?;
        let vsock = sb.vmm().ok_or_else(|| Status::internal("no VMM"))?.vsock;
        let limit = self.daemon.cfg.max_file_bytes;
        let id = sb.id.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::task::spawn_blocking(move || {
            let mut client = match crate::agent::client(&vsock, Duration::from_secs(30)) {
                Ok(c) => c,
                Err(m) => {
                    let _ =
                        tx.blocking_send(Err(ApiError::AgentUnavailable { id, message: m }.into()));
                    return;
                }
            };
            let mut offset = 0u64;
            loop {
                let chunk = match files::read_chunk(&mut client, &root, &rel, offset) {
                    Ok(c) => c,
                    Err(m) => {
                        let e = if m.contains("NotFound") || m.contains("NOT_FOUND") {
                            Status::not_found(format!("{rel}: {m}"))
                        } else if m.contains("PathEscape") || m.contains("PATH_ESCAPE") {
                            ApiError::PathNotAllowed {
                                path: rel.clone(),
                                why: m,
                            }
                            .into()
                        } else {
                            Status::invalid_argument(format!("reading {rel}: {m}"))
                        };
                        let _ = tx.blocking_send(Err(e));
                        return;
                    }
                };
                if offset == 0 && chunk.size > limit {
                    let _ = tx.blocking_send(Err(ApiError::FileTooLarge {
                        size: chunk.size,
                        limit,
                    }
                    .into()));
                    return;
                }
                offset += chunk.data.len() as u64;
                let eof = chunk.eof || chunk.data.is_empty();
                let msg = FileChunk {
                    data: chunk.data,
                    size: chunk.size,
                };
                if tx.blocking_send(Ok(msg)).is_err() || eof {
                    return;
                }
                if offset > limit {
                    let _ = tx.blocking_send(Err(ApiError::FileTooLarge {
                        size: offset,
                        limit,
                    }
                    .into()));
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn list_files(
        &self,
        req: Request<ListFilesRequest>,
    ) -> Result<Response<ListFilesResponse>, Status> {
        let tenant = tenant(&req)?;
        let r = req.into_inner();
        traced("ListFiles", &tenant, async {
            let sb = self.daemon.running(&tenant, &r.sandbox_id)?;
            let (root, rel) = files::check_path(&r.path, &sb.policy.exportable, "exportable")?;
            let (root, rel) = (root.to_owned(), rel.to_owned());
            let vsock = sb
                .vmm()
                .ok_or_else(|| ApiError::Internal("no VMM".into()))?
                .vsock;
            let id = sb.id.clone();
            let listing = tokio::task::spawn_blocking(move || {
                let mut client = crate::agent::client(&vsock, Duration::from_secs(30))
                    .map_err(|m| ApiError::AgentUnavailable { id, message: m })?;
                files::list(&mut client, &root, &rel)
                    .map_err(|m| ApiError::InvalidArgument(format!("listing {rel}: {m}")))
            })
            .await
            .map_err(|e| ApiError::Internal(format!("list task: {e}")))??;
            Ok(ListFilesResponse {
                entries: listing
                    .entries
                    .into_iter()
                    .map(|e| FileEntry {
                        name: e.name,
                        is_dir: e.kind == airlock_proto::pb::FileKind::Dir as i32,
                        size: e.size,
                        mode: e.mode,
                    })
                    .collect(),
            })
        })
        .await
    }
}

/// Ids from clients are checked before they touch paths.
pub fn check_execution_id(id: &str) -> ApiResult<()> {
    if well_formed(id, "ex") {
        Ok(())
    } else {
        Err(ApiError::ExecutionNotFound(id.to_owned()))
    }
}
