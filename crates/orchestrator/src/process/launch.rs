//! One process of a service: where it runs (placement on a simulated host),
//! its ports and command line, its explicit environment and private log,
//! starting it in its own process group, and killing it (only if it is
//! still ours).

use super::*;

impl Inner {
    /// Starts process `i` of `record`; returns its PID and start time.
    pub(super) fn spawn(&self, record: &ServiceRecord, i: usize) -> std::io::Result<(u32, u64)> {
        // Named before it runs: a process spawned and never recorded is
        // still told ours by its program (see `strays`).
        note_program(&self.config.state_dir.join("services"), &record.program)?;
        let log_path = self.log_path(&record.name, i);
        if std::fs::metadata(&log_path).is_ok_and(|m| m.len() > self.config.log_rotate_bytes) {
            std::fs::rename(&log_path, log_path.with_extension("log.1"))?;
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_path)?;
        let mut cmd = match &record.processes[i].namespace {
            // `ip netns exec` enters the namespace, mounts
            // /etc/netns/NS/hosts over /etc/hosts and execs: the PID is the
            // program's.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&record.program);
                c
            }
            None => Command::new(&record.program),
        };
        cmd.args(&record.processes[i].argv)
            // An explicit environment: what the service's spec gives and the
            // few variables a process needs, nothing inherited from the
            // controller (its API token, its store URL, its failpoints).
            .env_clear()
            .envs(
                INHERITED_ENV
                    .iter()
                    .filter_map(|k| std::env::var_os(k).map(|v| (*k, v))),
            )
            .envs(&record.env)
            .env("LOCKSTEP_SERVICE", &record.name)
            .env("LOCKSTEP_PROCESS", i.to_string())
            .env(GENERATION_ENV, record.generation.to_string())
            .env(
                ORCHESTRATOR_ENV,
                std::path::absolute(&self.config.state_dir)
                    .unwrap_or_else(|_| self.config.state_dir.clone()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        // After the explicit environment: the listeners it inherits (not in
        // a simulated host's namespace, where it binds its own address).
        let inherited = match record.processes[i].namespace {
            None if listens_on_loopback(&record.processes[i].argv) => {
                self.listener_fds(&record.name, i, &record.processes[i].ports)
            }
            _ => {
                // It binds its own ports (elsewhere than loopback, or in its
                // namespace): held here, they would keep it from it.
                self.release_process_ports(&record.name, i);
                None
            }
        };
        if let Some(fds) = inherited {
            let spec: Vec<String> = fds.iter().map(|(n, fd)| format!("{n}={fd}")).collect();
            cmd.env(LISTEN_FDS_ENV, spec.join(","));
            let raw: Vec<std::os::fd::RawFd> = fds.iter().map(|(_, fd)| *fd).collect();
            // SAFETY: between fork and exec only `fcntl` runs, which is
            // async-signal-safe; it clears close-on-exec in the child's
            // descriptor table alone, so the child inherits these listeners
            // at the same numbers and no other child does.
            #[allow(unsafe_code)]
            unsafe {
                cmd.pre_exec(move || {
                    for fd in &raw {
                        if nix::libc::fcntl(*fd, nix::libc::F_SETFD, 0) == -1 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn()?;
        let pid = child.id();
        // If it died at once (a zombie we can read no more of), 0 is a start
        // time that never matches, so it counts as dead.
        let start = match proc_start_time_now(pid) {
            Ok(start) => start.unwrap_or_default(),
            // `/proc` cannot be read now (EMFILE): recorded without its start
            // time, the process would count as dead to every other
            // orchestrator, which could neither kill it nor tell it from a
            // reused PID. Not started, then: the caller tries again later.
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e);
            }
        };
        self.children.lock().expect("poisoned").insert(pid, child);
        tracing::info!(service = %record.name, process = i, pid, "started");
        Ok((pid, start))
    }

    /// Kills the process group of a recorded process, if it is still ours
    /// (one that cannot be told ours now is not signalled: a caller that
    /// needs it gone checks [`proc_liveness`] afterwards).
    pub(super) fn kill(&self, service: &str, i: usize, pid: u32, start_time: u64) {
        // Signal only a leader that is alive and ours: a PID whose process
        // exited may already belong to someone else.
        let ours = match self.children.lock().expect("poisoned").get_mut(&pid) {
            Some(child) => matches!(child.try_wait(), Ok(None)),
            None => proc_alive(pid, start_time),
        };
        if ours {
            let pg = nix::unistd::Pid::from_raw(pid as i32);
            if let Err(e) = nix::sys::signal::killpg(pg, nix::sys::signal::Signal::SIGKILL) {
                if e != nix::errno::Errno::ESRCH {
                    tracing::warn!(service, process = i, pid, "killpg failed: {e}");
                }
            }
        }
        if let Some(mut child) = self.children.lock().expect("poisoned").remove(&pid) {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Wait (bounded) until it is gone, so callers see it dead.
        let deadline = Instant::now() + Duration::from_secs(5);
        while proc_alive(pid, start_time) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// [`Inner::kill`], then whether the process is gone. Error: why it may
    /// not be: still alive 5 s after SIGKILL, or `/proc` cannot tell now
    /// (then it may not even have been signalled). Not knowing is not
    /// "gone" (R1): no new process may start beside an old one.
    pub(super) fn kill_confirmed(
        &self,
        service: &str,
        i: usize,
        pid: u32,
        start_time: u64,
    ) -> Result<(), String> {
        self.kill(service, i, pid, start_time);
        match proc_liveness(pid, start_time) {
            Ok(false) => Ok(()),
            Ok(true) => Err("still alive 5 s after SIGKILL".to_string()),
            Err(e) => Err(format!("cannot tell whether it is gone: {e}")),
        }
    }

    /// Whether the process we recorded still runs; reaps it if it is our
    /// child. `false` also when that cannot be told now: for reports only;
    /// what acts on a dead process asks [`Inner::liveness`].
    pub(super) fn alive(&self, pid: u32, start_time: u64) -> bool {
        self.liveness(pid, start_time).unwrap_or(false)
    }

    /// Whether the process we recorded still runs, or `Err` if that cannot
    /// be told now (`/proc` unreadable, e.g. EMFILE): not knowing is not
    /// "dead" (R1). Reaps it if it is our child.
    pub(super) fn liveness(&self, pid: u32, start_time: u64) -> std::io::Result<bool> {
        let mut children = self.children.lock().expect("poisoned");
        if let Some(child) = children.get_mut(&pid) {
            // A reaped child stays in the map (its status cached) until
            // `exit_status` takes it.
            return Ok(matches!(child.try_wait(), Ok(None)));
        }
        drop(children);
        proc_liveness(pid, start_time)
    }

    pub(super) fn exit_status(&self, pid: u32) -> String {
        match self.children.lock().expect("poisoned").remove(&pid) {
            Some(mut child) => match child.try_wait() {
                Ok(Some(status)) => status.to_string(),
                _ => "exited".to_string(),
            },
            None => "exited (not our child)".to_string(),
        }
    }

    /// The log of process `i` of service `name` (`.log.1` beside it is the
    /// rotated one).
    pub(super) fn log_path(&self, name: &str, i: usize) -> PathBuf {
        self.config
            .state_dir
            .join("logs")
            .join(format!("{name}-{i}.log"))
    }

    pub(super) fn placement(&self, i: usize) -> Placement {
        match &self.hosts {
            None => Placement {
                host: HOST.to_string(),
                listen_host: HOST,
                namespace: None,
                address: None,
            },
            Some(hosts) => {
                let k = i % hosts.count();
                Placement {
                    host: hosts.namespace(k),
                    listen_host: "0.0.0.0",
                    namespace: Some(hosts.namespace(k)),
                    address: Some(hosts.control_addr(k)),
                }
            }
        }
    }
}

/// The variables a service's process inherits from the orchestrator's
/// environment; everything else it gets comes from its spec. (Not part of
/// the spec, so setting one does not replace running processes.)
pub(super) const INHERITED_ENV: [&str; 7] = [
    "PATH",
    "RUST_LOG",
    "LOCKSTEP_LOG_FORMAT",
    "RUST_BACKTRACE",
    "LANG",
    "TZ",
    "TMPDIR",
];

/// Where process `i` runs: its host as peers name it, the address it binds,
/// its namespace and its address from here.
pub(super) struct Placement {
    pub(super) host: String,
    pub(super) listen_host: &'static str,
    pub(super) namespace: Option<String>,
    pub(super) address: Option<IpAddr>,
}

/// Every process's command line for `ports` (one map per process).
pub(super) fn argv_for(
    args: &ArgsFn,
    placements: &[Placement],
    ports: &[BTreeMap<String, u16>],
) -> Vec<Vec<String>> {
    let hosts: Vec<String> = placements.iter().map(|p| p.host.clone()).collect();
    (0..ports.len())
        .map(|i| {
            args(&ServiceAssignment {
                process: i,
                scale: ports.len(),
                host: &hosts[i],
                hosts: &hosts,
                listen_host: placements[i].listen_host,
                ports,
            })
        })
        .collect()
}

/// The socket addresses of one process's named ports, at `address` (its
/// simulated host's) or on loopback.
pub(super) fn addresses(
    address: Option<IpAddr>,
    ports: &BTreeMap<String, u16>,
) -> BTreeMap<String, SocketAddr> {
    let ip = address.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    ports
        .iter()
        .map(|(n, port)| (n.clone(), SocketAddr::new(ip, *port)))
        .collect()
}

/// Whether another socket listens on `port` (so a process given it cannot
/// bind it).
pub(super) fn port_held(port: u16) -> bool {
    matches!(
        TcpListener::bind((HOST, port)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse
    )
}

/// One process's listeners, by port name.
pub(super) type Listeners = BTreeMap<String, TcpListener>;

/// Every process's ports by name, and the listeners that hold them.
pub(super) type Allocated = (Vec<BTreeMap<String, u16>>, Vec<Listeners>);

pub(super) fn allocate_ports(scale: usize, names: &[String]) -> std::io::Result<Allocated> {
    // Every listener is kept (so no two coincide, and each port stays bound
    // until the process that is given it inherits it).
    let mut held = Vec::new();
    let mut out = Vec::new();
    for _ in 0..scale {
        let mut ports = BTreeMap::new();
        let mut listeners = BTreeMap::new();
        for n in names {
            let l = TcpListener::bind((HOST, 0))?;
            ports.insert(n.clone(), l.local_addr()?.port());
            listeners.insert(n.clone(), l);
        }
        out.push(ports);
        held.push(listeners);
    }
    Ok((out, held))
}

/// Whether a process with `argv` listens where this orchestrator binds its
/// ports ([`HOST`]): unless its `--listen-host` names another address (a
/// template that serves off loopback). Only then does it inherit them.
fn listens_on_loopback(argv: &[String]) -> bool {
    let mut args = argv.iter();
    while let Some(a) = args.next() {
        let value = match a.strip_prefix("--listen-host=") {
            Some(v) => Some(v.to_string()),
            None if a == "--listen-host" => args.next().cloned(),
            None => None,
        };
        if let Some(v) = value {
            return v == HOST;
        }
    }
    true
}

/// The environment variable that tells a process which inherited
/// descriptors are its listeners: `NAME=FD,...` (port name, descriptor).
pub const LISTEN_FDS_ENV: &str = "LOCKSTEP_LISTEN_FDS";

/// The hostile campaign's negative control `released-ports`: with it set
/// (in a build with the `experiments` feature only), ports are released
/// once chosen and each process binds its own, as before they were held.
pub const RELEASE_PORTS_ENV: &str = "LOCKSTEP_EXPERIMENT_RELEASE_PORTS";

/// Whether [`RELEASE_PORTS_ENV`] is in force.
fn ports_released() -> bool {
    cfg!(feature = "experiments") && std::env::var_os(RELEASE_PORTS_ENV).is_some()
}

impl Inner {
    /// Chooses ports for `scale` processes of service `name`
    /// ([`allocate_ports`]) and holds their listeners for it.
    pub(super) fn allocate_held(
        &self,
        name: &str,
        scale: usize,
        names: &[String],
    ) -> std::io::Result<Vec<BTreeMap<String, u16>>> {
        let (ports, listeners) = allocate_ports(scale, names)?;
        if ports_released() {
            return Ok(ports);
        }
        self.held
            .lock()
            .expect("poisoned")
            .insert(name.to_string(), listeners);
        Ok(ports)
    }

    /// Whether this orchestrator holds `port` for process `i` of `name`.
    pub(super) fn holds(&self, name: &str, i: usize, port: u16) -> bool {
        self.held
            .lock()
            .expect("poisoned")
            .get(name)
            .and_then(|all| all.get(i))
            .is_some_and(|mine| {
                mine.values()
                    .any(|l| l.local_addr().is_ok_and(|a| a.port() == port))
            })
    }

    /// Forgets the listeners of process `i` of service `name` (it binds
    /// its own).
    pub(super) fn release_process_ports(&self, name: &str, i: usize) {
        if let Some(mine) = self
            .held
            .lock()
            .expect("poisoned")
            .get_mut(name)
            .and_then(|all| all.get_mut(i))
        {
            mine.clear();
        }
    }

    /// Forgets the listeners of service `name` (dropped).
    pub(super) fn release_ports(&self, name: &str) {
        self.held.lock().expect("poisoned").remove(name);
    }

    /// The descriptors of process `i`'s listeners for `ports`, by port
    /// name: the ones held, or (a service adopted from an earlier
    /// orchestrator, whose processes held them) bound now. `None` if one
    /// cannot be bound (another socket has it): the process then binds
    /// its ports itself, and fails, and is re-ported.
    pub(super) fn listener_fds(
        &self,
        name: &str,
        i: usize,
        ports: &BTreeMap<String, u16>,
    ) -> Option<Vec<(String, std::os::fd::RawFd)>> {
        use std::os::fd::AsRawFd;
        if ports_released() {
            return None;
        }
        let mut held = self.held.lock().expect("poisoned");
        let all = held.entry(name.to_string()).or_default();
        if all.len() <= i {
            all.resize_with(i + 1, BTreeMap::new);
        }
        let same = |mine: &BTreeMap<String, TcpListener>| {
            mine.len() == ports.len()
                && ports.iter().all(|(n, p)| {
                    mine.get(n)
                        .and_then(|l| l.local_addr().ok())
                        .is_some_and(|a| a.port() == *p)
                })
        };
        if !same(&all[i]) {
            let mut bound = BTreeMap::new();
            for (n, p) in ports {
                match TcpListener::bind((HOST, *p)) {
                    Ok(l) => {
                        bound.insert(n.clone(), l);
                    }
                    Err(e) => {
                        tracing::warn!(
                            service = name,
                            process = i,
                            port = p,
                            "cannot hold the port for the process ({e}); it binds it itself"
                        );
                        all[i] = BTreeMap::new();
                        return None;
                    }
                }
            }
            all[i] = bound;
        }
        Some(
            all[i]
                .iter()
                .map(|(n, l)| (n.clone(), l.as_raw_fd()))
                .collect(),
        )
    }
}

/// Finds an executable: a path with a slash is checked as is, a bare name is
/// looked up in `PATH`. Returns the absolute path.
pub(super) fn resolve_program(program: &Path) -> Option<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .filter(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            .map(|_| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf()))
    };
    if program.components().count() > 1 || program.is_absolute() {
        return executable(program);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).find_map(|dir| executable(&dir.join(program)))
    })
}
