//! What can go wrong talking to an agent, and how a response becomes a result.

use std::io;

use super::MAX_STASHED_BYTES;
use crate::PROTOCOL_VERSION;
use crate::frame::FrameError;
use crate::pb::{self, ErrorCode, Response, response};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting to the agent's socket failed.
    #[error("connecting to {path}")]
    Connect {
        path: String,
        #[source]
        source: io::Error,
    },
    /// The VMM's hybrid-vsock socket did not answer `CONNECT` with `OK`.
    #[error("vsock handshake failed: {0}")]
    Handshake(String),
    /// Reading or writing a frame failed.
    #[error("agent connection failed")]
    Frame(#[from] FrameError),
    /// The agent closed the connection.
    #[error("the agent closed the connection")]
    Closed,
    /// The first frame was not `Ready`.
    #[error("the agent's first frame was not Ready: {0}")]
    NotReady(String),
    /// The agent speaks another protocol version.
    #[error("the agent speaks protocol version {got}, this client speaks {PROTOCOL_VERSION}")]
    Version { got: u32 },
    /// The agent answered the request with an `Error`.
    #[error("the agent refused the request ({code:?}): {message}")]
    Agent { code: ErrorCode, message: String },
    /// The agent sent something the protocol does not allow.
    #[error("the agent broke the protocol: {0}")]
    Protocol(String),
    /// Too many responses for other requests arrived while waiting.
    #[error("more than {MAX_STASHED_BYTES} bytes of responses are waiting to be read")]
    Backlog,
    /// A shared connection ([`crate::mux::Mux`]) closed, or stopped routing this caller's
    /// answers.
    #[error("the agent connection was lost: {0}")]
    Lost(String),
    /// The caller's request cannot be sent (zero or duplicate id).
    #[error("invalid request: {0}")]
    InvalidRequest(&'static str),
}

impl ClientError {
    /// The agent's error code, if the agent refused the request.
    pub fn agent_code(&self) -> Option<ErrorCode> {
        match self {
            Self::Agent { code, .. } => Some(*code),
            _ => None,
        }
    }
}

pub(crate) fn protocol(msg: String) -> ClientError {
    ClientError::Protocol(msg)
}

pub(crate) fn agent_error(e: pb::Error) -> ClientError {
    ClientError::Agent {
        code: ErrorCode::try_from(e.code).unwrap_or(ErrorCode::Unspecified),
        message: e.message,
    }
}

/// The response's kind, with an `Error` turned into [`ClientError::Agent`].
pub(super) fn into_kind(resp: Response) -> Result<response::Kind, ClientError> {
    match resp.kind {
        Some(response::Kind::Error(e)) => Err(agent_error(e)),
        Some(kind) => Ok(kind),
        None => Err(protocol(format!("response {} without a kind", resp.id))),
    }
}

pub(super) fn expect_ok(kind: response::Kind) -> Result<(), ClientError> {
    match kind {
        response::Kind::Ok(_) => Ok(()),
        other => Err(protocol(format!("expected Ok, got {other:?}"))),
    }
}
