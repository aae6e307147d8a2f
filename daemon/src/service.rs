//! The gRPC service, thin: authenticate (the tenant from the token), convert, call the
//! daemon's parts, convert back, with a tracing span per call. File transfer lives in
//! `files`, the output stream in `stream`.

use std::sync::Arc;

use airlock_api::v1::airlock_server::Airlock;
use airlock_api::v1::*;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::auth::{TemplateRight, Tenant};
use crate::cluster::Cluster;
use crate::daemon::Daemon;
use crate::error::{ApiError, ApiResult};
use crate::rpc::{self, Right, Rpc};
use crate::{files, stream};

/// The service implementation.
#[derive(Clone, Debug)]
pub struct Service {
    pub daemon: Arc<Daemon>,
    /// Cluster mode: this node in its cluster.
    pub cluster: Option<Arc<Cluster>>,
}

impl Service {
    /// Makes a template as `recipe` says (CreateTemplate, BuildTemplate or a rebuild), its
    /// progress streamed; the build goes on if the client leaves (a template is worth
    /// finishing), and its recipe and log are kept beside it.
    fn template_stream(
        &self,
        rpc: &'static Rpc,
        tenant: String,
        recipe: template_recipe::How,
    ) -> Response<Stream<TemplateEvent>> {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let (ptx, mut prx) = tokio::sync::mpsc::channel::<TemplateEvent>(16);
        let d = self.daemon.clone();
        let span = tracing::info_span!("call", call = rpc.name, tenant = %tenant);
        let build =
            tokio::spawn(crate::versions::make_and_keep(d, tenant, recipe, ptx).instrument(span));
        tokio::spawn(async move {
            while let Some(ev) = prx.recv().await {
                let _ = tx.send(Ok(ev)).await;
            }
            let end = match build.await {
                Ok(Ok(_)) => return,
                Ok(Err(e)) => e.into(),
                Err(e) => Status::internal(format!("template build: {e}")),
            };
            let _ = tx.send(Err(end)).await;
        });
        Response::new(ReceiverStream::new(rx))
    }

    /// The code interpreter of a running sandbox of `tenant`.
    fn interp(&self, tenant: &str, id: &str) -> ApiResult<crate::interp::Interp> {
        let sb = self.daemon.sandboxes.running(tenant, id)?;
        crate::interp::Interp::of(&sb, self.daemon.cfg.max_exec_timeout_ms)
    }

    /// The files of a running sandbox of `tenant`, acting as `user`.
    fn file_target(&self, tenant: &str, id: &str, user: String) -> ApiResult<files::FileTarget> {
        let sb = self.daemon.sandboxes.running(tenant, id)?;
        sb.file_target(self.daemon.cfg.max_file_bytes)?
            .acting_as(user)
    }
}

fn tenant<T>(req: &Request<T>) -> Result<String, Status> {
    req.extensions()
        .get::<Tenant>()
        .map(|t| t.0.clone())
        .ok_or_else(|| Status::unauthenticated("no tenant"))
}

/// The caller's tenant, if its token has the right `rpc` needs (NOT_PERMITTED otherwise).
fn authorize<T>(req: &Request<T>, rpc: &Rpc) -> Result<String, Status> {
    let tenant = tenant(req)?;
    let may_make_templates = req.extensions().get::<TemplateRight>().is_some_and(|r| r.0);
    match rpc.right {
        Right::Run => Ok(tenant),
        Right::MakeTemplates if may_make_templates => Ok(tenant),
        Right::MakeTemplates => {
            let e = ApiError::NotPermitted(format!(
                "{}: this token of tenant {tenant} may run sandboxes but not make or delete \
                 templates (it is one of its run_tokens)",
                rpc.name
            ));
            crate::audit::denial(&tenant, "", rpc.name, &e);
            Err(e.into())
        }
    }
}

type Stream<T> = ReceiverStream<Result<T, Status>>;

/// Runs `f` inside a span named after the call, logging failures.
async fn traced<T>(
    rpc: &'static Rpc,
    tenant: &str,
    f: impl std::future::Future<Output = ApiResult<T>>,
) -> Result<Response<T>, Status> {
    let call = rpc.name;
    let span = tracing::info_span!("call", call, tenant);
    match f.instrument(span.clone()).await {
        Ok(v) => Ok(Response::new(v)),
        Err(e) => {
            span.in_scope(|| tracing::info!(reason = e.reason(), "failed: {e}"));
            crate::audit::denial(tenant, "", call, &e);
            Err(crate::secrets::logs::redact_status(tenant, e.into()))
        }
    }
}

/// Runs `f` on a task of its own, so that it finishes (or cleans up) even if the client goes
/// away mid-call.
async fn detached<T: Send + 'static>(
    f: impl std::future::Future<Output = ApiResult<T>> + Send + 'static,
) -> ApiResult<T> {
    tokio::spawn(f)
        .await
        .map_err(|e| ApiError::Internal(format!("call task: {e}")))?
}

#[tonic::async_trait]
impl Airlock for Service {
    type CreateTemplateStream = Stream<TemplateEvent>;

    async fn create_template(
        &self,
        req: Request<CreateTemplateRequest>,
    ) -> Result<Response<Self::CreateTemplateStream>, Status> {
        let tenant = authorize(&req, &rpc::CREATE_TEMPLATE)?;
        let recipe = template_recipe::How::Create(req.into_inner());
        Ok(self.template_stream(&rpc::CREATE_TEMPLATE, tenant, recipe))
    }

    type BuildTemplateStream = Stream<TemplateEvent>;

    async fn build_template(
        &self,
        req: Request<BuildTemplateRequest>,
    ) -> Result<Response<Self::BuildTemplateStream>, Status> {
        let tenant = authorize(&req, &rpc::BUILD_TEMPLATE)?;
        let recipe = template_recipe::How::Build(req.into_inner());
        Ok(self.template_stream(&rpc::BUILD_TEMPLATE, tenant, recipe))
    }

    type RebuildTemplateStream = Stream<TemplateEvent>;

    async fn rebuild_template(
        &self,
        req: Request<RebuildTemplateRequest>,
    ) -> Result<Response<Self::RebuildTemplateStream>, Status> {
        let tenant = authorize(&req, &rpc::REBUILD_TEMPLATE)?;
        let r = req.into_inner();
        let recipe = crate::versions::rebuild_recipe(&self.daemon, &tenant, r)
            .inspect_err(|e| crate::audit::denial(&tenant, "", rpc::REBUILD_TEMPLATE.name, e))?;
        Ok(self.template_stream(&rpc::REBUILD_TEMPLATE, tenant, recipe))
    }

    async fn get_template_sbom(
        &self,
        req: Request<GetTemplateSbomRequest>,
    ) -> Result<Response<GetTemplateSbomResponse>, Status> {
        let tenant = authorize(&req, &rpc::GET_TEMPLATE_SBOM)?;
        let r = req.into_inner();
        let (d, t) = (self.daemon.clone(), tenant.clone());
        traced(
            &rpc::GET_TEMPLATE_SBOM,
            &tenant,
            detached(async move { crate::sbom::of_template(&d, &t, &r.name, &r.format).await }),
        )
        .await
    }

    async fn get_template_log(
        &self,
        req: Request<GetTemplateLogRequest>,
    ) -> Result<Response<GetTemplateLogResponse>, Status> {
        let tenant = authorize(&req, &rpc::GET_TEMPLATE_LOG)?;
        let name = req.into_inner().name;
        traced(&rpc::GET_TEMPLATE_LOG, &tenant, async {
            let t = self.daemon.templates.find(&tenant, &name)?;
            Ok(crate::versions::log_of(&t))
        })
        .await
    }

    async fn list_templates(
        &self,
        req: Request<ListTemplatesRequest>,
    ) -> Result<Response<ListTemplatesResponse>, Status> {
        let tenant = authorize(&req, &rpc::LIST_TEMPLATES)?;
        let operator = self.daemon.cfg.is_operator(&tenant);
        let templates = self
            .daemon
            .templates
            .for_tenant(&tenant)
            .into_iter()
            .map(|t| {
                let mut r = crate::templates::as_seen_by(t.record, operator);
                r.live_sandboxes = self.daemon.template_users(&r.id).len() as u32;
                r
            })
            .collect();
        Ok(Response::new(ListTemplatesResponse { templates }))
    }

    async fn delete_template(
        &self,
        req: Request<DeleteTemplateRequest>,
    ) -> Result<Response<DeleteTemplateResponse>, Status> {
        let tenant = authorize(&req, &rpc::DELETE_TEMPLATE)?;
        let name = req.into_inner().name;
        traced(&rpc::DELETE_TEMPLATE, &tenant, async {
            self.daemon.delete_template(&tenant, &name)?;
            Ok(DeleteTemplateResponse {})
        })
        .await
    }

    async fn create_sandbox(
        &self,
        req: Request<CreateSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = authorize(&req, &rpc::CREATE_SANDBOX)?;
        let (d, t, req) = (self.daemon.clone(), tenant.clone(), req.into_inner());
        let cluster = self.cluster.clone();
        traced(
            &rpc::CREATE_SANDBOX,
            &tenant,
            detached(async move {
                if let Some(c) = cluster {
                    // Cluster mode: a template this node lacks is fetched from one that has it.
                    c.ensure_template(&t, &req.template).await?;
                }
                d.sandboxes.create(&t, req).await
            }),
        )
        .await
    }

    async fn get_sandbox(
        &self,
        req: Request<GetSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = authorize(&req, &rpc::GET_SANDBOX)?;
        let id = req.into_inner().sandbox_id;
        traced(&rpc::GET_SANDBOX, &tenant, async {
            self.daemon.sandboxes.get(&tenant, &id)
        })
        .await
    }

    async fn list_sandboxes(
        &self,
        req: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        let tenant = authorize(&req, &rpc::LIST_SANDBOXES)?;
        let r = req.into_inner();
        traced(&rpc::LIST_SANDBOXES, &tenant, async {
            let sandboxes = self.daemon.sandboxes.list(&tenant, &r.labels, &r.states)?;
            Ok(ListSandboxesResponse { sandboxes })
        })
        .await
    }

    async fn pause_sandbox(
        &self,
        req: Request<PauseSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = authorize(&req, &rpc::PAUSE_SANDBOX)?;
        let id = req.into_inner().sandbox_id;
        traced(
            &rpc::PAUSE_SANDBOX,
            &tenant,
            self.daemon.sandboxes.pause(&tenant, &id),
        )
        .await
    }

    async fn resume_sandbox(
        &self,
        req: Request<ResumeSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = authorize(&req, &rpc::RESUME_SANDBOX)?;
        let id = req.into_inner().sandbox_id;
        traced(
            &rpc::RESUME_SANDBOX,
            &tenant,
            self.daemon.sandboxes.resume(&tenant, &id),
        )
        .await
    }

    async fn snapshot_sandbox(
        &self,
        req: Request<SnapshotSandboxRequest>,
    ) -> Result<Response<Template>, Status> {
        let tenant = authorize(&req, &rpc::SNAPSHOT_SANDBOX)?;
        let r = req.into_inner();
        traced(&rpc::SNAPSHOT_SANDBOX, &tenant, async {
            let t = self
                .daemon
                .snapshot_sandbox(&tenant, &r.sandbox_id, &r.template_name, r.shared)
                .await?;
            let operator = self.daemon.cfg.is_operator(&tenant);
            Ok(crate::templates::as_seen_by(t.record, operator))
        })
        .await
    }

    async fn destroy_sandbox(
        &self,
        req: Request<DestroySandboxRequest>,
    ) -> Result<Response<DestroySandboxResponse>, Status> {
        let tenant = authorize(&req, &rpc::DESTROY_SANDBOX)?;
        let (s, t, id) = (
            self.daemon.sandboxes.clone(),
            tenant.clone(),
            req.into_inner().sandbox_id,
        );
        traced(&rpc::DESTROY_SANDBOX, &tenant, async move {
            let destroyed = detached(async move { s.destroy(&t, &id).await }).await?;
            Ok(DestroySandboxResponse { destroyed })
        })
        .await
    }

    async fn exec(&self, req: Request<ExecRequest>) -> Result<Response<ExecResponse>, Status> {
        let tenant = authorize(&req, &rpc::EXEC)?;
        let r = req.into_inner();
        traced(&rpc::EXEC, &tenant, async {
            let sb = self.daemon.sandboxes.running(&tenant, &r.sandbox_id)?;
            let execution_id = self.daemon.executions.start(&sb.exec_target()?, &r)?;
            Ok(ExecResponse { execution_id })
        })
        .await
    }

    type StreamExecutionStream = Stream<ExecutionEvent>;

    async fn stream_execution(
        &self,
        req: Request<StreamExecutionRequest>,
    ) -> Result<Response<Self::StreamExecutionStream>, Status> {
        let tenant = authorize(&req, &rpc::STREAM_EXECUTION)?;
        let r = req.into_inner();
        let executions = self.daemon.executions.clone();
        let (_, live) = executions.get(&tenant, &r.execution_id)?;
        let (tx, rx) = tokio::sync::mpsc::channel(32);
        let offsets = [r.stdout_offset, r.stderr_offset];
        tokio::spawn(stream::follow(
            executions,
            r.execution_id,
            live,
            offsets,
            tx,
        ));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_execution(
        &self,
        req: Request<GetExecutionRequest>,
    ) -> Result<Response<GetExecutionResponse>, Status> {
        let tenant = authorize(&req, &rpc::GET_EXECUTION)?;
        let r = req.into_inner();
        // The output's share of the daemon's budget goes with the response (to its encoding).
        let mut held = None;
        let answer = traced(&rpc::GET_EXECUTION, &tenant, async {
            let executions = &self.daemon.executions;
            let (execution, _) = executions.get(&tenant, &r.execution_id)?;
            let [stdout, stderr] = if r.include_output {
                let max = self.daemon.cfg.max_file_bytes;
                let (out, hold) = executions.read_output(&r.execution_id, max).await?;
                held = Some(hold);
                out
            } else {
                Default::default()
            };
            Ok(GetExecutionResponse {
                execution: Some(execution),
                stdout,
                stderr,
            })
        })
        .await;
        answer.map(|mut resp| {
            resp.extensions_mut().insert(held);
            resp
        })
    }

    async fn kill_execution(
        &self,
        req: Request<KillExecutionRequest>,
    ) -> Result<Response<KillExecutionResponse>, Status> {
        let tenant = authorize(&req, &rpc::KILL_EXECUTION)?;
        let r = req.into_inner();
        traced(&rpc::KILL_EXECUTION, &tenant, async {
            let signalled = self
                .daemon
                .executions
                .kill(&tenant, &r.execution_id, r.signal)?;
            Ok(KillExecutionResponse { signalled })
        })
        .await
    }

    async fn write_stdin(
        &self,
        req: Request<WriteStdinRequest>,
    ) -> Result<Response<WriteStdinResponse>, Status> {
        let tenant = authorize(&req, &rpc::WRITE_STDIN)?;
        let r = req.into_inner();
        traced(&rpc::WRITE_STDIN, &tenant, async {
            self.daemon
                .executions
                .write_stdin(&tenant, &r.execution_id, r.data, r.eof)
                .await?;
            Ok(WriteStdinResponse {})
        })
        .await
    }

    async fn write_file(
        &self,
        req: Request<Streaming<WriteFileRequest>>,
    ) -> Result<Response<WriteFileResponse>, Status> {
        let tenant = authorize(&req, &rpc::WRITE_FILE)?;
        let mut stream = req.into_inner();
        let d = self.daemon.clone();
        traced(&rpc::WRITE_FILE, &tenant.clone(), async move {
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
            let sb = d.sandboxes.running(&tenant, &header.sandbox_id)?;
            let target = sb
                .file_target(d.cfg.max_file_bytes)?
                .acting_as(header.user)?;
            let data = Box::pin(futures_util::stream::unfold(stream, |mut s| async move {
                match next_data(&mut s).await {
                    Ok(Some(d)) => Some((Ok(d), s)),
                    Ok(None) => None,
                    Err(e) => Some((Err(e), s)),
                }
            }));
            let written =
                crate::transfer::write(target, &tenant, header.path, header.mode, data).await;
            Ok(WriteFileResponse {
                bytes_written: written?,
            })
        })
        .await
    }

    type ReadFileStream = Stream<FileChunk>;

    async fn read_file(
        &self,
        req: Request<ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let tenant = authorize(&req, &rpc::READ_FILE)?;
        let r = req.into_inner();
        let sb = self.daemon.sandboxes.running(&tenant, &r.sandbox_id)?;
        let target = sb
            .file_target(self.daemon.cfg.max_file_bytes)?
            .acting_as(r.user)?;
        let chunks = crate::transfer::read(target, &tenant, r.path, Status::from)?;
        Ok(Response::new(ReceiverStream::new(chunks)))
    }

    async fn list_files(
        &self,
        req: Request<ListFilesRequest>,
    ) -> Result<Response<ListFilesResponse>, Status> {
        let tenant = authorize(&req, &rpc::LIST_FILES)?;
        let r = req.into_inner();
        traced(&rpc::LIST_FILES, &tenant, async {
            let sb = self.daemon.sandboxes.running(&tenant, &r.sandbox_id)?;
            let target = sb.file_target(self.daemon.cfg.max_file_bytes)?;
            let (entries, truncated) = files::list(
                target.acting_as(r.user)?,
                r.path,
                r.recursive,
                r.max_entries,
            )
            .await?;
            Ok(ListFilesResponse { entries, truncated })
        })
        .await
    }

    async fn stat_file(
        &self,
        req: Request<StatFileRequest>,
    ) -> Result<Response<FileEntry>, Status> {
        let tenant = authorize(&req, &rpc::STAT_FILE)?;
        let r = req.into_inner();
        traced(&rpc::STAT_FILE, &tenant, async {
            let target = self.file_target(&tenant, &r.sandbox_id, r.user)?;
            files::stat(target, r.path).await
        })
        .await
    }

    async fn make_dir(
        &self,
        req: Request<MakeDirRequest>,
    ) -> Result<Response<MakeDirResponse>, Status> {
        let tenant = authorize(&req, &rpc::MAKE_DIR)?;
        let r = req.into_inner();
        traced(&rpc::MAKE_DIR, &tenant, async {
            let target = self.file_target(&tenant, &r.sandbox_id, r.user)?;
            let op = files::Op::MakeDir {
                parents: r.parents,
                mode: r.mode,
            };
            files::change(target, r.path, op).await?;
            Ok(MakeDirResponse {})
        })
        .await
    }

    async fn remove_file(
        &self,
        req: Request<RemoveFileRequest>,
    ) -> Result<Response<RemoveFileResponse>, Status> {
        let tenant = authorize(&req, &rpc::REMOVE_FILE)?;
        let r = req.into_inner();
        traced(&rpc::REMOVE_FILE, &tenant, async {
            let target = self.file_target(&tenant, &r.sandbox_id, r.user)?;
            let op = files::Op::Remove {
                recursive: r.recursive,
            };
            files::change(target, r.path, op).await?;
            Ok(RemoveFileResponse {})
        })
        .await
    }

    async fn rename_file(
        &self,
        req: Request<RenameFileRequest>,
    ) -> Result<Response<RenameFileResponse>, Status> {
        let tenant = authorize(&req, &rpc::RENAME_FILE)?;
        let r = req.into_inner();
        traced(&rpc::RENAME_FILE, &tenant, async {
            let target = self.file_target(&tenant, &r.sandbox_id, r.user)?;
            files::change(target, r.from, files::Op::Rename { to: r.to }).await?;
            Ok(RenameFileResponse {})
        })
        .await
    }

    async fn set_network_policy(
        &self,
        req: Request<SetNetworkPolicyRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = authorize(&req, &rpc::SET_NETWORK_POLICY)?;
        let r = req.into_inner();
        traced(
            &rpc::SET_NETWORK_POLICY,
            &tenant,
            self.daemon.sandboxes.set_network(
                &tenant,
                &r.sandbox_id,
                r.network.unwrap_or_default(),
            ),
        )
        .await
    }

    async fn get_egress_log(
        &self,
        req: Request<GetEgressLogRequest>,
    ) -> Result<Response<GetEgressLogResponse>, Status> {
        let tenant = authorize(&req, &rpc::GET_EGRESS_LOG)?;
        let r = req.into_inner();
        traced(&rpc::GET_EGRESS_LOG, &tenant, async {
            let q = crate::events::Query::from(&r);
            let (events, dropped) = self
                .daemon
                .sandboxes
                .egress_log(&tenant, &r.sandbox_id, &q)?;
            Ok(GetEgressLogResponse { events, dropped })
        })
        .await
    }

    async fn remove_secrets(
        &self,
        req: Request<RemoveSecretsRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let tenant = authorize(&req, &rpc::REMOVE_SECRETS)?;
        let r = req.into_inner();
        traced(&rpc::REMOVE_SECRETS, &tenant, async {
            self.daemon
                .sandboxes
                .remove_secrets(&tenant, &r.sandbox_id, &r.names)
                .await
        })
        .await
    }

    async fn list_audit_events(
        &self,
        req: Request<ListAuditEventsRequest>,
    ) -> Result<Response<ListAuditEventsResponse>, Status> {
        let tenant = authorize(&req, &rpc::LIST_AUDIT_EVENTS)?;
        let r = req.into_inner();
        let store = self.daemon.store.clone();
        traced(&rpc::LIST_AUDIT_EVENTS, &tenant, async {
            let t = tenant.clone();
            tokio::task::spawn_blocking(move || crate::audit::list(&store, &t, &r))
                .await
                .map_err(|e| ApiError::Internal(format!("audit task: {e}")))?
        })
        .await
    }

    async fn get_install_log(
        &self,
        req: Request<GetInstallLogRequest>,
    ) -> Result<Response<GetInstallLogResponse>, Status> {
        let tenant = authorize(&req, &rpc::GET_INSTALL_LOG)?;
        let r = req.into_inner();
        traced(&rpc::GET_INSTALL_LOG, &tenant, async {
            let q = crate::events::Query::from(&r);
            let (events, dropped) =
                self.daemon
                    .sandboxes
                    .install_log(&tenant, &r.sandbox_id, &q)?;
            Ok(GetInstallLogResponse { events, dropped })
        })
        .await
    }

    async fn expose_port(
        &self,
        req: Request<ExposePortRequest>,
    ) -> Result<Response<Exposure>, Status> {
        let tenant = authorize(&req, &rpc::EXPOSE_PORT)?;
        let r = req.into_inner();
        traced(&rpc::EXPOSE_PORT, &tenant, async {
            self.daemon
                .sandboxes
                .expose(&tenant, &r.sandbox_id, r.guest_port, r.ttl_s)
        })
        .await
    }

    async fn create_volume(
        &self,
        req: Request<CreateVolumeRequest>,
    ) -> Result<Response<Volume>, Status> {
        let tenant = authorize(&req, &rpc::CREATE_VOLUME)?;
        let r = req.into_inner();
        let quota = self.daemon.cfg.quota_of(&tenant);
        traced(&rpc::CREATE_VOLUME, &tenant, async {
            self.daemon
                .sandboxes
                .volumes
                .create(&tenant, &quota, &r.name, r.size_mib)
                .await
        })
        .await
    }

    async fn list_volumes(
        &self,
        req: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let tenant = authorize(&req, &rpc::LIST_VOLUMES)?;
        traced(&rpc::LIST_VOLUMES, &tenant, async {
            Ok(ListVolumesResponse {
                volumes: self.daemon.sandboxes.volumes.list(&tenant),
            })
        })
        .await
    }

    async fn delete_volume(
        &self,
        req: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let tenant = authorize(&req, &rpc::DELETE_VOLUME)?;
        let r = req.into_inner();
        traced(&rpc::DELETE_VOLUME, &tenant, async {
            let deleted = self.daemon.sandboxes.volumes.delete(&tenant, &r.name)?;
            Ok(DeleteVolumeResponse { deleted })
        })
        .await
    }

    async fn get_usage(&self, req: Request<GetUsageRequest>) -> Result<Response<Usage>, Status> {
        let tenant = authorize(&req, &rpc::GET_USAGE)?;
        let d = self.daemon.clone();
        let t = tenant.clone();
        traced(&rpc::GET_USAGE, &tenant, async move {
            let cluster = self.cluster.clone();
            let tt = t.clone();
            let mut usage = tokio::task::spawn_blocking(move || d.usage(&tt))
                .await
                .map_err(|e| ApiError::Internal(format!("usage task: {e}")))??;
            if let Some(c) = cluster {
                // Cluster mode: the quota counts the tenant's sandboxes on every node.
                (usage.live_sandboxes, usage.memory_mib) = c.ledger.usage(&t).await?;
            }
            Ok(usage)
        })
        .await
    }

    type RunCodeStream =
        std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<RunCodeEvent, Status>> + Send>>;

    async fn run_code(
        &self,
        req: Request<RunCodeRequest>,
    ) -> Result<Response<Self::RunCodeStream>, Status> {
        let tenant = authorize(&req, &rpc::RUN_CODE)?;
        let r = req.into_inner();
        let started = traced(&rpc::RUN_CODE, &tenant, async {
            let interp = self.interp(&tenant, &r.sandbox_id)?;
            let cell = interp.cell(r)?;
            Ok((interp, cell))
        })
        .await?;
        let (interp, cell) = started.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(32);
        let span = tracing::info_span!("call", call = rpc::RUN_CODE.name, tenant = %tenant);
        tokio::spawn(async move { interp.run(&cell, &tx).await }.instrument(span));
        let events = tokio_stream::StreamExt::map(ReceiverStream::new(rx), Ok);
        Ok(Response::new(Box::pin(events)))
    }

    async fn create_code_context(
        &self,
        req: Request<CreateCodeContextRequest>,
    ) -> Result<Response<CodeContext>, Status> {
        let tenant = authorize(&req, &rpc::CREATE_CODE_CONTEXT)?;
        let r = req.into_inner();
        traced(&rpc::CREATE_CODE_CONTEXT, &tenant, async {
            let interp = self.interp(&tenant, &r.sandbox_id)?;
            interp.create_context(&r.language, &r.cwd).await
        })
        .await
    }

    async fn list_code_contexts(
        &self,
        req: Request<ListCodeContextsRequest>,
    ) -> Result<Response<ListCodeContextsResponse>, Status> {
        let tenant = authorize(&req, &rpc::LIST_CODE_CONTEXTS)?;
        let r = req.into_inner();
        traced(&rpc::LIST_CODE_CONTEXTS, &tenant, async {
            let contexts = self.interp(&tenant, &r.sandbox_id)?.list_contexts().await?;
            Ok(ListCodeContextsResponse { contexts })
        })
        .await
    }

    async fn restart_code_context(
        &self,
        req: Request<RestartCodeContextRequest>,
    ) -> Result<Response<CodeContext>, Status> {
        let tenant = authorize(&req, &rpc::RESTART_CODE_CONTEXT)?;
        let r = req.into_inner();
        traced(&rpc::RESTART_CODE_CONTEXT, &tenant, async {
            let interp = self.interp(&tenant, &r.sandbox_id)?;
            interp.restart_context(&r.context_id).await
        })
        .await
    }

    async fn remove_code_context(
        &self,
        req: Request<RemoveCodeContextRequest>,
    ) -> Result<Response<RemoveCodeContextResponse>, Status> {
        let tenant = authorize(&req, &rpc::REMOVE_CODE_CONTEXT)?;
        let r = req.into_inner();
        traced(&rpc::REMOVE_CODE_CONTEXT, &tenant, async {
            let interp = self.interp(&tenant, &r.sandbox_id)?;
            interp.remove_context(&r.context_id).await?;
            Ok(RemoveCodeContextResponse {})
        })
        .await
    }

    async fn list_nodes(
        &self,
        req: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let tenant = authorize(&req, &rpc::LIST_NODES)?;
        let operator = self.daemon.cfg.is_operator(&tenant);
        let nodes = match &self.cluster {
            Some(c) => c.nodes(),
            None => Vec::new(),
        };
        let nodes = if nodes.is_empty() {
            vec![crate::cluster::local_node(&self.daemon)]
        } else {
            nodes.into_iter().map(crate::cluster::to_proto).collect()
        };
        let nodes = nodes
            .into_iter()
            .map(|mut n| {
                if !operator {
                    n.address.clear();
                }
                n
            })
            .collect();
        Ok(Response::new(ListNodesResponse { nodes }))
    }
}

/// The next data part of a WriteFile stream (`None` at its end).
async fn next_data(stream: &mut Streaming<WriteFileRequest>) -> ApiResult<Option<Vec<u8>>> {
    match stream.message().await {
        Ok(Some(WriteFileRequest {
            part: Some(write_file_request::Part::Data(data)),
        })) => Ok(Some(data)),
        Ok(None) => Ok(None),
        Ok(Some(_)) => Err(ApiError::InvalidArgument(
            "only data may follow the header".into(),
        )),
        Err(s) => Err(ApiError::InvalidArgument(format!("request stream: {s}"))),
    }
}
