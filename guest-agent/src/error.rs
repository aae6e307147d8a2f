//! The error every request handler returns: a protocol error code and a message for the host.

use std::io;

use airlock_proto::pb::{self, ErrorCode, Response, response};

/// A request failed; answered with `Error { code, message }`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ReqError {
    pub code: ErrorCode,
    pub message: String,
}

impl ReqError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }

    /// An I/O failure while doing `what`, with the code that fits its errno.
    pub fn io(what: &str, e: &io::Error) -> Self {
        Self::new(code_for(e), format!("{what}: {e}"))
    }

    /// The response carrying this error for request `id`.
    pub fn response(&self, id: u64) -> Response {
        Response {
            id,
            kind: Some(response::Kind::Error(pb::Error {
                code: self.code as i32,
                message: self.message.clone(),
            })),
        }
    }
}

/// The protocol error code for an OS error.
pub fn code_for(e: &io::Error) -> ErrorCode {
    let Some(errno) = e.raw_os_error() else {
        return match e.kind() {
            io::ErrorKind::InvalidInput => ErrorCode::InvalidArgument,
            io::ErrorKind::NotFound => ErrorCode::NotFound,
            _ => ErrorCode::Io,
        };
    };
    match errno {
        libc::ENOENT | libc::ENOTDIR | libc::ESRCH => ErrorCode::NotFound,
        libc::EACCES | libc::EPERM | libc::EROFS => ErrorCode::PermissionDenied,
        libc::EEXIST => ErrorCode::AlreadyExists,
        // openat2 with RESOLVE_BENEATH refuses a path that would leave its root with EXDEV.
        libc::EXDEV => ErrorCode::PathEscape,
        libc::EFBIG | libc::E2BIG | libc::ENAMETOOLONG => ErrorCode::TooLarge,
        libc::ENOSPC | libc::EDQUOT => ErrorCode::NoSpace,
        libc::EISDIR | libc::ENOTEMPTY | libc::EINVAL | libc::ELOOP | libc::ENOEXEC => {
            ErrorCode::InvalidArgument
        }
        libc::EAGAIN | libc::EMFILE | libc::ENFILE | libc::ENOMEM => ErrorCode::LimitExceeded,
        libc::ENOSYS => ErrorCode::Unsupported,
        _ => ErrorCode::Io,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_maps_to_protocol_codes() {
        let code = |n| code_for(&io::Error::from_raw_os_error(n));
        assert_eq!(code(libc::ENOENT), ErrorCode::NotFound);
        assert_eq!(code(libc::EACCES), ErrorCode::PermissionDenied);
        assert_eq!(code(libc::EEXIST), ErrorCode::AlreadyExists);
        assert_eq!(code(libc::EXDEV), ErrorCode::PathEscape);
        assert_eq!(code(libc::EFBIG), ErrorCode::TooLarge);
        assert_eq!(code(libc::ENOTEMPTY), ErrorCode::InvalidArgument);
        assert_eq!(code(libc::EIO), ErrorCode::Io);
    }

    #[test]
    fn error_without_errno_maps_by_kind() {
        let e = io::Error::new(io::ErrorKind::InvalidInput, "nul byte");
        assert_eq!(code_for(&e), ErrorCode::InvalidArgument);
    }

    #[test]
    fn response_carries_id_code_and_message() {
        let resp = ReqError::new(ErrorCode::TooLarge, "big").response(7);
        assert_eq!(resp.id, 7);
        match resp.kind {
            Some(response::Kind::Error(e)) => {
                assert_eq!(e.code, ErrorCode::TooLarge as i32);
                assert_eq!(e.message, "big");
            }
            other => panic!("{other:?}"),
        }
    }
}
