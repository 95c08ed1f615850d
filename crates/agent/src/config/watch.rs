//! Noticing that what [`super::load`] reads has changed.
//!
//! Kubernetes updates a mounted ConfigMap by writing a new timestamped directory and swapping the
//! `..data` symlink; the file names the pod sees are symlinks through `..data`. An inotify watch
//! on a file follows the old inode and misses the swap, so this polls instead: every 500 ms it
//! reads each watched file by its path (which resolves through the current `..data`) and lists
//! the kube-dns ConfigMap directory (keys may appear or vanish), and compares the contents with
//! the previous round. Reading a few small files twice a second costs nothing measurable and
//! applies a change well within 2 s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::sync::mpsc;

use super::ConfigArgs;

/// How often the watched paths are compared.
pub(crate) const POLL: Duration = Duration::from_millis(500);

/// What to compare each round.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// A file's contents (`None` while it cannot be read).
    File(PathBuf),
    /// Every file of a directory that is not hidden (ConfigMap keys; `..data` and the
    /// timestamped directories start with `.`).
    Dir(PathBuf),
}

type Snapshot = BTreeMap<PathBuf, Option<Vec<u8>>>;

/// What to compare, found again each round: the resolv.conf files the Corefile's `forward`
/// names and the files its `import`s name change with the Corefile (a file a glob comes to match
/// is a new target, so its appearance is a change).
fn targets(args: &ConfigArgs) -> Vec<Target> {
    let mut out = Vec::new();
    if let Some(source) = super::corefile_source(args) {
        out.push(Target::File(source.read));
    }
    if let Some(dir) = super::kubedns_dir(args) {
        out.push(Target::Dir(dir));
    }
    out.push(Target::File(args.resolv_conf.clone()));
    out.extend(super::paths_on_disk(args).into_iter().map(Target::File));
    out
}

fn snapshot(targets: &[Target]) -> Snapshot {
    let mut snap = Snapshot::new();
    for t in targets {
        match t {
            Target::File(path) => {
                snap.insert(path.clone(), std::fs::read(path).ok());
            }
            Target::Dir(dir) => read_dir(dir, &mut snap),
        }
    }
    snap
}

fn read_dir(dir: &Path, snap: &mut Snapshot) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        snap.insert(dir.to_path_buf(), None);
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        if !hidden && path.is_file() {
            snap.insert(path.clone(), std::fs::read(&path).ok());
        }
    }
}

/// What is watched and the contents at the last comparison.
struct Watcher {
    args: ConfigArgs,
    last: Snapshot,
}

impl Watcher {
    /// Takes the first snapshot: changes from here on are reported.
    async fn new(args: &ConfigArgs) -> Watcher {
        let last = read(args.clone()).await;
        Watcher {
            args: args.clone(),
            last,
        }
    }

    async fn run(mut self, tx: mpsc::Sender<()>) {
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = tx.closed() => return,
                _ = tick.tick() => {}
            }
            let now = read(self.args.clone()).await;
            if now == self.last {
                continue;
            }
            self.last = now;
            match tx.try_send(()) {
                // Full: a notification is already waiting, and it covers this change too.
                Ok(()) | Err(mpsc::error::TrySendError::Full(())) => {}
                Err(mpsc::error::TrySendError::Closed(())) => return,
            }
        }
    }
}

/// Reads the targets off the async threads (plain blocking file reads).
async fn read(args: ConfigArgs) -> Snapshot {
    tokio::task::spawn_blocking(move || snapshot(&targets(&args)))
        .await
        .unwrap_or_default()
}

/// Watches what `load` reads (the Corefile, the kube-dns ConfigMap directory, the node's
/// resolv.conf) and sends on `tx` when something changed. Several changes before the receiver
/// looks are one notification. Runs until `tx` is closed.
pub async fn watch(args: ConfigArgs, tx: mpsc::Sender<()>) {
    Watcher::new(&args).await.run(tx).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{TempDir, cli};
    use std::os::unix::fs::symlink;

    /// A directory laid out as the kubelet mounts a ConfigMap: `KEY -> ..data/KEY`,
    /// `..data -> ..<version>`.
    fn mount(dir: &Path, version: &str, files: &[(&str, &str)]) {
        let data = dir.join(format!("..{version}"));
        std::fs::create_dir_all(&data).unwrap();
        for (name, text) in files {
            std::fs::write(data.join(name), text).unwrap();
            let link = dir.join(name);
            if !link.exists() {
                symlink(Path::new("..data").join(name), &link).unwrap();
            }
        }
        // Atomic swap, as the kubelet does it: a new symlink renamed over the old one.
        let tmp = dir.join("..data_tmp");
        symlink(format!("..{version}"), &tmp).unwrap();
        std::fs::rename(&tmp, dir.join("..data")).unwrap();
    }

    async fn changed(rx: &mut mpsc::Receiver<()>) -> bool {
        tokio::time::timeout(Duration::from_secs(5), rx.recv()).await == Ok(Some(()))
    }

    #[tokio::test]
    async fn a_configmap_symlink_swap_and_a_new_kube_dns_key_are_noticed() {
        let tmp = TempDir::new("watch");
        let corefile_dir = tmp.path().join("coredns");
        let kube_dir = tmp.path().join("kube-dns");
        std::fs::create_dir_all(&corefile_dir).unwrap();
        std::fs::create_dir_all(&kube_dir).unwrap();
        mount(&corefile_dir, "v1", &[("Corefile.base", ".:53 {\n}\n")]);
        let resolv = tmp.path().join("resolv.conf");
        std::fs::write(&resolv, "nameserver 10.0.0.2\n").unwrap();
        let mut args = cli(&[
            "--basecorefile",
            corefile_dir.join("Corefile.base").to_str().unwrap(),
        ]);
        args.kubednscm = Some(kube_dir.clone());
        args.resolv_conf = resolv.clone();

        let (tx, mut rx) = mpsc::channel(1);
        let task = tokio::spawn(Watcher::new(&args).await.run(tx));
        let quiet = tokio::time::timeout(POLL * 3, rx.recv()).await;
        assert!(quiet.is_err(), "a notification without a change");

        mount(
            &corefile_dir,
            "v2",
            &[("Corefile.base", ".:53 {\n  errors\n}\n")],
        );
        assert!(changed(&mut rx).await, "the ..data swap was missed");

        mount(
            &kube_dir,
            "v1",
            &[("stubDomains", r#"{"acme.local": ["1.2.3.4"]}"#)],
        );
        assert!(changed(&mut rx).await, "the new kube-dns key was missed");

        std::fs::write(&resolv, "nameserver 10.0.0.3\n").unwrap();
        assert!(changed(&mut rx).await, "the resolv.conf change was missed");

        drop(rx);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
    }
}
