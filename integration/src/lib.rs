//! The harness for tests that need a real node: the `nodedns` binary run as a black box, a real
//! Knot (`knotd`) standing in for CoreDNS, a scripted upstream for faults Knot cannot produce,
//! real clients (`dig`, `kdig`, glibc via `getent`), and simulated nodes built from network
//! namespaces with real kernel rules.
//!
//! Nothing here is a mock of nodedns: tests talk to the agent only over the network, like a pod.
//!
//! Map:
//! - [`Agent`]: `nodedns run` on free loopback ports, started once it answers, SIGTERM on drop.
//! - [`knot::Knot`]: the authoritative upstream with a `cluster.local` zone and query counters.
//! - [`scripted::Scripted`]: an upstream whose every answer a test programs (faults, delays) and
//!   which counts queries and connections.
//! - [`dot::Unbound`]: a real DNS-over-TLS server (unbound) in front of a test's Knot, with
//!   certificates made at test time ([`dot::Pki`]).
//! - [`client`]: raw UDP/TCP queries decoded with hickory-proto (the oracle), pipelining, and
//!   `dig`/`kdig` runs with their output parsed.
//! - [`Process`], [`TempDir`], [`free_port`]: the plumbing the above share.
//!
//! Every helper picks its own ports and directories, so tests run in parallel.

pub mod client;
pub mod dot;
pub mod knot;
pub mod netns;
pub mod node;
pub mod scripted;

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The `nodedns` binary under test: `$NODEDNS_BIN`, or the one Cargo built next to this test
/// executable (`target/<profile>/nodedns`). `scripts/test` builds the release binary and names it
/// here.
pub fn nodedns_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("NODEDNS_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash> → target/<profile>/nodedns
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("nodedns"))
        .expect("target directory layout");
    assert!(
        bin.exists(),
        "{} not found: build it first (`cargo build --bin nodedns`) or set NODEDNS_BIN",
        bin.display()
    );
    bin
}

/// Whether `program` can be found on `PATH` (or is an existing path). Tests that need a tool
/// the machine lacks print why and return early instead of failing.
pub fn have(program: &str) -> bool {
    if program.contains('/') {
        return Path::new(program).exists();
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .any(|dir| dir.join(program).is_file())
}

/// A loopback port free for both UDP and TCP at the time of the call, and never handed out
/// before in this process.
///
/// The probe sockets are closed on return, so the kernel may give the same port to the next
/// probe: two calls in a row (a listen port and a dead upstream's port, say) would then name
/// the same port. Remembering what was handed out rules that out within the test binary.
/// Between this call and the caller's bind another process may still take the port; callers
/// that start a server on it retry with a new port when the bind fails.
pub fn free_port() -> std::io::Result<u16> {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..256 {
        let tcp = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let port = tcp.local_addr()?.port();
        if handed_out.contains(&port) {
            continue;
        }
        if UdpSocket::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            handed_out.insert(port);
            return Ok(port);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        "no port free for both UDP and TCP",
    ))
}

/// [`free_port`] on the loopback address, for a listener of the agent (admin, metrics).
pub fn free_loopback() -> SocketAddr {
    SocketAddr::from((
        Ipv4Addr::LOCALHOST,
        free_port().expect("a free loopback port"),
    ))
}

/// A directory removed (with its contents) on drop. Unique per process and call, so parallel
/// tests never share one.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(prefix: &str) -> std::io::Result<TempDir> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path =
            std::env::temp_dir().join(format!("{prefix}-{}-{n}-{nanos:x}", std::process::id()));
        std::fs::create_dir_all(&path)?;
        Ok(TempDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A child process whose stdout and stderr are collected, and which is stopped by PID on drop
/// (SIGTERM, then SIGKILL after a grace period). If the test is failing (panicking) when it is
/// dropped, its output is printed, so the test log shows what the process said.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
    output: Arc<Mutex<String>>,
    readers: Vec<JoinHandle<()>>,
    stopped: Option<ExitStatus>,
}

impl Process {
    /// Spawns `command` with stdin closed and stdout/stderr captured.
    pub fn spawn(name: &str, mut command: Command) -> std::io::Result<Process> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn()?;
        let output = Arc::new(Mutex::new(String::new()));
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            readers.push(collect(out, Arc::clone(&output)));
        }
        if let Some(err) = child.stderr.take() {
            readers.push(collect(err, Arc::clone(&output)));
        }
        Ok(Process {
            name: name.to_owned(),
            child,
            output,
            readers,
            stopped: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the process wrote to stdout and stderr so far.
    pub fn output(&self) -> String {
        self.output.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Waits until the output contains `needle`; fails after `limit`, or when the process
    /// exited without writing it, with the output.
    pub fn wait_output(&mut self, needle: &str, limit: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let output = self.output();
            if output.contains(needle) {
                return Ok(());
            }
            if let Some(status) = self.exited() {
                bail!(
                    "{} exited ({status}) without {needle:?}:\n{output}",
                    self.name
                );
            }
            if Instant::now() >= deadline {
                bail!("{}: no {needle:?} within {limit:?}:\n{output}", self.name);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The exit status if the process has exited (without waiting for it to exit). Once it
    /// has, what it wrote last is collected first (up to 2 s for the readers to reach the end
    /// of its pipes), so [`Process::output`] holds everything it said.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.stopped.is_some() {
            return self.stopped;
        }
        let status = self.child.try_wait().ok().flatten()?;
        let drained = Instant::now() + Duration::from_secs(2);
        while !self.readers.iter().all(JoinHandle::is_finished) && Instant::now() < drained {
            std::thread::sleep(Duration::from_millis(5));
        }
        self.stopped = Some(status);
        Some(status)
    }

    /// Sends `signal` to the process (by PID). Does nothing once it has been reaped.
    pub fn signal(&mut self, signal: Signal) -> anyhow::Result<()> {
        if self.exited().is_some() {
            return Ok(());
        }
        let pid = i32::try_from(self.child.id()).context("pid out of range")?;
        kill(Pid::from_raw(pid), signal).with_context(|| format!("kill {signal} {}", self.name))?;
        Ok(())
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, up to 5 s for a clean exit, then SIGKILL. Returns the exit status.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if let Some(status) = self.stopped {
            return Some(status);
        }
        let _ = self.signal(Signal::SIGTERM);
        let status = match self.wait_timeout(Duration::from_secs(5)) {
            Some(status) => Some(status),
            None => {
                let _ = self.child.kill();
                self.child.wait().ok()
            }
        };
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        self.stopped = status;
        status
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let status = self.stop();
        if std::thread::panicking() {
            eprintln!(
                "----- {} (pid {}, {:?}) output -----\n{}----- end of {} output -----",
                self.name,
                self.child.id(),
                status,
                self.output(),
                self.name
            );
        }
    }
}

fn collect(stream: impl Read + Send + 'static, into: Arc<Mutex<String>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if let Ok(mut all) = into.lock() {
                        all.push_str(&line);
                    }
                }
            }
        }
    })
}

/// Polls `ready` every 20 ms until it returns `Ok(true)`, `deadline` passes (an error naming
/// `what`), `ready` fails, or `alive` reports the process gone.
pub(crate) fn wait_until(
    what: &str,
    limit: Duration,
    mut alive: impl FnMut() -> anyhow::Result<()>,
    mut ready: impl FnMut() -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        alive()?;
        if ready() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("{what} not ready after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET path` over HTTP/1.0 on loopback or another address of this namespace: (status, body).
pub fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET {path} from {addr}: no HTTP head in {response:?}"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("GET {path} from {addr}: no status in {head:?}"))?;
    Ok((status, body.to_owned()))
}

/// Writes `corefile` into `dir` and starts `nodedns run --conf` on it, without host setup and
/// with a resolv.conf naming a documentation address; not waited for. Returns the agent and the
/// Corefile's path.
pub fn spawn_with_corefile(dir: &TempDir, corefile: &str) -> (Process, PathBuf) {
    spawn_with_corefile_and(dir, corefile, &[])
}

/// [`spawn_with_corefile`], with more `run` flags.
pub fn spawn_with_corefile_and(
    dir: &TempDir,
    corefile: &str,
    flags: &[&str],
) -> (Process, PathBuf) {
    let path = dir.path().join("Corefile");
    std::fs::write(&path, corefile).expect("write the Corefile");
    let resolv_conf = dir.path().join("resolv.conf");
    std::fs::write(&resolv_conf, "nameserver 192.0.2.53\n").expect("write resolv.conf");
    let mut command = Command::new(nodedns_bin());
    command
        .arg("run")
        .arg("--conf")
        .arg(&path)
        .arg("--resolv-conf")
        .arg(&resolv_conf)
        .arg("--no-setup")
        .args(flags)
        .env_remove("NODEDNS_HANDOFF_DIR");
    let agent = Process::spawn("nodedns", command).expect("spawn nodedns");
    (agent, path)
}

/// The name the harness queries to learn that an agent serves (a name no test uses, so its
/// cache entry and upstream query never disturb a test's counts for its own names).
pub const PROBE_NAME: &str = "nodedns-probe.cluster.local.";

/// `nodedns run` under test, listening on a free loopback port (UDP and TCP), forwarding to the
/// given upstreams. SIGTERM (by PID) on drop; its output is printed if the test is failing.
#[derive(Debug)]
pub struct Agent {
    process: Process,
    addr: SocketAddr,
    /// The Corefile's directory, for an agent started [`Agent::with_corefile`].
    _dir: Option<TempDir>,
}

impl Agent {
    /// Starts `nodedns run --listen 127.0.0.1:<free> --upstream <u>...` and returns once it
    /// answers a query for [`PROBE_NAME`] over UDP and accepts TCP connections.
    pub fn start(upstreams: &[SocketAddr]) -> anyhow::Result<Agent> {
        Agent::start_with(upstreams, &[] as &[&str])
    }

    /// [`Agent::start`] with extra command-line arguments appended after `run`'s own.
    pub fn start_with<S: AsRef<OsStr>>(
        upstreams: &[SocketAddr],
        extra: &[S],
    ) -> anyhow::Result<Agent> {
        let bin = nodedns_bin();
        Agent::on_a_free_port(|addr| {
            let mut command = Command::new(&bin);
            command
                .arg("run")
                .arg("--listen")
                .arg(addr.to_string())
                .env("RUST_BACKTRACE", "1");
            for upstream in upstreams {
                command.arg("--upstream").arg(upstream.to_string());
            }
            command.args(extra);
            let process = Process::spawn("nodedns", command)
                .with_context(|| format!("spawn {}", bin.display()))?;
            Ok((process, None))
        })
    }

    /// Starts `nodedns run --conf` ([`spawn_with_corefile`]) on a Corefile of one block for `.`
    /// on 127.0.0.1:<free>, holding `body` (its directives, `forward` included); returns once it
    /// answers as [`Agent::start`] does.
    pub fn with_corefile(body: &str) -> anyhow::Result<Agent> {
        Agent::on_a_free_port(|addr| {
            let dir = TempDir::new("nodedns-corefile")?;
            let corefile = format!(".:{} {{\n    bind 127.0.0.1\n{body}\n}}\n", addr.port());
            let (process, _) = spawn_with_corefile(&dir, &corefile);
            Ok((process, Some(dir)))
        })
    }

    /// Starts the agent `spawn` makes for a free loopback port, and waits until it answers.
    /// The port can be taken between choosing and binding it: tries a few.
    fn on_a_free_port(
        mut spawn: impl FnMut(SocketAddr) -> anyhow::Result<(Process, Option<TempDir>)>,
    ) -> anyhow::Result<Agent> {
        let mut last = None;
        for _ in 0..3 {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
            let (process, dir) = spawn(addr)?;
            let mut agent = Agent {
                process,
                addr,
                _dir: dir,
            };
            match agent.wait_ready(Duration::from_secs(15)) {
                Ok(()) => return Ok(agent),
                Err(error) => {
                    let output = agent.process.output();
                    let in_use = output.contains("in use");
                    last = Some(error.context(format!("nodedns output:\n{output}")));
                    if !in_use {
                        break;
                    }
                }
            }
        }
        Err(last.unwrap_or_else(|| anyhow::anyhow!("nodedns did not start")))
    }

    fn wait_ready(&mut self, limit: Duration) -> anyhow::Result<()> {
        let addr = self.addr;
        let process = &mut self.process;
        let probe = client::query(PROBE_NAME, hickory_proto::rr::RecordType::A);
        wait_until(
            "nodedns",
            limit,
            || match process.exited() {
                Some(status) => bail!("nodedns exited during start-up: {status}"),
                None => Ok(()),
            },
            || {
                std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                    && client::udp_blocking(addr, &probe, Duration::from_millis(250)).is_ok()
            },
        )
    }

    /// Where the agent listens (UDP and TCP).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Everything the agent wrote to stdout and stderr so far.
    pub fn output(&self) -> String {
        self.process.output()
    }

    /// Whether the agent process is still running.
    pub fn alive(&mut self) -> bool {
        self.process.exited().is_none()
    }

    /// Stops the agent (SIGTERM, then SIGKILL after 5 s) and returns its exit status.
    pub fn stop(mut self) -> Option<ExitStatus> {
        self.process.stop()
    }
}
