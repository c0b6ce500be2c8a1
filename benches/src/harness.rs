//! What the replica benchmarks share: quick mode, criterion timings, one
//! runtime, controller operations under a bound, and a caught panic's
//! message.

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::BenchmarkGroup;
use lockstep_controller::ControllerError;
use tokio::runtime::Runtime;

/// Quick mode: `$LOCKSTEP_BENCH_QUICK` set (and not `0`), or `--quick` on
/// the command line.
pub fn quick() -> bool {
    std::env::var("LOCKSTEP_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0")
        || std::env::args().any(|a| a == "--quick")
}

/// Sets `g`'s timing: `quick` samples after 0.3 s of warm-up and `quick_ms`
/// of measurement in quick mode, else 20 samples after 1 s and 3 s.
pub fn timings(g: &mut BenchmarkGroup<'_, WallTime>, quick_samples: usize, quick_ms: u64) {
    if quick() {
        g.sample_size(quick_samples)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(quick_ms))
            .nresamples(2_000);
    } else {
        g.sample_size(20)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
    }
}

/// A runtime with one worker thread, for the controller.
pub fn rt() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Runs one controller operation within `bound`; panics naming `what` if
/// it fails or takes longer (the benches catch the panic and skip).
pub fn op<T>(
    rt: &Runtime,
    what: &str,
    bound: Duration,
    fut: impl std::future::Future<Output = Result<T, ControllerError>>,
) -> T {
    match rt.block_on(tokio::time::timeout(bound, fut)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("{what}: {e}"),
        Err(_) => panic!("{what}: no answer within {bound:?}"),
    }
}

/// The message of a caught panic.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

/// A replica shape `PxW` from the environment variable `var`, or `default`.
pub fn env_shape(var: &str, default: (usize, u32)) -> (usize, u32) {
    match std::env::var(var) {
        Ok(s) => s
            .split_once('x')
            .and_then(|(p, w)| Some((p.parse().ok()?, w.parse().ok()?)))
            .unwrap_or_else(|| panic!("{var}={s}: expected PxW, e.g. 4x2")),
        Err(_) => default,
    }
}
