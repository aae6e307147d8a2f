//! The daemon's errors and their one mapping to gRPC: a status code plus a `google.rpc.ErrorInfo`
//! detail whose `reason` tells a client its own mistakes, the user's code failing and platform
//! trouble apart (see the header of `proto/airlock.proto`).

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

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
    #[error("template {0} exists; templates are immutable (delete it first)")]
    TemplateExists(String),
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
    /// The sandbox's VMM ended (reason code: GUEST_CRASHED, OOM_KILLED, SECCOMP_VIOLATION or
    /// SANDBOX_DEAD).
    #[error("sandbox {id} is dead: {message}")]
    Dead {
        id: String,
        reason: String,
        message: String,
    },
    #[error("the guest agent of sandbox {id} did not answer: {message}")]
    AgentUnavailable { id: String, message: String },
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// The machine-readable reason code.
    pub fn reason(&self) -> &str {
        match self {
            Self::InvalidArgument(_) => "INVALID_ARGUMENT",
            Self::Unauthenticated(_) => "UNAUTHENTICATED",
            Self::SandboxNotFound(_) => "SANDBOX_NOT_FOUND",
            Self::ExecutionNotFound(_) => "EXECUTION_NOT_FOUND",
            Self::TemplateNotFound(_) => "TEMPLATE_NOT_FOUND",
            Self::TemplateExists(_) => "TEMPLATE_EXISTS",
            Self::SandboxNotRunning { .. } => "SANDBOX_NOT_RUNNING",
            Self::Capacity { .. } => "CAPACITY_EXHAUSTED",
            Self::Quota { .. } => "QUOTA_EXCEEDED",
            Self::FileTooLarge { .. } => "FILE_TOO_LARGE",
            Self::DiskQuota { .. } => "DISK_QUOTA_EXCEEDED",
            Self::PathNotAllowed { .. } => "PATH_NOT_ALLOWED",
            Self::Dead { reason, .. } => reason,
            Self::AgentUnavailable { .. } => "AGENT_UNAVAILABLE",
            Self::Internal(_) => "INTERNAL",
        }
    }

    fn code(&self) -> Code {
        match self {
            Self::InvalidArgument(_) => Code::InvalidArgument,
            Self::Unauthenticated(_) => Code::Unauthenticated,
            Self::SandboxNotFound(_) | Self::ExecutionNotFound(_) | Self::TemplateNotFound(_) => {
                Code::NotFound
            }
            Self::TemplateExists(_) => Code::AlreadyExists,
            Self::SandboxNotRunning { .. } => Code::FailedPrecondition,
            Self::Capacity { .. }
            | Self::Quota { .. }
            | Self::FileTooLarge { .. }
            | Self::DiskQuota { .. } => Code::ResourceExhausted,
            Self::PathNotAllowed { .. } => Code::PermissionDenied,
            Self::Dead { .. } | Self::AgentUnavailable { .. } => Code::Unavailable,
            Self::Internal(_) => Code::Internal,
        }
    }

    fn metadata(&self) -> HashMap<String, String> {
        let mut m = HashMap::new();
        match self {
            Self::SandboxNotFound(id)
            | Self::SandboxNotRunning { id, .. }
            | Self::Dead { id, .. }
            | Self::AgentUnavailable { id, .. } => {
                m.insert("sandbox_id".into(), id.clone());
            }
            Self::ExecutionNotFound(id) => {
                m.insert("execution_id".into(), id.clone());
            }
            Self::TemplateNotFound(name) | Self::TemplateExists(name) => {
                m.insert("template".into(), name.clone());
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
            Self::PathNotAllowed { path, .. } => {
                m.insert("path".into(), path.clone());
            }
            Self::DiskQuota { limit, .. } => {
                m.insert("limit".into(), limit.to_string());
            }
            Self::InvalidArgument(_) | Self::Unauthenticated(_) | Self::Internal(_) => {}
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
        Self::Internal(format!("record store: {e}"))
    }
}

impl From<std::io::Error> for ApiError {
    fn from(e: std::io::Error) -> Self {
        Self::Internal(format!("I/O: {e}"))
    }
}

/// Result of a call.
pub type ApiResult<T> = Result<T, ApiError>;

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
            reason: "OOM_KILLED".into(),
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
}
