//! The hand-over socket (`--handoff-dir`) against processes that are not the next nodedns: a
//! directory other users can write to, the socket file's mode under any umask, another user
//! connecting, a root process that is not nodedns connecting or listening first, and peers that
//! connect and say nothing (or say `hello` and then nothing) while the agent gets SIGTERM.
//!
//! Real parts: the `nodedns` binary, the kernel's Unix sockets and credentials, `setpriv`
//! (util-linux) for another user, and Debian's `python3` speaking the hand-over protocol as the
//! hostile peer (copied under the name `nodedns` where the peer must pass the name check).

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nodedns_integration::{
    Process, TempDir, free_loopback, free_port, have, http_get, nodedns_bin,
};

/// The hand-over's deadlines (crates/agent/src/handoff/mod.rs), as docs/reliability.md states them.
const HELLO: Duration = Duration::from_secs(1);
const STEP: Duration = Duration::from_secs(5);
/// The agent's default `--drain`.
const DRAIN: Duration = Duration::from_secs(1);
/// Scheduling slack on a shared 2-core machine.
const SLACK: Duration = Duration::from_secs(2);

const PYTHON: &str = "/usr/bin/python3";

/// A hand-over peer in Python: `connect PATH MODE` (MODE: `silent`, `hello-silent`, `hello`) or
/// `listen PATH`. Prints what happened, one word per line: `connect-failed ERRNO`,
/// `connected`, `sockets N` (descriptors received), `closed`.
const PEER: &str = r#"
import socket, sys, time
role, path = sys.argv[1], sys.argv[2]
def count(s):
    got = 0
    s.settimeout(20)
    while True:
        try:
            msg, anc, flags, addr = s.recvmsg(256, socket.CMSG_SPACE(16))
        except (socket.timeout, OSError):
            break
        if not msg:
            break
        got += sum(1 for level, kind, data in anc if kind == socket.SCM_RIGHTS)
        if msg == b"end" and role == "connect":
            break
    print("sockets", got, flush=True)
if role == "listen":
    l = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    l.bind(path)
    l.listen(1)
    print("listening", flush=True)
    c, _ = l.accept()
    c.settimeout(20)
    hello = c.recv(256)
    print("hello" if hello.startswith(b"hello") else "nothing", flush=True)
    if hello:
        c.send(b"end")
    count(c)
    sys.exit(0)
mode = sys.argv[3]
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.connect(path)
except OSError as e:
    print("connect-failed", e.errno, flush=True)
    sys.exit(0)
print("connected", flush=True)
if mode == "silent":
    time.sleep(60)
    sys.exit(0)
try:
    s.send(b"hello 1 4242")
except OSError:
    pass  # closed already: refused before it said a word
if mode == "hello-silent":
    time.sleep(60)
    sys.exit(0)
count(s)
"#;

fn python_or_skip() -> bool {
    if !Path::new(PYTHON).exists() || !nix::unistd::geteuid().is_root() || !have("setpriv") {
        eprintln!("skipped: needs root, {PYTHON} and setpriv");
        return false;
    }
    true
}

/// `nodedns run` with `--handoff-dir dir`, started by `sh` under `umask`, forwarding to a port
/// nothing listens on; returns once /health answers (or the process exited: see `exited`).
struct Agent {
    process: Process,
    health: SocketAddr,
}

fn spawn(dir: &Path, umask: &str) -> Agent {
    let dead = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()));
    let health = free_loopback();
    let mut command = Command::new("sh");
    command
        .args(["-c", &format!("umask {umask} && exec \"$0\" \"$@\"")])
        .arg(nodedns_bin())
        .arg("run")
        .args(["--listen", &dns.to_string()])
        .args(["--upstream", &dead.to_string()])
        .args(["--metrics-listen-address", &health.to_string()])
        .args(["--threads", "2"])
        .arg("--handoff-dir")
        .arg(dir)
        .env("NO_COLOR", "1");
    let process = Process::spawn("nodedns", command).expect("spawn nodedns");
    Agent { process, health }
}

fn start(dir: &Path, umask: &str) -> Agent {
    let mut agent = spawn(dir, umask);
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        if let Some(status) = agent.process.exited() {
            panic!("nodedns exited: {status}\n{}", agent.process.output());
        }
        if matches!(http_get(agent.health, "/health"), Ok((200, _)))
            && dir.join("nodedns.sock").exists()
        {
            return agent;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("nodedns did not start:\n{}", agent.process.output());
}

/// A Python hand-over peer (see [`PEER`]); `as_uid` runs it as another user, `exe` names its
/// executable.
fn peer(script_dir: &Path, exe: &Path, as_uid: Option<u32>, args: &[&str]) -> Process {
    let script = script_dir.join("peer.py");
    if !script.exists() {
        std::fs::write(&script, PEER).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let mut command = match as_uid {
        Some(uid) => {
            let mut command = Command::new("setpriv");
            command.args([
                &format!("--reuid={uid}"),
                &format!("--regid={uid}"),
                "--clear-groups",
                "--",
            ]);
            command.arg(exe);
            command
        }
        None => Command::new(exe),
    };
    command.arg(&script).args(args);
    Process::spawn("peer", command).expect("spawn the Python peer")
}

/// Waits until `process` printed a line starting with `word`; the line.
fn line(process: &mut Process, word: &str, limit: Duration) -> String {
    process
        .wait_output(word, limit)
        .unwrap_or_else(|err| panic!("{err:#}"));
    process
        .output()
        .lines()
        .find(|l| l.starts_with(word))
        .unwrap()
        .to_owned()
}

/// Debian's Python, copied as `<dir>/nodedns`: a process whose executable has nodedns's name.
fn python_named_nodedns(dir: &Path) -> PathBuf {
    let exe = dir.join("nodedns");
    std::fs::copy(std::fs::canonicalize(PYTHON).unwrap(), &exe).unwrap();
    exe
}

#[test]
fn a_directory_other_users_can_write_to_or_that_is_not_ours_is_refused() {
    let _turn = crate::shared();
    for (mode, owner) in [(0o777, 0), (0o775, 0), (0o755, 65534)] {
        let dir = TempDir::new("nodedns-handoff-unsafe").unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        if owner != 0 {
            if !nix::unistd::geteuid().is_root() {
                continue;
            }
            std::os::unix::fs::chown(dir.path(), Some(owner), Some(owner)).unwrap();
        }
        let mut agent = spawn(dir.path(), "022");
        let status = agent
            .process
            .wait_timeout(Duration::from_secs(10))
            .expect("nodedns exits");
        let output = agent.process.output();
        assert!(
            !status.success(),
            "{mode:04o} uid {owner}: started:\n{output}"
        );
        for needle in [
            dir.path().display().to_string(),
            format!("mode {mode:04o}"),
            format!("owner uid {owner}"),
        ] {
            assert!(output.contains(&needle), "no {needle:?} in:\n{output}");
        }
        assert!(!dir.path().join("nodedns.sock").exists());
    }
}

#[test]
fn the_socket_file_is_0600_whatever_the_umask() {
    let _turn = crate::shared();
    for umask in ["022", "000"] {
        let dir = TempDir::new("nodedns-handoff-mode").unwrap();
        let agent = start(dir.path(), umask);
        let meta = std::fs::metadata(dir.path().join("nodedns.sock")).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o600, "umask {umask}");
        let lock = std::fs::metadata(dir.path().join("nodedns.lock")).unwrap();
        assert_eq!(lock.mode() & 0o7777, 0o600, "lock file, umask {umask}");
        drop(agent);
    }
}

#[test]
fn another_user_receives_no_socket() {
    let _turn = crate::shared();
    if !python_or_skip() {
        return;
    }
    let dir = TempDir::new("nodedns-handoff-user").unwrap();
    // umask 000: nothing but the agent's own choice of mode keeps the socket private.
    let agent = start(dir.path(), "000");
    let socket = dir.path().join("nodedns.sock");
    let path = socket.display().to_string();
    let mut nobody = peer(
        dir.path(),
        Path::new(PYTHON),
        Some(65534),
        &["connect", &path, "hello"],
    );
    let said = line(&mut nobody, "connect", Duration::from_secs(10));
    assert!(said.starts_with("connect-failed 13"), "uid 65534: {said}");
    // Even through a socket file anyone may connect to, the kernel's credentials say who it is.
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut nobody = peer(
        dir.path(),
        Path::new(PYTHON),
        Some(65534),
        &["connect", &path, "hello"],
    );
    let said = line(&mut nobody, "sockets", Duration::from_secs(10));
    assert_eq!(said, "sockets 0", "{}", nobody.output());
    assert!(
        agent.process.output().contains("runs as uid 65534"),
        "{}",
        agent.process.output()
    );
    assert_eq!(http_get(agent.health, "/health").unwrap().0, 200);
}

#[test]
fn a_root_process_that_is_not_nodedns_receives_no_socket() {
    let _turn = crate::shared();
    if !python_or_skip() {
        return;
    }
    let dir = TempDir::new("nodedns-handoff-root").unwrap();
    let agent = start(dir.path(), "022");
    let path = dir.path().join("nodedns.sock").display().to_string();
    let mut root = peer(
        dir.path(),
        Path::new(PYTHON),
        None,
        &["connect", &path, "hello"],
    );
    let said = line(&mut root, "sockets", Duration::from_secs(10));
    assert_eq!(said, "sockets 0", "{}", root.output());
    let output = agent.process.output();
    assert!(
        output.contains("refusing a hand-over connection") && output.contains("python3"),
        "{output}"
    );
    assert_eq!(http_get(agent.health, "/health").unwrap().0, 200);
}

#[test]
fn a_root_process_listening_first_is_refused_and_gets_no_socket() {
    let _turn = crate::shared();
    if !python_or_skip() {
        return;
    }
    let dir = TempDir::new("nodedns-handoff-first").unwrap();
    let path = dir.path().join("nodedns.sock").display().to_string();
    let mut impostor = peer(dir.path(), Path::new(PYTHON), None, &["listen", &path]);
    line(&mut impostor, "listening", Duration::from_secs(10));
    // Without the check the agent would serve "its" sockets, and hand the impostor every one at
    // SIGTERM.
    let mut agent = spawn(dir.path(), "022");
    let status = agent.process.wait_timeout(Duration::from_secs(10));
    if status.is_none() {
        agent.process.signal(Signal::SIGTERM).unwrap();
    }
    let output = agent.process.output();
    assert!(
        status.is_some_and(|s| !s.success()),
        "nodedns took over from a Python process:\n{output}"
    );
    assert!(
        output.contains("refusing the process listening there") && output.contains(&path),
        "{output}"
    );
    let said = line(&mut impostor, "sockets", Duration::from_secs(25));
    assert_eq!(said, "sockets 0", "{}", impostor.output());
}

/// Three peers with nodedns's name connect and `mode` (`silent`, `hello-silent`); then SIGTERM.
/// How long the agent took to exit.
fn exit_with_peers(mode: &str) -> (Duration, String) {
    let dir = TempDir::new("nodedns-handoff-silent").unwrap();
    let exe = python_named_nodedns(dir.path());
    let mut agent = start(dir.path(), "022");
    let path = dir.path().join("nodedns.sock").display().to_string();
    let mut peers: Vec<Process> = (0..3)
        .map(|_| peer(dir.path(), &exe, None, &["connect", &path, mode]))
        .collect();
    for p in &mut peers {
        line(p, "connected", Duration::from_secs(10));
    }
    // Let the agent take them in (and, for `hello-silent`, start handing over to one).
    std::thread::sleep(Duration::from_millis(300));
    let sent = Instant::now();
    agent.process.signal(Signal::SIGTERM).unwrap();
    let status = agent
        .process
        .wait_timeout(Duration::from_secs(60))
        .expect("nodedns exits");
    let took = sent.elapsed();
    let output = agent.process.output();
    assert!(status.success(), "{status}\n{output}");
    (took, output)
}

#[test]
fn three_silent_peers_do_not_delay_the_exit() {
    let _turn = crate::alone();
    if !python_or_skip() {
        return;
    }
    let (took, output) = exit_with_peers("silent");
    eprintln!("three silent peers: exit {took:?} after SIGTERM");
    assert!(
        took <= DRAIN + SLACK,
        "exit took {took:?} after SIGTERM:\n{output}"
    );
}

#[test]
fn three_peers_silent_after_hello_delay_the_exit_by_two_steps_at_most() {
    let _turn = crate::alone();
    if !python_or_skip() {
        return;
    }
    // A hand-over in progress when SIGTERM comes (at most one step), then one to a peer waiting
    // at shutdown (one step); the third is never tried.
    let (took, output) = exit_with_peers("hello-silent");
    eprintln!("three peers silent after hello: exit {took:?} after SIGTERM");
    assert!(
        took <= STEP * 2 + HELLO + DRAIN + SLACK,
        "exit took {took:?} after SIGTERM:\n{output}"
    );
}
