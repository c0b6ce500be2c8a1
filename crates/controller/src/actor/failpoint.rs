//! The partial-broadcast failpoint (`failpoints` feature only):
//! `controller_partial_broadcast=return(KIND:N)` makes the controller crash
//! while broadcasting a command of kind `KIND`, after it has reached the
//! first `N` processes (`KIND:lastN`: the last `N`, so process 0 is missed).
//! The distribution fault suite uses it to reproduce partial deliveries.
//! Without the feature, [`partial_broadcast`] always answers `None`.
//!
//! Delivery sees it through one hook, [`CrashHook`]: armed for each command
//! as it is numbered, taken by whatever writes the copies (or, in a log
//! session's first batch, remembered with the command's position).

use lockstep_protocol::Command;

use super::Actor;

/// Which processes a broadcast reaches before the controller crashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))] // built by the failpoint only
pub(crate) enum Reach {
    /// The first N processes.
    First(usize),
    /// The last N processes (process 0 last to be reached).
    Last(usize),
}

impl Reach {
    /// Whether process `i` of `n` gets its copy.
    pub(crate) fn reaches(self, i: usize, n: usize) -> bool {
        match self {
            Reach::First(k) => i < k,
            Reach::Last(k) => i + k >= n,
        }
    }

    /// How many of `n` processes get their copy.
    pub(crate) fn count(self, n: usize) -> usize {
        (0..n).filter(|&i| self.reaches(i, n)).count()
    }
}

/// The failpoint's hold on the command being delivered: armed as a
/// command is numbered (`arm`), taken where its copies are written
/// (`take`). Disarmed unless the `failpoints` feature is on and the
/// failpoint names the command's kind.
#[derive(Debug, Default)]
pub(crate) struct CrashHook {
    armed: Option<Reach>,
}

impl CrashHook {
    /// Arms the hook for a command of `kind` (see [`partial_broadcast`]).
    pub(crate) fn arm(&mut self, kind: &str) {
        self.armed = partial_broadcast(kind);
    }

    /// Where the armed command crashes, if it is armed.
    pub(crate) fn peek(&self) -> Option<Reach> {
        self.armed
    }

    /// Where the armed command crashes, disarming the hook.
    pub(crate) fn take(&mut self) -> Option<Reach> {
        self.armed.take()
    }
}

/// Which processes a broadcast of `kind` reaches before the controller
/// crashes, if the failpoint `controller_partial_broadcast` says so: value
/// `KIND:N` for the first N processes, `KIND:lastN` for the last N.
fn partial_broadcast(kind: &str) -> Option<Reach> {
    let _ = kind;
    fail::fail_point!("controller_partial_broadcast", |arg: Option<String>| {
        let arg = arg?;
        let (k, n) = arg.split_once(':')?;
        if k != kind {
            return None;
        }
        match n.strip_prefix("last") {
            Some(n) => n.parse().ok().map(Reach::Last),
            None => n.parse().ok().map(Reach::First),
        }
    });
    None
}

impl Actor {
    /// Sends `cmd` to the processes the failpoint lets it reach.
    pub(crate) fn write_reached(&mut self, cmd: &Command, reach: Reach) {
        let n = self.conns.len();
        for i in 0..n {
            if reach.reaches(i, n) {
                self.write(i, cmd.clone());
            }
        }
    }

    /// The failpoint `controller_partial_broadcast` (value `KIND:N`, e.g.
    /// `create-dataflow:1`): the controller crashes while broadcasting a
    /// command of that kind, after it reached the first N processes.
    pub(crate) fn crash(&mut self) {
        tracing::error!("failpoint: controller crashes in the middle of a broadcast");
        self.stop();
    }
}
