//! CreateSandbox: check, admit, take a start slot, restore the template in a warm VMM, wait
//! for the guest's agent, give the clone its identity and files. A create that fails ends its
//! sandbox (DEAD, with the error's reason) and leaves nothing running.

use airlock_proto::Requests;
use std::sync::Arc;
use std::time::{Duration, Instant};

use airlock_api::v1::{CreateSandboxRequest, Sandbox, SandboxState};
use airlock_proto::AGENT_VSOCK_PORT;
use tracing::info;

use super::admission::{self, Held};
use super::spec::SandboxSpec;
use std::collections::HashMap;

use super::{AdmittedBuild, SandboxRt, Sandboxes, new_sandbox_id};
use crate::agent::CALL_TIMEOUT;
use crate::error::{AgentCall, ApiError, ApiResult, from_agent};
use crate::files;
use crate::ids;
use crate::reason::EndReason;
use crate::store::Owner;
use crate::templates::TemplateRt;
use crate::vmm::{self, VmmProcess};

/// What admission counts: every live sandbox and every running template build.
fn held<'a>(
    live: &'a HashMap<String, Arc<SandboxRt>>,
    builds: &'a HashMap<u64, (String, u64)>,
) -> Vec<Held<'a>> {
    let sandboxes = live.values().map(|s| Held {
        tenant: &s.tenant,
        memory_mib: s.memory_mib(),
    });
    let building = builds.values().map(|(tenant, mib)| Held {
        tenant,
        memory_mib: *mib,
    });
    sandboxes.chain(building).collect()
}

/// The guest's share of a create: from vCPUs running to the agent's Ready, then identity and
/// files (ms).
struct GuestTimes {
    ready_ms: f64,
    identity_ms: f64,
}

impl Sandboxes {
    /// CreateSandbox: answers the ready sandbox.
    pub async fn create(
        self: &Arc<Self>,
        tenant: &str,
        req: CreateSandboxRequest,
    ) -> ApiResult<Sandbox> {
        let t0 = Instant::now();
        let name = if req.template.is_empty() {
            "base"
        } else {
            req.template.as_str()
        };
        let template = self.templates.find(tenant, name)?;
        template.check_restorable()?;
        let spec = SandboxSpec::check(&req, &template.record, &self.cfg)?;
        self.egress.within_ceiling(tenant, &spec.egress)?;
        let pkg = self.egress.packages.policy_for(tenant, &spec.packages)?;
        let secrets = crate::secrets::check(&req.secrets, false)?;
        // Before a VMM is taken; the claim comes with the restore.
        self.volumes.check_known(tenant, &spec.volumes)?;
        let mut rt = self.new_rt(tenant, &template, &spec, &pkg)?;
        if !secrets.is_empty() {
            let secrets = Arc::new(crate::secrets::SandboxSecrets::new(secrets));
            if secrets.needs_ca() {
                let ca = crate::secrets::ca::SandboxCa::new(&rt.id)
                    .map_err(|e| ApiError::Internal(format!("the sandbox's broker CA: {e}")))?;
                secrets.set_ca(Arc::new(ca));
            }
            rt.update(|r| r.secrets = secrets.info());
            rt.secrets = secrets;
        }
        let rt = Arc::new(rt);
        if let Err(e) = self.admit(&rt) {
            self.metrics.create_failed(e.reason());
            return Err(e);
        }
        if let Some(ledger) = self.ledger() {
            // Cluster mode: the tenant's quota counts its sandboxes on every node.
            if let Err(e) = ledger.reserve(&rt.snapshot()).await {
                self.live_map().remove(&rt.id);
                self.metrics.create_failed(e.reason());
                return Err(e);
            }
        }
        // Only an admitted sandbox's values are kept for redaction: a refused create returns
        // above with nothing to forget, and a failed start forgets them in `end`.
        crate::secrets::logs::register(&rt.id, tenant, rt.secrets.patterns());
        let started = self.start(&rt, &template, &spec, pkg, t0).await;
        // Refilled after the answer: starting a VMM process competes for the CPU with the
        // restore it would replace.
        self.pool.refill(&template);
        match started {
            Ok(s) => Ok(s),
            Err(e) => {
                self.metrics.create_failed(e.reason());
                let reason = EndReason::CreateFailed(e.reason().to_owned());
                let _ = self.end(&rt, reason, &e.to_string()).await;
                Err(e)
            }
        }
    }

    fn new_rt(
        &self,
        tenant: &str,
        t: &TemplateRt,
        spec: &SandboxSpec,
        pkg: &airlock_packages::policy::Policy,
    ) -> ApiResult<SandboxRt> {
        let record = Sandbox {
            id: new_sandbox_id()?,
            tenant: tenant.to_owned(),
            template: crate::templates::reference(&t.record),
            template_id: t.record.id.clone(),
            state: SandboxState::Starting as i32,
            vcpus: t.record.vcpus,
            memory_mib: t.record.memory_mib,
            disk_mib: spec.disk_mib,
            labels: spec.labels.clone(),
            idle_ttl_s: spec.idle_ttl_s,
            max_lifetime_s: spec.max_lifetime_s,
            created_unix_ms: ids::now_ms(),
            network: Some(spec.network.clone()),
            volumes: spec.volumes.clone(),
            packages: Some(crate::pkg::to_proto(pkg)),
            node: self.ledger().map(|l| l.node()).unwrap_or_default(),
            no_root: spec.no_root,
            ..Default::default()
        };
        Ok(SandboxRt::new(
            record,
            spec.env.clone(),
            spec.policy.clone(),
            Duration::ZERO,
        ))
    }

    /// Capacity and quota against the live sandboxes and the running template builds; the
    /// sandbox is live once admitted.
    fn admit(&self, rt: &Arc<SandboxRt>) -> ApiResult<()> {
        admission::check_space(self.host.run_root(), self.cfg.min_free_data_mib)?;
        let mut live = self.live_map();
        let builds = super::lock(&self.builds);
        let held = held(&live, &builds);
        let quota = self.cfg.quota_of(&rt.tenant);
        admission::admit(&self.cfg, &quota, &rt.tenant, rt.memory_mib(), &held)?;
        drop(builds);
        live.insert(rt.id.clone(), rt.clone());
        Ok(())
    }

    /// Admits a template build of `memory_mib` for `tenant` like a sandbox.
    pub fn admit_build(
        self: &Arc<Self>,
        tenant: &str,
        memory_mib: u64,
    ) -> ApiResult<AdmittedBuild> {
        admission::check_space(self.host.run_root(), self.cfg.min_free_data_mib)?;
        let live = self.live_map();
        let mut builds = super::lock(&self.builds);
        let quota = self.cfg.quota_of(tenant);
        admission::admit(&self.cfg, &quota, tenant, memory_mib, &held(&live, &builds))?;
        let id = self
            .next_build
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        builds.insert(id, (tenant.to_owned(), memory_mib));
        Ok(AdmittedBuild {
            sandboxes: self.clone(),
            id,
        })
    }

    /// From admitted to ready: a start slot, a VMM, the restore, the guest.
    async fn start(
        &self,
        rt: &Arc<SandboxRt>,
        template: &TemplateRt,
        spec: &SandboxSpec,
        pkg: airlock_packages::policy::Policy,
        t0: Instant,
    ) -> ApiResult<Sandbox> {
        self.store.put_sandbox(&rt.snapshot())?;
        let queued = Instant::now();
        let _slot = self.slots.acquire().await?;
        let queue_ms = queued.elapsed().as_secs_f64() * 1000.0;
        let vmm = self.vmm_for(rt, template).await?;
        rt.set_vmm(vmm.clone());
        // Its network is served before its guest runs.
        if let Some(exits) = vmm.take_exits() {
            self.serve_network(rt, exits, spec, pkg)?;
        }
        // Its volumes are claimed (or the create fails here), their files handed to the VMM
        // with the restore; a create that fails afterwards releases them with the claim.
        let claim = self.volumes.claim(&rt.tenant, &rt.id, &spec.volumes)?;
        let t_taken = Instant::now();
        let quota = Some(u64::from(spec.disk_mib));
        let restored = vmm::control::restore(&vmm.control, &template.dir, quota, &claim.media)
            .await
            .map_err(|e| ApiError::Internal(format!("restore: {e}")))?;
        let t_running = Instant::now();
        let restore_ms = restored.running_after_us as f64 / 1000.0;
        let guest = self.greet(rt, &vmm, spec, t_running).await?;
        drop(claim.keep());
        if rt.secrets.next_expiry().is_some() {
            self.expire_secrets_later(rt);
        }
        let total_ms = t0.elapsed().as_secs_f64() * 1000.0;
        // Reseeding and placing files wait on the guest too; a queued create waited for others.
        let guest_ms = guest.ready_ms + guest.identity_ms;
        let host_ms = total_ms - guest_ms - queue_ms;
        let record = rt.update(|r| {
            r.state = SandboxState::Running as i32;
            r.create_ms = total_ms;
            r.create_host_ms = host_ms;
            r.create_guest_ms = guest_ms;
            r.create_queue_ms = queue_ms;
            r.restore_ms = restore_ms;
            r.vmm_pid = vmm.pid;
        });
        // With its secrets sealed, a restarted daemon can adopt it.
        let sealed = super::secrets::seal(self.sealer.as_deref(), &rt.id, &rt.secrets);
        self.store
            .put_running(&record, &spec.to_stored(), sealed.as_deref(), &vmm.id)?;
        self.metrics
            .observe_create(total_ms / 1000.0, host_ms / 1000.0, restore_ms / 1000.0);
        info!(
            sandbox = %rt.id,
            tenant = %rt.tenant,
            template = %template.record.name,
            total_ms,
            host_ms,
            guest_ms,
            restore_ms,
            take_ms = (t_taken - t0).as_secs_f64() * 1000.0,
            control_ms = (t_running - t_taken).as_secs_f64() * 1000.0,
            identity_ms = guest.identity_ms,
            "sandbox ready"
        );
        audit_create(rt, template, spec, &record);
        Ok(record)
    }

    /// Start step: the sandbox's network served on its VMM's `exits`, with its egress policy
    /// and a package session under `pkg`.
    fn serve_network(
        &self,
        rt: &SandboxRt,
        exits: crate::net::NetExits,
        spec: &SandboxSpec,
        pkg: airlock_packages::policy::Policy,
    ) -> ApiResult<()> {
        let net = self
            .egress
            .start(
                &rt.id,
                &rt.tenant,
                exits,
                spec.egress.clone(),
                false,
                crate::net::Uses {
                    packages: self.egress.packages.session(&rt.tenant, &rt.id, pkg, false),
                    secrets: rt.secrets.clone(),
                },
            )
            .map_err(|e| ApiError::Internal(format!("the sandbox's network: {e}")))?;
        rt.set_net(net);
        Ok(())
    }

    /// A warm VMM of the template (or a new one), handed over to the sandbox.
    async fn vmm_for(&self, rt: &SandboxRt, template: &TemplateRt) -> ApiResult<VmmProcess> {
        let owner = Owner::Sandbox(rt.id.clone());
        match self.pool.take(&template.record.id) {
            Some(p) => {
                self.host.supervisor.hand_over(&p, owner);
                Ok(p)
            }
            None => {
                info!(template = %template.record.name, "no warm VMM: starting one for this create");
                let spec = template.pool_spec(self.cfg.max_disk_mib);
                self.host.start_pool_vmm(&spec, owner).await
            }
        }
    }

    /// Waits for the restored guest's agent, then gives the clone its identity (and its /tmp
    /// its size: the sandbox's disk quota) and places the request's files.
    async fn greet(
        &self,
        rt: &Arc<SandboxRt>,
        vmm: &VmmProcess,
        spec: &SandboxSpec,
        running: Instant,
    ) -> ApiResult<GuestTimes> {
        let deadline = Instant::now() + Duration::from_millis(self.cfg.ready_timeout_ms);
        let (rt, vmm, spec) = (rt.clone(), vmm.clone(), spec.clone());
        tokio::task::spawn_blocking(move || {
            let call = AgentCall {
                sandbox: &rt.id,
                path: "",
                disk_limit: u64::from(spec.disk_mib) << 20,
            };
            let gone = || {
                if rt.is_ending() {
                    Some("the sandbox is ending".to_owned())
                } else {
                    vmm.is_gone().then(|| "its VMM ended".to_owned())
                }
            };
            // The clone's identity goes out with the connection (no round trip after Ready).
            let identity = clone_identity(&rt, &spec, call)?;
            let reseed = airlock_proto::pb::request::Kind::Reseed(identity);
            let (mut client, reseed_id) = airlock_proto::vsock::wait_ready_pipelined(
                &vmm.vsock,
                AGENT_VSOCK_PORT,
                deadline,
                gone,
                &reseed,
            )
            .map_err(|e| ApiError::AgentUnavailable {
                id: rt.id.clone(),
                message: crate::error::error_chain(&e),
            })?;
            let ready_ms = running.elapsed().as_secs_f64() * 1000.0;
            let t = Instant::now();
            let done = client
                .within(CALL_TIMEOUT, |c| c.reseeded(reseed_id))
                .map_err(|e| from_agent(e, call))?;
            if spec.no_root && !done.no_root {
                // An agent from before no_root ignored it: root would still be in reach.
                return Err(ApiError::InvalidArgument(format!(
                    "no_root: the guest agent of template {} predates it (build the template \
                     again for sandboxes without root)",
                    rt.snapshot().template
                )));
            }
            // This connection serves the sandbox from now on (executions, files, control).
            let mux = vmm.agent.adopt(client).map_err(|e| from_agent(e, call))?;
            let mut client = mux.client(Some(Instant::now() + CALL_TIMEOUT));
            place_files(&mut client, &rt, &spec, call)?;
            Ok(GuestTimes {
                ready_ms,
                identity_ms: t.elapsed().as_secs_f64() * 1000.0,
            })
        })
        .await
        .map_err(|e| ApiError::Internal(format!("agent task: {e}")))?
    }
}

/// Greeting step: the clone's identity, with its writable space (on a writable root, the
/// overlay's quota too), its volumes' mounts, and its account settings.
fn clone_identity(
    rt: &SandboxRt,
    spec: &SandboxSpec,
    call: AgentCall<'_>,
) -> ApiResult<airlock_proto::pb::Reseed> {
    let disk_bytes = u64::from(spec.disk_mib) << 20;
    let mut identity = airlock_proto::client::clone_identity(&rt.id, disk_bytes)
        .map_err(|e| from_agent(e, call))?;
    // Volumes are in the first disk slots, in the order asked.
    identity.mounts = spec
        .volumes
        .iter()
        .enumerate()
        .map(|(slot, v)| airlock_proto::pb::VolumeMount {
            serial: airlock_proto::slot_serial(slot),
            path: v.mount_path.clone(),
            read_only: v.read_only,
        })
        .collect();
    identity.no_root = spec.no_root;
    identity.default_user = spec.default_user.clone();
    identity.workdir = spec.workdir.clone();
    Ok(identity)
}

/// Greeting step: the request's files, the secrets delivered as files, and the broker's CA
/// (if the sandbox has one) placed in the guest.
fn place_files(
    client: &mut airlock_proto::MuxClient,
    rt: &SandboxRt,
    spec: &SandboxSpec,
    call: AgentCall<'_>,
) -> ApiResult<()> {
    for f in &spec.files {
        let mode = if f.mode == 0 { 0o644 } else { f.mode };
        files::write_all(client, &f.path, &f.content, mode).map_err(|e| {
            from_agent(
                e,
                AgentCall {
                    path: &f.path,
                    ..call
                },
            )
        })?;
    }
    place_secret_files(client, &rt.secrets).map_err(|e| from_agent(e, call))?;
    if let Some(ca) = rt.secrets.ca() {
        trust_broker_ca(client, &ca.pem()).map_err(|e| from_agent(e, call))?;
    }
    Ok(())
}

/// Start step: the audit events of a created sandbox: its creation (what it was made of) and,
/// if it has secrets delivered as files, their use.
fn audit_create(rt: &SandboxRt, template: &TemplateRt, spec: &SandboxSpec, record: &Sandbox) {
    let secrets: Vec<&str> = record.secrets.iter().map(|s| s.name.as_str()).collect();
    crate::audit::emit(
        &rt.tenant,
        crate::audit::Kind::SandboxCreate,
        &rt.id,
        "",
        serde_json::json!({
            "template": template.record.name,
            "template_id": template.record.id,
            "vcpus": record.vcpus,
            "memory_mib": record.memory_mib,
            "disk_mib": record.disk_mib,
            "labels": record.labels,
            "network": crate::audit::network(record.network.as_ref()),
            "packages": crate::audit::packages(record.packages.as_ref()),
            "volumes": record.volumes.iter().map(|v| &v.name).collect::<Vec<_>>(),
            "files": spec.files.iter().map(|f| serde_json::json!({
                "path": f.path, "digest": crate::audit::digest(&f.content)
            })).collect::<Vec<_>>(),
            "secrets": secrets,
        }),
    );
    let file_secrets: Vec<String> = rt
        .secrets
        .info()
        .into_iter()
        .filter(|s| s.delivery == "file")
        .map(|s| s.name)
        .collect();
    if !file_secrets.is_empty() {
        crate::audit::emit(
            &rt.tenant,
            crate::audit::Kind::SecretUse,
            &rt.id,
            "",
            serde_json::json!({ "names": file_secrets, "delivery": "file" }),
        );
    }
}

/// Makes the guest trust its sandbox's broker CA: its certificate at
/// [`GUEST_CA_PATH`](crate::secrets::ca::GUEST_CA_PATH) and appended to the system bundle
/// (OpenSSL's, Python's and curl's default; the root is the sandbox's own copy-on-write disk).
fn trust_broker_ca(
    client: &mut airlock_proto::MuxClient,
    pem: &str,
) -> Result<(), airlock_proto::ClientError> {
    use crate::secrets::ca::{GUEST_BUNDLE_PATH, GUEST_CA_PATH};
    let write = |c: &mut airlock_proto::MuxClient, path: &str, data: &[u8]| {
        let template = airlock_proto::pb::WriteFile {
            path: path.to_owned(),
            mode: 0o644,
            create_parents: true,
            user: "root".into(),
            ..Default::default()
        };
        c.within(CALL_TIMEOUT, |c| c.write_file_with(&template, data))
    };
    write(client, GUEST_CA_PATH, pem.as_bytes())?;
    // An image without the bundle gets one holding the CA alone.
    let mut bundle = client
        .within(CALL_TIMEOUT, |c| c.read_file(GUEST_BUNDLE_PATH))
        .unwrap_or_default();
    if !bundle.is_empty() && !bundle.ends_with(b"\n") {
        bundle.push(b'\n');
    }
    bundle.extend_from_slice(pem.as_bytes());
    write(client, GUEST_BUNDLE_PATH, &bundle)
}

/// Writes the sandbox's file secrets into its guest: each readable by its account only
/// (mode 0400, created as that account). The default directory, /run/secrets on the guest's
/// tmpfs, is made by root sticky and unlistable (1733), so accounts can neither list it nor
/// remove each other's files.
fn place_secret_files(
    client: &mut airlock_proto::MuxClient,
    secrets: &crate::secrets::SandboxSecrets,
) -> Result<(), airlock_proto::ClientError> {
    let files = secrets.files();
    let default_prefix = format!("{}/", crate::secrets::DEFAULT_DIR);
    if files
        .iter()
        .any(|(_, path, _, _)| path.starts_with(&default_prefix))
    {
        let mkdir = airlock_proto::pb::Mkdir {
            path: crate::secrets::DEFAULT_DIR.to_owned(),
            parents: true,
            mode: 0o1733,
            user: "root".into(),
            ..Default::default()
        };
        client.within(CALL_TIMEOUT, |c| {
            c.call(airlock_proto::pb::request::Kind::Mkdir(mkdir.clone()))
                .map(drop)
        })?;
    }
    for (_, path, user, value) in &files {
        let template = airlock_proto::pb::WriteFile {
            path: path.clone(),
            mode: 0o400,
            create_parents: true,
            user: user.clone(),
            ..Default::default()
        };
        client.within(CALL_TIMEOUT, |c| {
            c.write_file_with(&template, value.as_bytes())
        })?;
    }
    Ok(())
}
