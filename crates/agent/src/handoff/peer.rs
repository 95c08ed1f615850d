//! The process at the other end of a hand-over connection, as the kernel names it
//! (`SO_PEERCRED`: the credentials it had when it connected, or when it started listening), and
//! whether it may be handed (or hand) the listening sockets.
//!
//! The boundary is the uid: the peer must run as this instance's effective user. A process of
//! that user could bind the DNS addresses into the same `SO_REUSEPORT` group and read queries
//! anyway (the kernel allows that to the same effective uid), so the hand-over gives it nothing it
//! could not take; any other user gets nothing. The file's mode (0600) keeps other users from
//! connecting at all; this check holds even if the mode were wrong.
//!
//! The executable's name is checked too where it can be: the kernel gives the peer's pid only
//! when the peer is in this process's PID namespace (pods have one each, so between two pods it
//! is 0), and then `/proc/PID/exe` must have this executable's file name. That keeps another
//! program of the same user (a debugging tool, a script) from taking or feeding the sockets by
//! mistake; it is no barrier to a hostile process of the same user, which could name itself so,
//! and a pid can be reused between the connection and the check. The same binary is not required:
//! an upgrade hands over between two builds.

use std::fmt;
use std::os::fd::AsFd;
use std::path::Path;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};

/// The other end of a hand-over connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// `None` when the process is in another PID namespace (the kernel says 0).
    pub pid: Option<u32>,
    pub uid: u32,
}

impl Peer {
    /// The kernel's credentials of the process at the other end of `socket`.
    pub fn of(socket: &impl AsFd) -> Result<Peer, String> {
        let creds = getsockopt(socket, PeerCredentials)
            .map_err(|err| format!("cannot read the peer's credentials: {err}"))?;
        Ok(Peer {
            pid: u32::try_from(creds.pid()).ok().filter(|&pid| pid != 0),
            uid: creds.uid(),
        })
    }

    /// Whether this peer may take part in a hand-over with this process (`Err` says why not).
    pub fn check(&self) -> Result<(), String> {
        let uid = nix::unistd::geteuid().as_raw();
        if self.uid != uid {
            return Err(format!(
                "{self} runs as uid {}, nodedns as uid {uid}",
                self.uid
            ));
        }
        let Some(pid) = self.pid else {
            return Ok(());
        };
        let ours = std::fs::read_link("/proc/self/exe")
            .map_err(|err| format!("cannot read this process's executable: {err}"))?;
        let theirs = std::fs::read_link(format!("/proc/{pid}/exe"))
            .map_err(|err| format!("{self}: cannot read its executable: {err}"))?;
        if file_name(&theirs) != file_name(&ours) {
            return Err(format!(
                "{self} is {}, not {}",
                theirs.display(),
                file_name(&ours)
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "pid {pid} (uid {})", self.uid),
            None => write!(f, "a process of another PID namespace (uid {})", self.uid),
        }
    }
}

/// The executable's file name, without the ` (deleted)` the kernel appends once the file was
/// replaced (an upgrade in place).
fn file_name(exe: &Path) -> String {
    let name = exe
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match name.strip_suffix(" (deleted)") {
        Some(name) => name.to_owned(),
        None => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{AddressFamily, SocketFlags, SocketType};

    #[test]
    fn a_peer_in_this_process_is_this_user_and_this_executable() {
        let (a, _b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let peer = Peer::of(&a).unwrap();
        assert_eq!(peer.pid, Some(std::process::id()));
        assert_eq!(peer.uid, nix::unistd::geteuid().as_raw());
        peer.check().unwrap();
    }

    #[test]
    fn another_uid_or_another_program_is_refused() {
        let me = nix::unistd::geteuid().as_raw();
        let other = Peer {
            pid: None,
            uid: me.wrapping_add(1),
        };
        assert!(other.check().unwrap_err().contains("runs as uid"));
        // pid 1 (init, or the container's entry point) is not this test binary.
        let init = Peer {
            pid: Some(1),
            uid: me,
        };
        let why = init.check().unwrap_err();
        assert!(why.contains("pid 1"), "{why}");
        // A process in another PID namespace: the uid is all the kernel says.
        Peer { pid: None, uid: me }.check().unwrap();
    }

    #[test]
    fn a_replaced_executable_keeps_its_name() {
        assert_eq!(file_name(Path::new("/nodedns (deleted)")), "nodedns");
        assert_eq!(file_name(Path::new("/usr/bin/nodedns")), "nodedns");
        assert_eq!(file_name(Path::new("/usr/bin/python3.11")), "python3.11");
    }
}
