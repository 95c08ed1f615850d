//! `--pidfile` (CoreDNS's `-pidfile`, which node-cache passes on): the process ID, written once
//! every listener serves and removed at exit, as CoreDNS does (its `caddy.Start` writes
//! `PID\n` with mode 0644 once the servers listen and logs a failure without stopping; its
//! exit hooks remove the file). node-cache itself waits for that file before it sets up the
//! node's rules early.
//!
//! Two instances of a hand-over may be given the same path: the file is removed at exit only
//! while it still holds this process's ID, so an instance that leaves never removes the file a
//! newer one wrote.

use std::io;
use std::path::PathBuf;

/// The pidfile of this process, removed (if still ours) when dropped.
#[derive(Debug)]
pub(super) struct Pidfile {
    path: PathBuf,
    /// What this process writes: its ID and a newline.
    contents: String,
}

impl Pidfile {
    pub fn new(path: PathBuf) -> Pidfile {
        Pidfile {
            path,
            contents: format!("{}\n", std::process::id()),
        }
    }

    /// Writes the process ID (again: after a take-back, the instance that served meanwhile may
    /// have replaced or removed it). A failure is logged; the agent serves on.
    pub fn write(&self) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            .open(&self.path)
            .and_then(|mut file| file.write_all(self.contents.as_bytes()));
        if let Err(err) = written {
            tracing::error!(path = %self.path.display(), %err, "could not write the pidfile");
        }
    }

    fn remove(&self) -> io::Result<()> {
        if std::fs::read_to_string(&self.path)? == self.contents {
            std::fs::remove_file(&self.path)?;
        }
        Ok(())
    }
}

impl Drop for Pidfile {
    fn drop(&mut self) {
        match self.remove() {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(err) => {
                tracing::warn!(path = %self.path.display(), %err, "could not remove the pidfile");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// Whether `path` holds `pid` as a pidfile does.
    fn holds(path: &Path, pid: u32) -> bool {
        std::fs::read_to_string(path).is_ok_and(|text| text == format!("{pid}\n"))
    }

    /// A fresh directory for one test's pidfile.
    fn scratch(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nodedns-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_pid_is_written_as_coredns_writes_it_and_removed_at_exit() {
        let dir = scratch("pidfile-ours");
        let path = dir.join("nodedns.pid");
        let pidfile = Pidfile::new(path.clone());
        pidfile.write();
        assert!(holds(&path, std::process::id()));
        drop(pidfile);
        assert!(!path.exists());
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn a_pidfile_another_instance_rewrote_is_left_to_it() {
        let dir = scratch("pidfile-theirs");
        let path = dir.join("nodedns.pid");
        let pidfile = Pidfile::new(path.clone());
        pidfile.write();
        std::fs::write(&path, "1\n").unwrap();
        drop(pidfile);
        assert!(holds(&path, 1), "the newer instance's pidfile stays");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
