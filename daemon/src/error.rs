//! The daemon's errors and their one mapping to gRPC: a status code plus a `google.rpc.ErrorInfo`
//! detail whose `reason` tells a client its own mistakes, the user's code failing and platform
//! trouble apart (see the header of `proto/airlock.proto`).

use std::collections::HashMap;

use airlock_proto::ClientError;
use airlock_proto::pb::ErrorCode;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::reason::EndReason;

/// Every way a call can fail.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("execution {0} not found")]
    ExecutionNotFound(String),
    #[error("template {0} not found")]
    TemplateNotFound(String),
    #[error("template {0} exists; templates are immutable (delete it first, or replace it)")]
    TemplateExists(String),
    /// DeleteTemplate of a version live sandboxes were restored from (`by`: some of them).
    #[error("template {name} is in use by {count} live sandbox(es) ({by}); destroy them first")]
    TemplateInUse {
        name: String,
        by: String,
        count: usize,
    },
    /// The template was made by a VMM or guest agent this daemon cannot restore.
    #[error(
        "template {name} cannot be restored here: {why}; rebuild it: `airlock template rebuild {name}`"
    )]
    TemplateOutdated { name: String, why: String },
    /// The caller's token lacks the right the call needs.
    #[error("{0}")]
    NotPermitted(String),
    #[error("volume {0} not found")]
    VolumeNotFound(String),
    #[error("volume {0} exists")]
    VolumeExists(String),
    /// The volume is mounted where this use cannot share it (`by`: the sandboxes).
    #[error("volume {name} is in use by {by}: {why}")]
    VolumeInUse {
        name: String,
        by: String,
        why: &'static str,
    },
    #[error("sandbox {id} is {state}")]
    SandboxNotRunning { id: String, state: String },
    #[error("host capacity exhausted: {what} {current} of {limit}")]
    Capacity {
        what: &'static str,
        limit: u64,
        current: u64,
    },
    #[error("tenant {tenant}'s quota exceeded: {what} {current} of {limit}")]
    Quota {
        tenant: String,
        what: &'static str,
        limit: u64,
        current: u64,
    },
    #[error("file too large: {size} bytes, the limit is {limit}")]
    FileTooLarge { size: u64, limit: u64 },
    #[error("the sandbox's disk quota of {limit} bytes is used up: {message}")]
    DiskQuota { limit: u64, message: String },
    #[error("path {path} is not allowed: {why}")]
    PathNotAllowed { path: String, why: String },
    /// The export policy refuses a read (`rule`: the pattern or the cap).
    #[error("{path} may not leave the sandbox: {rule}")]
    ExportDenied { path: String, rule: String },
    #[error("{path} does not exist in the sandbox")]
    FileNotFound { path: String },
    /// The guest account the call acted as may not do it (file permissions in the guest).
    #[error("{path}: permission denied in the guest: {message}")]
    GuestPermission { path: String, message: String },
    /// The sandbox's VMM ended (reason code: GUEST_CRASHED, OOM_KILLED, SECCOMP_VIOLATION or
    /// SANDBOX_DEAD).
    #[error("sandbox {id} is dead: {message}")]
    Dead {
        id: String,
        reason: EndReason,
        message: String,
    },
    #[error("the guest agent of sandbox {id} did not answer: {message}")]
    AgentUnavailable { id: String, message: String },
    /// The code interpreter in the guest (vsock port 49999) did not answer as it should:
    /// nothing listens (a template without it), or its answer broke off or was malformed.
    #[error("the code interpreter of sandbox {id} is unavailable: {message}")]
    InterpreterUnavailable { id: String, message: String },
    /// A code context the interpreter does not know.
    #[error("code context {0} not found")]
    CodeContextNotFound(String),
    /// A network policy asks for more than the tenant's ceiling allows.
    #[error("egress rule {rule} is beyond what the operator allows tenant {tenant}")]
    NetworkNotAllowed { tenant: String, rule: String },
    /// A package policy asks for a registry beyond the tenant's ceiling.
    #[error("package policy: {message} (tenant {tenant})")]
    PackagesNotAllowed { tenant: String, message: String },
    /// The sandbox's policy keeps root out of reach (CreateSandboxRequest.no_root), and the call
    /// asked for root.
    #[error("sandbox {id} keeps root out of reach (its policy sets no_root): {what}")]
    RootNotAllowed { id: String, what: String },
    /// SnapshotSandbox of a sandbox whose guest holds or held secret values.
    #[error("sandbox {id} cannot be snapshotted: {why}")]
    SecretsPresent { id: String, why: String },
    /// The daemon's data directory (records, output, snapshots) has no space left.
    #[error("the host's data directory is full: {0}")]
    DataDirFull(String),
    /// Cluster mode: the node that runs the sandbox (or the execution) left the cluster.
    #[error("{id} ran on node {node}, which left the cluster (its lease expired)")]
    NodeLost { id: String, node: String },
    /// Cluster mode: etcd could not be reached for what the call needs (a quota count).
    #[error("the cluster's store is unavailable: {0}")]
    ClusterUnavailable(String),
    /// An image (CreateTemplateRequest.oci) that cannot become a template: a hostile or
    /// malformed entry, a wrong digest, a cap exceeded, another platform.
    #[error("image {image}: {why}")]
    ImageRefused { image: String, why: String },
    /// The image's registry did not answer as it should (unreachable, timed out, refused the
    /// credentials).
    #[error("{why}")]
    RegistryUnavailable { registry: String, why: String },
    /// A Dockerfile build's step failed (its command exited non-zero, or could not start).
    #[error("line {line}: {step}: {why}")]
    BuildStepFailed {
        line: usize,
        step: String,
        why: String,
    },
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// The machine-readable reason code.
    pub fn reason(&self) -> &str {
        match self {
            Self::InvalidArgument(_) => "INVALID_ARGUMENT",
            Self::NetworkNotAllowed { .. } => "NETWORK_NOT_ALLOWED",
            Self::PackagesNotAllowed { .. } => "PACKAGES_NOT_ALLOWED",
            Self::RootNotAllowed { .. } => "ROOT_NOT_ALLOWED",
            Self::Unauthenticated(_) => "UNAUTHENTICATED",
            Self::SandboxNotFound(_) => "SANDBOX_NOT_FOUND",
            Self::ExecutionNotFound(_) => "EXECUTION_NOT_FOUND",
            Self::TemplateNotFound(_) => "TEMPLATE_NOT_FOUND",
            Self::TemplateExists(_) => "TEMPLATE_EXISTS",
            Self::TemplateInUse { .. } => "TEMPLATE_IN_USE",
            Self::TemplateOutdated { .. } => "TEMPLATE_OUTDATED",
            Self::NotPermitted(_) => "NOT_PERMITTED",
            Self::VolumeNotFound(_) => "VOLUME_NOT_FOUND",
            Self::VolumeExists(_) => "VOLUME_EXISTS",
            Self::VolumeInUse { .. } => "VOLUME_IN_USE",
            Self::SandboxNotRunning { .. } => "SANDBOX_NOT_RUNNING",
            Self::SecretsPresent { .. } => "SECRETS_PRESENT",
            Self::Capacity { .. } | Self::DataDirFull(_) => "CAPACITY_EXHAUSTED",
            Self::Quota { .. } => "QUOTA_EXCEEDED",
            Self::FileTooLarge { .. } => "FILE_TOO_LARGE",
            Self::DiskQuota { .. } => "DISK_QUOTA_EXCEEDED",
            Self::PathNotAllowed { .. } => "PATH_NOT_ALLOWED",
            Self::ExportDenied { .. } => "EXPORT_DENIED",
            Self::FileNotFound { .. } => "FILE_NOT_FOUND",
            Self::GuestPermission { .. } => "GUEST_PERMISSION_DENIED",
            Self::Dead { reason, .. } => reason.dead_call_reason(),
            Self::AgentUnavailable { .. } => "AGENT_UNAVAILABLE",
            Self::InterpreterUnavailable { .. } => "INTERPRETER_UNAVAILABLE",
            Self::CodeContextNotFound(_) => "CODE_CONTEXT_NOT_FOUND",
            Self::NodeLost { .. } => "NODE_LOST",
            Self::ClusterUnavailable(_) => "CLUSTER_UNAVAILABLE",
            Self::ImageRefused { .. } => "IMAGE_REFUSED",
            Self::RegistryUnavailable { .. } => "REGISTRY_UNAVAILABLE",
            Self::BuildStepFailed { .. } => "BUILD_STEP_FAILED",
            Self::Internal(_) => "INTERNAL",
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument(_) | Self::ImageRefused { .. } => Code::InvalidArgument,
            Self::Unauthenticated(_) => Code::Unauthenticated,
            Self::SandboxNotFound(_)
            | Self::ExecutionNotFound(_)
            | Self::TemplateNotFound(_)
            | Self::VolumeNotFound(_)
            | Self::CodeContextNotFound(_)
            | Self::FileNotFound { .. } => Code::NotFound,
            Self::TemplateExists(_) | Self::VolumeExists(_) => Code::AlreadyExists,
            Self::SandboxNotRunning { .. }
            | Self::VolumeInUse { .. }
            | Self::SecretsPresent { .. }
            | Self::TemplateInUse { .. }
            | Self::TemplateOutdated { .. }
            | Self::BuildStepFailed { .. } => Code::FailedPrecondition,
            Self::Capacity { .. }
            | Self::DataDirFull(_)
            | Self::Quota { .. }
            | Self::FileTooLarge { .. }
            | Self::DiskQuota { .. } => Code::ResourceExhausted,
            Self::PathNotAllowed { .. }
            | Self::ExportDenied { .. }
            | Self::GuestPermission { .. }
            | Self::NetworkNotAllowed { .. }
            | Self::PackagesNotAllowed { .. }
            | Self::NotPermitted(_)
            | Self::RootNotAllowed { .. } => Code::PermissionDenied,
            Self::Dead { .. }
            | Self::AgentUnavailable { .. }
            | Self::InterpreterUnavailable { .. }
            | Self::NodeLost { .. }
            | Self::ClusterUnavailable(_)
            | Self::RegistryUnavailable { .. } => Code::Unavailable,
            Self::Internal(_) => Code::Internal,
        }
    }

    /// The error's details for its `ErrorInfo` metadata (ids, names, limits), by variant.
    // Long: one arm per error variant, a table of which details each carries; split, the
    // table would be spread over helpers with nothing of their own to say.
    fn metadata(&self) -> HashMap<String, String> {
        let mut m = HashMap::new();
        match self {
            Self::SandboxNotFound(id)
            | Self::SandboxNotRunning { id, .. }
            | Self::SecretsPresent { id, .. }
            | Self::RootNotAllowed { id, .. }
            | Self::Dead { id, .. }
            | Self::AgentUnavailable { id, .. }
            | Self::InterpreterUnavailable { id, .. } => {
                m.insert("sandbox_id".into(), id.clone());
            }
            Self::ExecutionNotFound(id) => {
                m.insert("execution_id".into(), id.clone());
            }
            Self::CodeContextNotFound(id) => {
                m.insert("context_id".into(), id.clone());
            }
            Self::ImageRefused { image, .. } => {
                m.insert("image".into(), image.clone());
            }
            Self::RegistryUnavailable { registry, .. } => {
                m.insert("registry".into(), registry.clone());
            }
            Self::BuildStepFailed { line, .. } => {
                m.insert("line".into(), line.to_string());
            }
            Self::TemplateNotFound(name)
            | Self::TemplateExists(name)
            | Self::TemplateOutdated { name, .. } => {
                m.insert("template".into(), name.clone());
            }
            Self::TemplateInUse { name, by, count } => {
                m.insert("template".into(), name.clone());
                m.insert("sandbox_id".into(), by.clone());
                m.insert("count".into(), count.to_string());
            }
            Self::VolumeNotFound(name) | Self::VolumeExists(name) => {
                m.insert("volume".into(), name.clone());
            }
            Self::VolumeInUse { name, by, .. } => {
                m.insert("volume".into(), name.clone());
                m.insert("sandbox_id".into(), by.clone());
            }
            Self::Capacity {
                what,
                limit,
                current,
            } => {
                m.insert("resource".into(), (*what).into());
                m.insert("limit".into(), limit.to_string());
                m.insert("current".into(), current.to_string());
            }
            Self::Quota {
                tenant,
                what,
                limit,
                current,
            } => {
                m.insert("tenant".into(), tenant.clone());
                m.insert("resource".into(), (*what).into());
                m.insert("limit".into(), limit.to_string());
                m.insert("current".into(), current.to_string());
            }
            Self::FileTooLarge { size, limit } => {
                m.insert("size".into(), size.to_string());
                m.insert("limit".into(), limit.to_string());
            }
            Self::PathNotAllowed { path, .. }
            | Self::FileNotFound { path }
            | Self::GuestPermission { path, .. } => {
                m.insert("path".into(), path.clone());
            }
            Self::DiskQuota { limit, .. } => {
                m.insert("limit".into(), limit.to_string());
            }
            Self::ExportDenied { path, rule } => {
                m.insert("path".into(), path.clone());
                m.insert("rule".into(), rule.clone());
            }
            Self::DataDirFull(_) => {
                m.insert("resource".into(), "data_dir".into());
            }
            Self::NetworkNotAllowed { tenant, rule } => {
                m.insert("tenant".into(), tenant.clone());
                m.insert("rule".into(), rule.clone());
            }
            Self::PackagesNotAllowed { tenant, .. } => {
                m.insert("tenant".into(), tenant.clone());
            }
            Self::NodeLost { id, node } => {
                let key = if crate::ids::Kind::Execution.names(id) {
                    "execution_id"
                } else {
                    "sandbox_id"
                };
                m.insert(key.into(), id.clone());
                m.insert("node".into(), node.clone());
            }
            Self::InvalidArgument(_)
            | Self::Unauthenticated(_)
            | Self::NotPermitted(_)
            | Self::Internal(_)
            | Self::ClusterUnavailable(_) => {}
        }
        if let Self::SandboxNotRunning { state, .. } = self {
            m.insert("state".into(), state.clone());
        }
        m
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Self {
        let details =
            ErrorDetails::with_error_info(e.reason(), airlock_api::ERROR_DOMAIN, e.metadata());
        Status::with_error_details(e.code(), e.to_string(), details)
    }
}

impl From<rusqlite::Error> for ApiError {
    fn from(e: rusqlite::Error) -> Self {
        if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) {
            return Self::DataDirFull(format!("record store: {e}"));
        }
        Self::Internal(format!("record store: {e}"))
    }
}

impl From<std::io::Error> for ApiError {
    fn from(e: std::io::Error) -> Self {
        if e.raw_os_error() == Some(libc::ENOSPC) {
            return Self::DataDirFull(e.to_string());
        }
        Self::Internal(format!("I/O: {e}"))
    }
}

/// Result of a call.
pub type ApiResult<T> = Result<T, ApiError>;

/// Why the daemon cannot start, or why it stopped serving: told to the operator, and the
/// process exits. (A call's failure is an [`ApiError`].)
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The settings file, or a setting that cannot work (the message names its key).
    #[error("{0}")]
    Setting(String),
    /// A file, directory or socket the daemon needs (`what` names it and the step).
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// TLS material that cannot be used.
    #[error("TLS: {0}")]
    Tls(String),
    /// The record store.
    #[error("record store: {0}")]
    Store(#[from] rusqlite::Error),
    /// Cluster mode: etcd, the node's tag or lease, the other nodes (`cluster::ClusterError`,
    /// a part above this module).
    #[error("{0}")]
    Cluster(Box<dyn std::error::Error + Send + Sync>),
    /// A listener that stopped serving.
    #[error("{0}")]
    Serve(String),
    /// A part that failed as it started (its error as a call would see it).
    #[error("{0}")]
    Api(#[from] ApiError),
    /// A named part that failed as it started.
    #[error("{part}: {source}")]
    Part {
        part: &'static str,
        #[source]
        source: ApiError,
    },
    /// A start-up task that panicked or was cancelled.
    #[error("start-up task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl StartError {
    /// An I/O error of `what`.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}

/// What an agent call was doing, for [`from_agent`].
#[derive(Clone, Copy, Debug)]
pub struct AgentCall<'a> {
    /// The sandbox.
    pub sandbox: &'a str,
    /// The path the call was about, if any.
    pub path: &'a str,
    /// The sandbox's writable space, for DISK_QUOTA_EXCEEDED.
    pub disk_limit: u64,
}

/// The one conversion of an agent client's error into the API's: what the agent refused keeps
/// its meaning (a path that escapes, a full disk, a missing or oversized file, a bad request);
/// a broken, silent or misbehaving connection is AGENT_UNAVAILABLE.
pub fn from_agent(e: ClientError, call: AgentCall<'_>) -> ApiError {
    let path = call.path.to_owned();
    match e {
        ClientError::Agent { code, message } => match code {
            ErrorCode::PathEscape => ApiError::PathNotAllowed { path, why: message },
            ErrorCode::NoSpace => ApiError::DiskQuota {
                limit: call.disk_limit,
                message,
            },
            ErrorCode::NotFound => ApiError::FileNotFound { path },
            ErrorCode::TooLarge => ApiError::InvalidArgument(format!("{path}: {message}")),
            ErrorCode::PermissionDenied => ApiError::GuestPermission { path, message },
            ErrorCode::InvalidArgument | ErrorCode::AlreadyExists | ErrorCode::Io => {
                ApiError::InvalidArgument(format!("{path}: {message}"))
            }
            _ => ApiError::AgentUnavailable {
                id: call.sandbox.to_owned(),
                message: format!("the agent failed ({code:?}): {message}"),
            },
        },
        other => ApiError::AgentUnavailable {
            id: call.sandbox.to_owned(),
            message: error_chain(&other),
        },
    }
}

/// An error with its sources, `: `-separated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        next = cause.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_errors_carry_reason_limit_and_current() {
        let status: Status = ApiError::Capacity {
            what: "sandboxes",
            limit: 4,
            current: 4,
        }
        .into();
        assert_eq!(status.code(), Code::ResourceExhausted);
        let info = status.get_details_error_info().expect("ErrorInfo detail");
        assert_eq!(info.reason, "CAPACITY_EXHAUSTED");
        assert_eq!(info.domain, airlock_api::ERROR_DOMAIN);
        assert_eq!(info.metadata["limit"], "4");
        assert_eq!(info.metadata["current"], "4");
    }

    #[test]
    fn user_and_platform_failures_map_to_distinct_codes() {
        let dead: Status = ApiError::Dead {
            id: "sb-1".into(),
            reason: EndReason::OomKilled,
            message: "memory limit".into(),
        }
        .into();
        assert_eq!(dead.code(), Code::Unavailable);
        assert_eq!(dead.get_details_error_info().unwrap().reason, "OOM_KILLED");
        let missing: Status = ApiError::SandboxNotFound("sb-2".into()).into();
        assert_eq!(missing.code(), Code::NotFound);
        let bad: Status = ApiError::InvalidArgument("x".into()).into();
        assert_eq!(bad.code(), Code::InvalidArgument);
    }

    #[test]
    fn a_full_data_directory_is_capacity_not_a_fault() {
        let full: Status = ApiError::from(std::io::Error::from_raw_os_error(libc::ENOSPC)).into();
        assert_eq!(full.code(), Code::ResourceExhausted);
        let info = full.get_details_error_info().unwrap();
        assert_eq!(info.reason, "CAPACITY_EXHAUSTED");
        assert_eq!(info.metadata["resource"], "data_dir");
        let other: Status = ApiError::from(std::io::Error::from_raw_os_error(libc::EIO)).into();
        assert_eq!(other.code(), Code::Internal);
    }

    #[test]
    fn agent_errors_convert_by_code_not_by_text() {
        let call = AgentCall {
            sandbox: "sb-1",
            path: "/tmp/x",
            disk_limit: 1 << 20,
        };
        let refused = |code, message: &str| ClientError::Agent {
            code,
            message: message.into(),
        };
        let cases = [
            (
                refused(ErrorCode::PathEscape, "a symlink"),
                "PATH_NOT_ALLOWED",
            ),
            (refused(ErrorCode::NoSpace, "ENOSPC"), "DISK_QUOTA_EXCEEDED"),
            (
                refused(ErrorCode::NotFound, "no such file"),
                "FILE_NOT_FOUND",
            ),
            (
                refused(ErrorCode::InvalidArgument, "PathEscape"),
                "INVALID_ARGUMENT",
            ),
            (refused(ErrorCode::Internal, "bug"), "AGENT_UNAVAILABLE"),
            (ClientError::Closed, "AGENT_UNAVAILABLE"),
            (ClientError::Protocol("garbage".into()), "AGENT_UNAVAILABLE"),
        ];
        for (e, want) in cases {
            let text = e.to_string();
            assert_eq!(from_agent(e, call).reason(), want, "{text}");
        }
        match from_agent(refused(ErrorCode::NoSpace, "full"), call) {
            ApiError::DiskQuota { limit, .. } => assert_eq!(limit, 1 << 20),
            other => panic!("{other:?}"),
        }
    }
}
