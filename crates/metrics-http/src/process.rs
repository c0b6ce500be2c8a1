//! The standard `process_*` series of a Prometheus client (the names and
//! units every dashboard expects, unprefixed): CPU seconds, resident and
//! virtual memory, open and maximum descriptors, threads and the start
//! time, read from `/proc/self` at each scrape. Where `/proc` cannot be
//! read (not Linux), a series is left out rather than reported as 0.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

/// Registers the process's series in `registry` (give it the root
/// registry: the names carry no prefix, as Prometheus's own clients).
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(ProcessCollector));
}

/// What `/proc/self` says about this process, read once per scrape.
#[derive(Debug, Default, PartialEq)]
pub struct Sample {
    /// User plus system CPU time, in seconds.
    pub cpu_seconds: Option<f64>,
    /// Resident set size, in bytes.
    pub resident_bytes: Option<u64>,
    /// Virtual memory size, in bytes.
    pub virtual_bytes: Option<u64>,
    /// Threads.
    pub threads: Option<u64>,
    /// Start time since the Unix epoch, in seconds.
    pub start_time_seconds: Option<f64>,
    /// Open file descriptors.
    pub open_fds: Option<u64>,
    /// The soft limit on open file descriptors.
    pub max_fds: Option<u64>,
}

impl Sample {
    /// Reads this process's figures.
    pub fn read() -> Sample {
        let ticks = USER_HZ;
        let mut s = Sample::default();
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
            if let Some(f) = stat_fields(&stat) {
                let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
                // Fields after the command, numbered as proc(5) from 3.
                let at = |n: usize| num(n - 3);
                if let (Some(u), Some(k)) = (at(14), at(15)) {
                    s.cpu_seconds = Some((u + k) as f64 / ticks);
                }
                s.threads = at(20);
                s.virtual_bytes = at(23);
                if let (Some(start), Some(boot)) = (at(22), boot_time()) {
                    s.start_time_seconds = Some(boot as f64 + start as f64 / ticks);
                }
            }
        }
        s.resident_bytes = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|st| status_bytes(&st, "VmRSS"));
        s.open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|d| d.count() as u64);
        s.max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|l| max_open_files(&l));
        s
    }
}

/// The fields of `/proc/PID/stat` after `(comm)` (the command may hold
/// spaces and parentheses: it ends at the last `)`).
fn stat_fields(stat: &str) -> Option<Vec<&str>> {
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().collect())
}

/// The soft limit of `Max open files` in `/proc/PID/limits`.
fn max_open_files(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The boot time, seconds since the epoch (`btime` in `/proc/stat`).
fn boot_time() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// Clock ticks per second in `/proc` (`USER_HZ`: 100 in Linux's ABI on
/// every architecture it still supports, whatever the kernel's own HZ).
const USER_HZ: f64 = 100.0;

/// The value in kB of `key` in `/proc/PID/status`, in bytes.
fn status_bytes(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix(key))?;
    let kb: u64 = line
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// Encodes a [`Sample`] at each scrape.
#[derive(Debug)]
struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = Sample::read();
        if let Some(v) = s.cpu_seconds {
            let m = ConstCounter::new(v);
            m.encode(encoder.encode_descriptor(
                "process_cpu",
                "Total user and system CPU time spent",
                Some(&Unit::Seconds),
                m.metric_type(),
            )?)?;
        }
        let gauges: [(&str, &str, Option<Unit>, Option<f64>); 6] = [
            (
                "process_resident_memory",
                "Resident memory size",
                Some(Unit::Bytes),
                s.resident_bytes.map(|v| v as f64),
            ),
            (
                "process_virtual_memory",
                "Virtual memory size",
                Some(Unit::Bytes),
                s.virtual_bytes.map(|v| v as f64),
            ),
            (
                "process_start_time",
                "Start time of the process since the Unix epoch",
                Some(Unit::Seconds),
                s.start_time_seconds,
            ),
            (
                "process_open_fds",
                "Open file descriptors",
                None,
                s.open_fds.map(|v| v as f64),
            ),
            (
                "process_max_fds",
                "The soft limit on open file descriptors",
                None,
                s.max_fds.map(|v| v as f64),
            ),
            (
                "process_threads",
                "Threads of the process",
                None,
                s.threads.map(|v| v as f64),
            ),
        ];
        for (name, help, unit, value) in gauges {
            if let Some(v) = value {
                let m = ConstGauge::new(v);
                m.encode(encoder.encode_descriptor(name, help, unit.as_ref(), m.metric_type())?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_with_spaces_and_parentheses_does_not_shift_the_fields() {
        let stat =
            "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1000 123456 789";
        let f = stat_fields(stat).unwrap();
        assert_eq!(f[0], "S");
        // utime and stime are fields 14 and 15 of proc(5).
        assert_eq!((f[14 - 3], f[15 - 3]), ("250", "50"));
        assert_eq!(f[24 - 3], "789");
    }

    #[test]
    fn resident_memory_is_read_in_bytes() {
        let status = "Name:\tx\nVmRSS:\t   5120 kB\nThreads:\t3\n";
        assert_eq!(status_bytes(status, "VmRSS"), Some(5120 * 1024));
        assert_eq!(status_bytes(status, "VmSwap"), None);
    }

    #[test]
    fn the_soft_limit_of_open_files_is_read() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1024                 524288               files\n";
        assert_eq!(max_open_files(limits), Some(1024));
    }

    #[test]
    fn this_process_is_sampled_with_its_own_figures() {
        let s = Sample::read();
        assert!(s.cpu_seconds.is_some_and(|c| c >= 0.0), "{s:?}");
        assert!(s.resident_bytes.is_some_and(|r| r > 1 << 20), "{s:?}");
        assert!(s.threads.is_some_and(|t| t >= 1), "{s:?}");
        let open = s.open_fds.expect("descriptors counted");
        assert!(open >= 1 && s.max_fds.is_some_and(|m| m >= open), "{s:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start = s.start_time_seconds.expect("start time");
        assert!(
            start <= now + 1.0 && start > now - 3600.0,
            "{start} vs {now}"
        );
    }

    #[test]
    fn the_series_have_the_standard_names() {
        let mut r = Registry::default();
        register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_virtual_memory_bytes ",
            "process_start_time_seconds ",
            "process_open_fds ",
            "process_max_fds ",
            "process_threads ",
        ] {
            assert!(out.contains(name), "{name} missing from:\n{out}");
        }
    }
}
