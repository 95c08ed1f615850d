//! Network namespaces for simulated nodes: created with `ip netns add`, deleted on drop (also
//! when the test fails), with commands run inside through `ip netns exec`.
//!
//! `ip netns exec <ns>` also bind-mounts `/etc/netns/<ns>/resolv.conf` over `/etc/resolv.conf`,
//! which is how a namespace gets a pod's resolver configuration for glibc ([`Netns::set_resolv_conf`]).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, bail};

/// Why node tests cannot run here, or `None` when they can: they need root, `ip netns`, and the
/// given tools.
pub fn unavailable(tools: &[&str]) -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root (network namespaces and kernel rules need root)".to_owned());
    }
    for tool in tools {
        if !crate::have(tool) {
            return Some(format!("`{tool}` is not installed"));
        }
    }
    match Command::new("ip").args(["netns", "list"]).output() {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(format!(
            "`ip netns` does not work here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Some(format!("cannot run `ip`: {e}")),
    }
}

/// A unique prefix for this process's namespaces: tests in parallel (and concurrent test
/// binaries) never collide. Short, because names end up in interface names (15 bytes max).
pub fn unique_prefix() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("nd{}x{n}", std::process::id() % 100_000)
}

/// A network namespace, deleted on drop. Processes started in it must be stopped first (drop
/// them before the namespace).
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates namespace `name` with its loopback up.
    pub fn create(name: &str) -> anyhow::Result<Netns> {
        run_checked(Command::new("ip").args(["netns", "add", name]))
            .with_context(|| format!("ip netns add {name}"))?;
        let ns = Netns {
            name: name.to_owned(),
        };
        ns.run("ip", &["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `ip netns exec <ns> <program>`: exec'd in place, so the child's PID is the program's.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.name, program]);
        command
    }

    /// Runs `program args` inside, returning its stdout; fails with its stderr on a non-zero
    /// exit.
    pub fn run(&self, program: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut command = self.command(program);
        command.args(args);
        run_checked(&mut command)
            .with_context(|| format!("in {}: {program} {}", self.name, args.join(" ")))
    }

    /// Runs `program args` inside and returns its output whatever the exit status.
    pub fn output(&self, program: &str, args: &[&str]) -> anyhow::Result<Output> {
        self.command(program)
            .args(args)
            .output()
            .with_context(|| format!("in {}: {program}", self.name))
    }

    /// Runs a restore-style tool (`iptables-restore`, `nft -f -`) with `input` on stdin.
    pub fn run_stdin(&self, program: &str, args: &[&str], input: &str) -> anyhow::Result<String> {
        use std::io::Write;
        let mut child = self
            .command(program)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .with_context(|| format!("in {}: spawn {program}", self.name))?;
        child
            .stdin
            .take()
            .context("stdin")?
            .write_all(input.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "in {}: {program} {} failed ({}): {}",
                self.name,
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Writes `/etc/netns/<ns>/resolv.conf`, which `ip netns exec` shows programs as
    /// `/etc/resolv.conf` (removed with the namespace).
    pub fn set_resolv_conf(&self, text: &str) -> anyhow::Result<()> {
        let dir = self.etc_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        std::fs::write(dir.join("resolv.conf"), text)?;
        Ok(())
    }

    fn etc_dir(&self) -> PathBuf {
        PathBuf::from("/etc/netns").join(&self.name)
    }

    /// Creates a veth pair: `here` in this namespace, `there` in `other`, both up.
    pub fn veth(&self, here: &str, other: &Netns, there: &str) -> anyhow::Result<()> {
        self.run(
            "ip",
            &[
                "link",
                "add",
                here,
                "type",
                "veth",
                "peer",
                "name",
                there,
                "netns",
                &other.name,
            ],
        )?;
        self.run("ip", &["link", "set", here, "up"])?;
        other.run("ip", &["link", "set", there, "up"])?;
        Ok(())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        let _ = std::fs::remove_dir_all(self.etc_dir());
    }
}

fn run_checked(command: &mut Command) -> anyhow::Result<String> {
    let out = command.output().context("spawn")?;
    if !out.status.success() {
        bail!(
            "exit {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
