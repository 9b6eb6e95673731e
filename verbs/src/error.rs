//! Errors of the verbs layer: every libibverbs failure comes back as one of these values.

use std::fmt;

/// Why a work request did not complete, from the completion's status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionStatus {
    /// A local length error (a receive buffer too small for an incoming SEND, for example).
    LocalLength,
    /// A local queue-pair operation error.
    LocalQpOperation,
    /// A local protection error: an lkey that does not cover the buffer.
    LocalProtection,
    /// The request was flushed because the queue pair went to the error state.
    Flushed,
    /// The responder rejected the request as invalid (a WRITE beyond its receive queue, for example).
    RemoteInvalidRequest,
    /// The responder refused access: a bad rkey, an address outside the region, missing rights.
    RemoteAccess,
    /// The responder failed to carry out the operation.
    RemoteOperation,
    /// The peer did not acknowledge within the retry budget: it is gone or unreachable.
    RetryExceeded,
    /// The peer had no receive posted within the RNR retry budget.
    ReceiverNotReady,
    /// A local access error.
    LocalAccess,
    /// A bad response from the responder.
    BadResponse,
    /// Any other status; the raw code is kept.
    Other(u32),
}

impl CompletionStatus {
    /// Maps a raw `ibv_wc_status` (0 is success and is not a `CompletionStatus`).
    pub fn from_raw(status: u32) -> CompletionStatus {
        // Values of `enum ibv_wc_status` (verbs.h); stable ABI since the first libibverbs.
        match status {
            1 => CompletionStatus::LocalLength,
            2 => CompletionStatus::LocalQpOperation,
            4 => CompletionStatus::LocalProtection,
            5 => CompletionStatus::Flushed,
            7 => CompletionStatus::BadResponse,
            8 => CompletionStatus::LocalAccess,
            9 => CompletionStatus::RemoteInvalidRequest,
            10 => CompletionStatus::RemoteAccess,
            11 => CompletionStatus::RemoteOperation,
            12 => CompletionStatus::RetryExceeded,
            13 => CompletionStatus::ReceiverNotReady,
            other => CompletionStatus::Other(other),
        }
    }

    /// Whether the status says the peer is unreachable (rather than that one request was bad).
    pub fn is_connection_loss(self) -> bool {
        matches!(self, CompletionStatus::RetryExceeded | CompletionStatus::ReceiverNotReady)
    }
}

impl fmt::Display for CompletionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            CompletionStatus::LocalLength => "local length error",
            CompletionStatus::LocalQpOperation => "local queue-pair operation error",
            CompletionStatus::LocalProtection => "local protection error (bad lkey or buffer)",
            CompletionStatus::Flushed => "flushed (the queue pair is in the error state)",
            CompletionStatus::RemoteInvalidRequest => "remote invalid request",
            CompletionStatus::RemoteAccess => "remote access error (bad rkey, out of bounds, or missing rights)",
            CompletionStatus::RemoteOperation => "remote operation error",
            CompletionStatus::RetryExceeded => "transport retry counter exceeded (peer unreachable)",
            CompletionStatus::ReceiverNotReady => "receiver-not-ready retry counter exceeded",
            CompletionStatus::LocalAccess => "local access error",
            CompletionStatus::BadResponse => "bad response",
            CompletionStatus::Other(code) => return write!(f, "completion status {code}"),
        };
        f.write_str(text)
    }
}

/// Everything the verbs layer can fail with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// No usable verbs: libibverbs is missing, the kernel has no RDMA support, there are no
    /// devices, or no port is active.
    #[error("no verbs: {0}")]
    Unavailable(String),
    /// The named device does not exist.
    #[error("no verbs device named '{name}' (devices: {available})")]
    NoSuchDevice {
        /// The requested name.
        name: String,
        /// The names that exist, comma-separated.
        available: String,
    },
    /// A device or port query, or the creation of a resource, failed.
    #[error("{what} failed: {reason}")]
    Resource {
        /// The operation.
        what: &'static str,
        /// The reason libibverbs gave.
        reason: String,
    },
    /// Memory registration failed.
    #[error("registering {len} bytes failed: {reason}{hint}")]
    Registration {
        /// Bytes the caller tried to register.
        len: usize,
        /// The reason libibverbs gave.
        reason: String,
        /// What to change, when the memlock limit is the likely cause (empty otherwise).
        hint: String,
    },
    /// A queue-pair state change failed.
    #[error("moving the queue pair to {state} failed: {reason}")]
    Connect {
        /// The target state.
        state: &'static str,
        /// The reason.
        reason: String,
    },
    /// Posting a work request failed (a full queue, a bad request, or a broken queue pair).
    #[error("posting {what} failed: {reason}")]
    Post {
        /// What was posted.
        what: &'static str,
        /// The reason.
        reason: String,
    },
    /// A work request completed with an error.
    #[error("work request {wr_id} failed: {status} (vendor error {vendor_error:#x})")]
    Completion {
        /// The request's id.
        wr_id: u64,
        /// The status.
        status: CompletionStatus,
        /// The vendor's error code.
        vendor_error: u32,
    },
    /// A request the wrapper refused before posting it (a buffer outside its region, for example).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Exchanging connection details with the peer failed.
    #[error("exchanging connection details failed: {0}")]
    Exchange(String),
}

/// Shorthand for results of this crate.
pub type Result<T, E = VerbsError> = std::result::Result<T, E>;
