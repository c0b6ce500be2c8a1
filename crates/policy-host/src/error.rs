//! What can go wrong loading or calling a policy.

use std::path::PathBuf;

use lockstep_policy::PolicyError;

use crate::PolicyKind;

/// Why a policy file could not be loaded. Loading happens at start-up, where
/// the caller either refuses to start or falls back to a shipped default.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// There is no file at the path.
    #[error("policy file {path} does not exist (build the shipped policies with `cargo xtask build-policies`)")]
    Missing {
        /// The path given.
        path: PathBuf,
    },
    /// The file exists but could not be read.
    #[error("cannot read policy file {path}: {source}")]
    Read {
        /// The path given.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not WebAssembly at all (no `\0asm` header).
    #[error("{path} is not a WebAssembly file (it does not start with the \\0asm header)")]
    NotWasm {
        /// The path given.
        path: PathBuf,
    },
    /// The file is a core WebAssembly module, not a component.
    #[error(
        "{path} is a core WebAssembly module, not a component: build it with \
         `cargo xtask build-policies` (it links with wasm-component-ld); a plain \
         `cargo build --target wasm32-unknown-unknown` writes a core module"
    )]
    CoreModule {
        /// The path given.
        path: PathBuf,
    },
    /// wasmtime refused to compile the component (malformed, or uses a
    /// feature this host does not enable).
    #[error("cannot compile policy {path}: {reason}")]
    Compile {
        /// The path given.
        path: PathBuf,
        /// wasmtime's message.
        reason: String,
    },
    /// The component does not implement the expected world of
    /// `lockstep:policy@0.1.0`, or needs imports this host does not give.
    #[error(
        "policy {path} does not implement the {expected} world of lockstep:policy@{}: {reason}",
        crate::WIT_VERSION
    )]
    WrongWorld {
        /// The path given.
        path: PathBuf,
        /// The world the caller asked for.
        expected: PolicyKind,
        /// What is missing or extra, by name.
        reason: String,
    },
    /// The component implements neither world (only from [`crate::detect_kind`]).
    #[error(
        "policy {path} implements no lockstep:policy@{} world: {reason}",
        crate::WIT_VERSION
    )]
    UnknownKind {
        /// The path given.
        path: PathBuf,
        /// What it exports instead.
        reason: String,
    },
    /// The component could not be instantiated (e.g. its initial memory is
    /// above the memory limit, or its start-up ran out of fuel).
    #[error("cannot instantiate policy {path}: {source}")]
    Instantiate {
        /// The path given.
        path: PathBuf,
        /// What went wrong.
        source: CallError,
    },
}

/// Why one call into a policy gave no usable answer. The policy stays
/// loaded: the next call runs in a fresh instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The call used up its fuel: the policy loops or works too hard.
    #[error("policy {policy} ran out of fuel ({fuel} units per call): it loops or works too hard")]
    OutOfFuel {
        /// The policy's name.
        policy: String,
        /// The fuel it had.
        fuel: u64,
    },
    /// The policy tried to grow its memory past the limit.
    #[error("policy {policy} hit the memory limit: it asked for {requested} bytes, the limit is {limit}")]
    MemoryLimit {
        /// The policy's name.
        policy: String,
        /// The limit in bytes.
        limit: usize,
        /// The size it asked for, in bytes.
        requested: usize,
    },
    /// The policy trapped, e.g. it panicked.
    #[error("policy {policy} trapped ({trap}){}", message.as_deref().map(|m| format!(": {m}")).unwrap_or_default())]
    Trap {
        /// The policy's name.
        policy: String,
        /// The trap, as wasmtime describes it.
        trap: String,
        /// What the policy logged during the call (its panic message, with
        /// the SDK's panic hook), if anything.
        message: Option<String>,
    },
    /// The call failed for another reason than a trap.
    #[error("policy {policy} failed: {reason}")]
    Failed {
        /// The policy's name.
        policy: String,
        /// What went wrong.
        reason: String,
    },
    /// The policy answered something that makes no sense for the question.
    #[error("policy {policy} answered nonsense: {reason}")]
    Nonsense {
        /// The policy's name.
        policy: String,
        /// What was wrong with the answer.
        reason: String,
    },
}

impl From<CallError> for PolicyError {
    fn from(e: CallError) -> Self {
        match e {
            CallError::Nonsense { policy, reason } => PolicyError::Nonsense { policy, reason },
            other => {
                let policy = match &other {
                    CallError::OutOfFuel { policy, .. }
                    | CallError::MemoryLimit { policy, .. }
                    | CallError::Trap { policy, .. }
                    | CallError::Failed { policy, .. }
                    | CallError::Nonsense { policy, .. } => policy.clone(),
                };
                // The reason without the "policy NAME " prefix, which
                // PolicyError's own message repeats.
                let text = other.to_string();
                let reason = text
                    .strip_prefix(&format!("policy {policy} "))
                    .unwrap_or(&text)
                    .to_string();
                PolicyError::Failed { policy, reason }
            }
        }
    }
}
