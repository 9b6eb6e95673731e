//! Errors returned to callers of the engine.

/// Everything a Ferry call can fail with. Errors are values: bad input from a caller or from the
/// network ends up here, never in a panic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// No table with that name or id exists.
    #[error("no table named '{0}'")]
    UnknownTable(String),
    /// A key outside the table's key range.
    #[error("key {key} is outside table '{table}' (keys 0..{keys})")]
    UnknownKey {
        /// Table name.
        table: String,
        /// The offending key.
        key: u64,
        /// Number of keys in the table.
        keys: u64,
    },
    /// A value buffer whose length does not match the keys and the table's value length.
    #[error("{what}: expected {expected} values, got {got}")]
    WrongLength {
        /// Which argument.
        what: &'static str,
        /// Number of f32 values required.
        expected: usize,
        /// Number of f32 values given.
        got: usize,
    },
    /// A node the operation depended on left or failed.
    #[error("node {node} is lost ({reason})")]
    PeerLost {
        /// The lost node.
        node: usize,
        /// What the transport observed.
        reason: String,
    },
    /// The key's owner failed; its value is gone.
    #[error("key {key} of table '{table}' was held by a lost node")]
    KeyLost {
        /// Table name.
        table: String,
        /// The key.
        key: u64,
    },
    /// An operation did not complete within the configured timeout.
    #[error("{what} did not complete within {millis} ms{}", no_answer_from(.nodes))]
    Timeout {
        /// What timed out.
        what: &'static str,
        /// The timeout.
        millis: u64,
        /// The nodes that did not answer in time (empty when not known).
        nodes: Vec<usize>,
    },
    /// A one-sided read never caught the slot between two writes: its writer is too busy for
    /// lock-free reads; read it through the owner (a pull) instead.
    #[error("the slot changed during each of {attempts} one-sided reads")]
    Contended {
        /// Copies attempted.
        attempts: u32,
    },
    /// The configuration is invalid or inconsistent between nodes.
    #[error("configuration error: {0}")]
    Config(String),
    /// Starting the cluster or talking to the transport failed.
    #[error("transport error: {0}")]
    Transport(String),
    /// Allocating or registering parameter memory failed.
    #[error("memory error: {0}")]
    Memory(String),
    /// A peer sent a message that breaks the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The node is shutting down or already shut down.
    #[error("the node is shut down")]
    ShutDown,
    /// A sampling call was given a bad distribution, scheme or handle, or could not draw.
    #[error("sampling: {0}")]
    Sampling(String),
    /// An intent was declared with a window that ends before it starts.
    #[error("intent: {0}")]
    Intent(String),
    /// A checkpoint could not be written, or a restore found it incomplete, damaged or not
    /// matching the configuration (the message names the file or setting).
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A dynamic table's home node has handed out every slot key of its share: the ids it is
    /// the home of and does not know yet cannot be created.
    #[error("table '{table}' is full at node {node}: its {capacity} keys are taken (a larger TableSpec::dynamic capacity holds more ids)")]
    TableFull {
        /// Table name.
        table: String,
        /// The home node whose share is used up.
        node: usize,
        /// Keys per node.
        capacity: u64,
    },
    /// `finalize` was called while worker handles were still alive.
    #[error("{0} worker handle(s) are still alive; drop them before finalize")]
    WorkersAlive(usize),
}

/// " (no answer from node 2)", " (no answer from nodes 1, 3)", or nothing.
fn no_answer_from(nodes: &[usize]) -> String {
    match nodes {
        [] => String::new(),
        [one] => format!(" (no answer from node {one})"),
        many => format!(" (no answer from nodes {})", many.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

impl From<ferry_tcp::TransportError> for Error {
    fn from(e: ferry_tcp::TransportError) -> Self {
        Error::Transport(e.to_string())
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
