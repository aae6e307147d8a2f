//! The API requests the commands send, built from their arguments. Pure but for the files
//! they upload, which they read through a `read` function (tests pass their own).

use std::collections::HashMap;
use std::path::Path;

use airlock_api::v1::{
    Argv, BuildTemplateRequest, Code, CreateSandboxRequest, CreateTemplateRequest, EgressRule,
    ExecRequest, ExposePortRequest, FilePolicy, FileToPlace, ListSandboxesRequest, NetworkPolicy,
    OciImage, PackagePolicy, SandboxState, Secret, SecretBroker, SecretEnv, SecretFile,
    SetNetworkPolicyRequest, VolumeAttachment, egress_rule, exec_request, secret,
};

use crate::args::{
    CreateArgs, ExecArgs, ExposeArgs, LsArgs, NetArgs, NetworkArgs, PackageArgs, StateArg,
    TemplateBuildArgs, TemplateCreateArgs,
};

/// Reads a local file (`-`: our stdin, where a command allows it); the error names the file.
pub type Read<'a> = &'a dyn Fn(&Path) -> Result<Vec<u8>, String>;

/// Reads a file from the local disk, or our stdin for `-`.
pub fn read_local(path: &Path) -> Result<Vec<u8>, String> {
    if path == Path::new("-") {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)
            .map_err(|e| format!("stdin: {e}"))?;
        return Ok(buf);
    }
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn map(pairs: &[(String, String)]) -> HashMap<String, String> {
    pairs.iter().cloned().collect()
}

/// The most bytes of `--file` contents one create carries: they travel inside the
/// CreateSandboxRequest, and a gRPC server takes messages of 4 MiB at most (what is left is
/// room for the rest of the request).
pub const MAX_CREATE_FILE_BYTES: usize = (4 << 20) - (64 << 10);

/// `CreateSandboxRequest` of `airlock create`; reads the `--file`s.
pub fn create_request(args: &CreateArgs, read: Read) -> Result<CreateSandboxRequest, String> {
    let files = create_files(args, read)?;
    let file_policy = file_policy(args);
    let secrets = create_secrets(args)?;
    Ok(CreateSandboxRequest {
        secrets,
        template: args.template.clone().unwrap_or_default(),
        vcpus: args.vcpus.unwrap_or(0),
        memory_mib: args.memory_mib.unwrap_or(0),
        disk_mib: args.disk_mib.unwrap_or(0),
        env: map(&args.env),
        files,
        labels: map(&args.labels),
        idle_ttl_s: args.idle_ttl.unwrap_or(0),
        max_lifetime_s: args.lifetime.unwrap_or(0),
        file_policy,
        network: network_policy(&args.network),
        volumes: args
            .volumes
            .iter()
            .map(|v| VolumeAttachment {
                name: v.name.clone(),
                mount_path: v.path.clone(),
                read_only: v.read_only,
            })
            .collect(),
        packages: package_policy(&args.packages),
        no_root: args.no_root,
    })
}

/// Create step: the `--file`s read, within what one create request carries.
fn create_files(args: &CreateArgs, read: Read) -> Result<Vec<FileToPlace>, String> {
    let files = args
        .files
        .iter()
        .map(|f| {
            Ok(FileToPlace {
                path: f.guest.clone(),
                content: read(&f.local)?,
                mode: f.mode,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    let total: usize = files.iter().map(|f| f.content.len()).sum();
    if total > MAX_CREATE_FILE_BYTES {
        return Err(format!(
            "--file: {total} bytes in all; files placed at create travel in the create request, \
             at most {MAX_CREATE_FILE_BYTES} bytes: copy larger ones with \
             `airlock cp LOCAL ID:/PATH` once the sandbox is ready"
        ));
    }
    Ok(files)
}

/// Create step: the `FilePolicy` of the file flags; `None` without any.
fn file_policy(args: &CreateArgs) -> Option<FilePolicy> {
    let any = !args.writable.is_empty()
        || !args.exportable.is_empty()
        || args.export_max_file_bytes.is_some()
        || args.export_max_total_bytes.is_some()
        || !args.export_deny.is_empty();
    any.then(|| FilePolicy {
        writable: args.writable.clone(),
        exportable: args.exportable.clone(),
        max_export_file_bytes: args.export_max_file_bytes.unwrap_or(0),
        max_export_total_bytes: args.export_max_total_bytes.unwrap_or(0),
        export_denied: args.export_deny.clone(),
    })
}

/// Create step: the secrets of `--secret`, `--secret-file` and `--secret-broker`, in that
/// order, their values from our environment.
fn create_secrets(args: &CreateArgs) -> Result<Vec<Secret>, String> {
    let secret = |name: &String, file: bool| -> Result<Secret, String> {
        let value = std::env::var(name)
            .map_err(|_| format!("--secret {name}: set ${name} to its value"))?;
        let delivery = if file {
            secret::Delivery::File(SecretFile::default())
        } else {
            secret::Delivery::Env(SecretEnv::default())
        };
        Ok(Secret {
            name: name.clone(),
            value,
            delivery: Some(delivery),
            ttl_s: args.secret_ttl.unwrap_or(0),
        })
    };
    args.secrets
        .iter()
        .map(|n| secret(n, false))
        .chain(args.secret_files.iter().map(|n| secret(n, true)))
        .chain(
            args.secret_brokers
                .iter()
                .map(|spec| broker_secret(args, spec)),
        )
        .collect()
}

/// Create step: the secret of one `--secret-broker NAME=HOST[,HOST...]`.
fn broker_secret(args: &CreateArgs, spec: &str) -> Result<Secret, String> {
    let (name, hosts) = spec
        .split_once('=')
        .filter(|(n, h)| !n.is_empty() && !h.is_empty())
        .ok_or_else(|| format!("--secret-broker {spec}: NAME=HOST[,HOST...]"))?;
    let value = std::env::var(name)
        .map_err(|_| format!("--secret-broker {name}: set ${name} to its value"))?;
    Ok(Secret {
        name: name.to_owned(),
        value,
        delivery: Some(secret::Delivery::Broker(SecretBroker {
            hosts: hosts.split(',').map(str::to_owned).collect(),
            header: args.broker_header.clone().unwrap_or_default(),
            format: args.broker_format.clone().unwrap_or_default(),
            https: args.broker_https,
        })),
        ttl_s: args.secret_ttl.unwrap_or(0),
    })
}

/// The `PackagePolicy` of the package flags; `None` without any: what the tenant's ceiling
/// allows. `--max-download-mib N` is N MiB in bytes.
pub fn package_policy(args: &PackageArgs) -> Option<PackagePolicy> {
    args.any().then(|| PackagePolicy {
        registries: args.pkg_registries.clone(),
        allow: args.pkg_allow.clone(),
        deny: args.pkg_deny.clone(),
        offline: args.offline,
        max_download_bytes: args
            .max_download_mib
            .map_or(0, |mib| mib.saturating_mul(1 << 20)),
    })
}

/// The `NetworkPolicy` of the allow flags: `--allow-internet`, or one rule per
/// `--allow-domain` and `--allow-cidr`, each with every `--allow-port`. `None` without any:
/// deny-all.
pub fn network_policy(args: &NetworkArgs) -> Option<NetworkPolicy> {
    if args.allow_internet {
        return Some(NetworkPolicy {
            allow_internet: true,
            allow: Vec::new(),
        });
    }
    let ports: Vec<u32> = args.allow_ports.iter().map(|p| u32::from(*p)).collect();
    let rule = |target| EgressRule {
        target: Some(target),
        ports: ports.clone(),
    };
    let allow: Vec<EgressRule> = args
        .allow_domains
        .iter()
        .map(|d| rule(egress_rule::Target::Domain(d.clone())))
        .chain(
            args.allow_cidrs
                .iter()
                .map(|c| rule(egress_rule::Target::Cidr(c.clone()))),
        )
        .collect();
    (!allow.is_empty()).then_some(NetworkPolicy {
        allow_internet: false,
        allow,
    })
}

/// `SetNetworkPolicyRequest` of `airlock net`; `--deny-all` (or nothing, which `args::check`
/// refuses before) sends the empty policy.
pub fn net_request(args: &NetArgs) -> SetNetworkPolicyRequest {
    SetNetworkPolicyRequest {
        sandbox_id: args.id.clone(),
        network: Some(network_policy(&args.network).unwrap_or_default()),
    }
}

/// `ExposePortRequest` of `airlock expose`; no `--ttl` leaves the TTL to the daemon (0).
pub fn expose_request(args: &ExposeArgs) -> ExposePortRequest {
    ExposePortRequest {
        sandbox_id: args.id.clone(),
        guest_port: u32::from(args.port),
        ttl_s: args.ttl.unwrap_or(0),
    }
}

/// The command of `airlock exec`: argv, `--shell` or `--code` (clap lets exactly one through).
fn exec_command(args: &ExecArgs) -> Result<exec_request::Command, String> {
    if let Some(script) = &args.shell {
        return Ok(exec_request::Command::Shell(script.clone()));
    }
    if let Some(source) = &args.code {
        return Ok(exec_request::Command::Code(Code {
            language: args
                .language
                .map(|l| l.api_name())
                .unwrap_or_default()
                .to_owned(),
            source: source.clone(),
        }));
    }
    if args.argv.is_empty() {
        return Err("exec: a command is needed (ID -- CMD [ARGS...], --shell or --code)".into());
    }
    Ok(exec_request::Command::Argv(Argv {
        args: args.argv.clone(),
    }))
}

/// `ExecRequest` of `airlock exec`; reads `--stdin`.
pub fn exec_request(args: &ExecArgs, read: Read) -> Result<ExecRequest, String> {
    let stdin = match &args.stdin {
        Some(path) => read(path)?,
        None => Vec::new(),
    };
    Ok(ExecRequest {
        sandbox_id: args.id.clone(),
        command: Some(exec_command(args)?),
        cwd: args.cwd.clone().unwrap_or_default(),
        env: map(&args.env),
        timeout_ms: args.timeout.unwrap_or(0).saturating_mul(1000),
        stdin,
        memory_limit_mib: args.memory_mib.unwrap_or(0),
        user: args.user.clone().unwrap_or_default(),
        secrets: Vec::new(),
        stdin_open: false,
    })
}

/// `CreateTemplateRequest` of `airlock template create`.
/// `CreateTemplateRequest` of `airlock template create`; `password` is the registry's for
/// `--registry-user` (read by the caller from the environment or stdin).
pub fn template_request(args: &TemplateCreateArgs, password: String) -> CreateTemplateRequest {
    CreateTemplateRequest {
        name: args.name.clone(),
        oci: args.image.as_ref().map(|reference| OciImage {
            reference: reference.clone(),
            username: args.registry_user.clone().unwrap_or_default(),
            password: if args.registry_user.is_some() {
                password
            } else {
                String::new()
            },
        }),
        image: args.from.clone().unwrap_or_default(),
        kernel_path: args.kernel.clone().unwrap_or_default(),
        rootfs_path: args.rootfs.clone().unwrap_or_default(),
        vcpus: args.vcpus.unwrap_or(0),
        memory_mib: args.memory_mib.unwrap_or(0),
        warmup: args.warmup.clone().unwrap_or_default(),
        no_warmup: args.no_warmup,
        replace: args.replace,
    }
}

/// `BuildTemplateRequest` of `airlock template build`: the Dockerfile and the context
/// directory as a tar (regular files and directories; other kinds are refused here, as the
/// daemon would), `password` the registry's for `--registry-user`.
pub fn build_request(
    args: &TemplateBuildArgs,
    password: String,
) -> Result<BuildTemplateRequest, String> {
    let dockerfile_path = args
        .dockerfile
        .clone()
        .unwrap_or_else(|| args.context.join("Dockerfile"));
    let dockerfile = std::fs::read_to_string(&dockerfile_path)
        .map_err(|e| format!("{}: {e}", dockerfile_path.display()))?;
    let context = context_tar(&args.context)?;
    if context.len() > MAX_CONTEXT_BYTES {
        return Err(format!(
            "the build context {} is {} bytes as a tar, more than the {MAX_CONTEXT_BYTES} a \
             build takes",
            args.context.display(),
            context.len()
        ));
    }
    Ok(BuildTemplateRequest {
        name: args.name.clone(),
        dockerfile,
        context,
        build_args: map(&args.build_args),
        network: network_policy(&args.network),
        packages: package_policy(&args.packages),
        registry_username: args.registry_user.clone().unwrap_or_default(),
        registry_password: if args.registry_user.is_some() {
            password
        } else {
            String::new()
        },
        start: args.start.clone().unwrap_or_default(),
        ready_command: args.ready_command.clone().unwrap_or_default(),
        ready_url: args.ready_url.clone().unwrap_or_default(),
        ready_timeout_s: args.ready_timeout.unwrap_or(0),
        no_cache: args.no_cache,
        replace: args.replace,
    })
}

/// The largest build context the daemon takes.
pub const MAX_CONTEXT_BYTES: usize = 3 << 20;

/// `dir` as an uncompressed tar, names relative to it, sorted, owners and times zeroed.
pub fn context_tar(dir: &Path) -> Result<Vec<u8>, String> {
    fn walk(
        dir: &Path,
        rel: &Path,
        out: &mut Vec<(std::path::PathBuf, bool)>,
    ) -> Result<(), String> {
        let mut entries: Vec<_> = std::fs::read_dir(dir.join(rel))
            .map_err(|e| format!("{}: {e}", dir.join(rel).display()))?
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let r = rel.join(e.file_name());
            let ty = e.file_type().map_err(|e| format!("{}: {e}", r.display()))?;
            if ty.is_dir() {
                out.push((r.clone(), true));
                walk(dir, &r, out)?;
            } else if ty.is_file() {
                out.push((r, false));
            } else {
                return Err(format!(
                    "{}: the build context holds regular files and directories only",
                    dir.join(&r).display()
                ));
            }
        }
        Ok(())
    }
    let mut list = Vec::new();
    walk(dir, Path::new(""), &mut list)?;
    let mut b = tar::Builder::new(Vec::new());
    for (rel, is_dir) in list {
        let full = dir.join(&rel);
        let meta = std::fs::metadata(&full).map_err(|e| format!("{}: {e}", full.display()))?;
        let mut h = tar::Header::new_gnu();
        h.set_mode(std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o7777);
        h.set_mtime(0);
        let data = if is_dir {
            h.set_entry_type(tar::EntryType::Directory);
            Vec::new()
        } else {
            std::fs::read(&full).map_err(|e| format!("{}: {e}", full.display()))?
        };
        h.set_size(data.len() as u64);
        b.append_data(&mut h, &rel, data.as_slice())
            .map_err(|e| format!("{}: {e}", full.display()))?;
    }
    b.into_inner()
        .map_err(|e| format!("the build context's tar: {e}"))
}

/// `ListSandboxesRequest` of `airlock ls`.
pub fn list_request(args: &LsArgs) -> ListSandboxesRequest {
    let state = |s: &StateArg| match s {
        StateArg::Starting => SandboxState::Starting,
        StateArg::Running => SandboxState::Running,
        StateArg::Paused => SandboxState::Paused,
        StateArg::Dead => SandboxState::Dead,
        StateArg::Destroyed => SandboxState::Destroyed,
    };
    ListSandboxesRequest {
        labels: map(&args.labels),
        states: args.states.iter().map(|s| state(s) as i32).collect(),
    }
}
