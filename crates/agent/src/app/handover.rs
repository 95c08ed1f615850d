//! Who serves the listening sockets: this instance (a [`Generation`] reads them), or a newer
//! instance on the node it handed them to (then this one is idle until SIGTERM, and leaves the
//! host plumbing to the one that serves). The protocol is [`crate::handoff`]'s; this is what the
//! app does at each of its events.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use super::pidfile::Pidfile;
use super::{Error, State};
use crate::admin;
use crate::handoff::{self, Generation, Handoff, Listeners};
use crate::host::{self, HostArgs, HostHandle};
use crate::serve::{self, Shared, tcp};
use crate::warm;

/// The listening sockets, who serves them, and what serving them again takes.
#[derive(Debug)]
pub(super) struct Handover {
    pub handoff: Handoff,
    pub listeners: Listeners,
    /// How the listeners were opened at start (for the log).
    pub opened: Opened,
    /// The workers and tasks reading the sockets; `None` while a newer instance serves them.
    pub generation: Option<Generation>,
    /// The host plumbing, kept only while this instance serves.
    pub host: Option<HostHandle>,
    /// Every address DNS is served on, with how.
    pub endpoints: BTreeMap<SocketAddr, serve::Endpoint>,
    /// Each admin address, with what it serves.
    pub admin_addrs: BTreeMap<SocketAddr, admin::Roles>,
    pub threads: usize,
    pub shared: Arc<Shared>,
    pub state: Arc<State>,
    pub limits: tcp::Limits,
    pub connections: Arc<tcp::Connections>,
    pub host_args: HostArgs,
    pub local_ips: Vec<IpAddr>,
    pub health_port: Option<u16>,
    pub host_metrics: nodedns_hostnet::Metrics,
    /// `-quiet` (CoreDNS's): no listing of what is served.
    pub quiet: bool,
    /// `--pidfile`: written whenever this instance starts serving the sockets, removed when
    /// the hand-over state is dropped at exit.
    pub pidfile: Option<Pidfile>,
    /// Where the cache snapshot is read at a plain start and written at the last exit, and how
    /// old it may be (`--handoff-dir`, `--cache-snapshot-max-age`); `None`: no snapshot.
    pub snapshot: Option<(PathBuf, Duration)>,
    /// Whether the cache goes with the sockets at a hand-over, both ways
    /// (`--no-cache-handover`: a stream this instance is given is closed unread or unwritten).
    pub cache_handover: bool,
    /// Cache streams being written to instances this one handed the sockets to.
    pub sending: Vec<JoinHandle<()>>,
}

/// How the sockets were come by at start: received from the instance serving on the node, bound
/// here, or received and not served (their address is no longer configured).
#[derive(Debug, Clone, Copy)]
pub(super) struct Opened {
    pub inherited: usize,
    pub bound: usize,
    pub unused: usize,
}

impl Handover {
    /// Starts serving every socket and tells the instance this one took over from, if any:
    /// once its cache came (at most [`warm::WAIT`]; it answers meanwhile too). Without one, a
    /// recent snapshot is loaded while this instance serves.
    pub async fn serve(&mut self) -> Result<(), Error> {
        self.generation = Some(self.spawn()?);
        if !self.warm_from_stream().await && self.opened.inherited == 0 {
            self.warm_from_snapshot();
        }
        self.handoff.serving().await?;
        if let Some(pidfile) = &self.pidfile {
            pidfile.write();
        }
        for (addr, endpoint) in self.endpoints.iter().filter(|_| !self.quiet) {
            tracing::info!(%addr, "serving {}", endpoint.describe());
        }
        for (addr, roles) in self.admin_addrs.iter().filter(|_| !self.quiet) {
            tracing::info!(%addr, "serving {roles}");
        }
        let opened = &self.opened;
        if opened.inherited > 0 {
            tracing::info!(
                inherited = opened.inherited,
                bound = opened.bound,
                unused = opened.unused,
                "took the listening sockets over from the running instance"
            );
        }
        Ok(())
    }

    fn spawn(&self) -> Result<Generation, Error> {
        Ok(Generation::spawn(
            &self.listeners,
            &self.shared,
            &self.state,
            self.limits,
            &self.connections,
        )?)
    }

    /// Loads the cache the instance that handed the sockets over streams after them, if it
    /// does, waiting at most [`warm::WAIT`] (the load goes on beyond, bounded by
    /// [`warm::DEADLINE`]). Whether a stream came.
    async fn warm_from_stream(&mut self) -> bool {
        let Some(stream) = self.handoff.take_cache() else {
            return false;
        };
        if !self.cache_handover {
            tracing::info!(
                "--no-cache-handover: the cache of the instance that handed over is not read"
            );
            return true;
        }
        let snapshot = self.shared.snapshot.load_full();
        let loading = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let received = warm::receive(stream, &snapshot);
            log_loaded(
                "the cache of the instance that handed over",
                &received.loaded,
                started,
            );
            match received.ended {
                Ok(()) => {}
                Err(why) if received.loaded.bytes == 0 => {
                    tracing::info!("no cache came from the instance that handed over: {why}");
                }
                Err(why) => tracing::warn!("the cache stream stopped before its end: {why}"),
            }
        });
        let _ = tokio::time::timeout(warm::WAIT, loading).await;
        true
    }

    /// Loads the snapshot file in the background, if there is one recent enough.
    fn warm_from_snapshot(&self) {
        let Some((dir, max_age)) = self.snapshot.clone() else {
            return;
        };
        let snapshot = self.shared.snapshot.load_full();
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let path = warm::path(&dir);
            match warm::load(&dir, &snapshot, max_age) {
                Ok(Some(loaded)) => log_loaded(
                    &format!("the cache snapshot {}", path.display()),
                    &loaded,
                    started,
                ),
                Ok(None) => {
                    tracing::info!(path = %path.display(), "no cache snapshot: starting cold")
                }
                Err(why) => tracing::warn!(
                    path = %path.display(),
                    "cache snapshot not loaded, starting cold: {why}"
                ),
            }
        });
    }

    /// At the last exit: writes the snapshot file, if snapshots are on.
    pub async fn save_snapshot(&self) {
        let Some((dir, _)) = self.snapshot.clone() else {
            return;
        };
        let snapshot = self.shared.snapshot.load_full();
        let saved = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            (
                warm::save(&dir, &snapshot),
                warm::path(&dir),
                started.elapsed(),
            )
        })
        .await;
        match saved {
            Ok((Ok(written), path, took)) => tracing::info!(
                path = %path.display(),
                entries = written.entries,
                bytes = written.bytes,
                took_ms = took.as_millis() as u64,
                "wrote the cache snapshot"
            ),
            Ok((Err(err), path, _)) => {
                tracing::warn!(path = %path.display(), %err, "cache snapshot not written");
            }
            Err(err) => tracing::warn!(%err, "cache snapshot not written"),
        }
    }

    /// At exit: lets the cache streams still being written finish (each bounded by
    /// [`warm::DEADLINE`]).
    pub async fn finish_sending(&mut self) {
        for task in self.sending.drain(..) {
            let _ = tokio::time::timeout(warm::DEADLINE, task).await;
        }
    }

    /// The next hand-over event. Cancel-safe.
    pub async fn next(&mut self) -> handoff::Event {
        self.handoff.next().await
    }

    /// Acts on one hand-over event.
    pub async fn on(&mut self, event: handoff::Event) -> Result<(), Error> {
        match event {
            handoff::Event::Successor(link) => {
                let sender = Sender::new(&self.shared, self.cache_handover);
                let handed = self
                    .handoff
                    .hand_over(link, &self.listeners, &|fd| sender.start(fd))
                    .await;
                self.sending.extend(sender.task());
                match handed {
                    Ok(pid) => {
                        // It reads every socket now: stop reading (answering what was read) and
                        // leave the host to it. Idle until SIGTERM: exiting would make the
                        // kubelet restart this container, which would take the sockets back.
                        if let Some(generation) = self.generation.take() {
                            generation.stop().await;
                        }
                        if let Some(host) = self.host.take() {
                            host.release().await;
                        }
                        tracing::info!(
                            pid,
                            "handed the listening sockets over; idle until SIGTERM"
                        );
                    }
                    Err(err) => tracing::warn!(%err, "still serving"),
                }
            }
            handoff::Event::TakeBack | handoff::Event::SuccessorLost => {
                let sockets = if matches!(event, handoff::Event::TakeBack) {
                    self.handoff.take_back().await
                } else {
                    tracing::warn!("the instance serving the sockets is gone; serving them again");
                    Vec::new()
                };
                let sockets = if sockets.is_empty() {
                    self.listeners.try_clone()?.into_sockets()
                } else {
                    sockets
                };
                self.listeners =
                    Listeners::open(&self.endpoints, &self.admin_addrs, self.threads, sockets)?.0;
                self.generation = Some(self.spawn()?);
                self.warm_from_stream().await;
                self.handoff.resumed().await?;
                tracing::info!("serving the listening sockets again");
                if let Some(pidfile) = &self.pidfile {
                    pidfile.write();
                }
                self.host = host::start(
                    &self.host_args,
                    &self.local_ips,
                    self.health_port,
                    &self.host_metrics,
                )
                .await
                .inspect_err(|err| tracing::error!("{}", nodedns_hostnet::error_chain(err)))
                .ok()
                .flatten();
            }
            handoff::Event::Released => {
                tracing::info!("the instance serving now took over from another; idle for good");
            }
            handoff::Event::PredecessorGone => {
                tracing::debug!("the instance this one took over from is gone");
            }
        }
        Ok(())
    }

    /// At shutdown: hands the sockets to a new instance that connected meanwhile, or back to
    /// the one this instance took over from, if any; then no instance can take over any more
    /// (a new one binds its own sockets). Returns whether this instance is the last on the
    /// node, the one that must withdraw and tear the host plumbing down.
    pub async fn leave(&mut self) -> bool {
        let last = match &self.generation {
            // Idle: the instance serving the sockets keeps the host.
            None => {
                self.handoff.bye().await;
                false
            }
            Some(_) => {
                let sender = Sender::new(&self.shared, self.cache_handover);
                let follow = |fd| sender.start(fd);
                let last = match self.handoff.try_accept() {
                    Some(link) => {
                        match self.handoff.hand_over(link, &self.listeners, &follow).await {
                            Ok(pid) => {
                                tracing::info!(
                                    pid,
                                    "handed the listening sockets over while shutting down"
                                );
                                self.handoff.bye().await;
                                false
                            }
                            Err(err) => {
                                tracing::warn!(%err, "hand-over while shutting down");
                                !self.handoff.give_back(&self.listeners, &follow).await
                            }
                        }
                    }
                    None => !self.handoff.give_back(&self.listeners, &follow).await,
                };
                self.sending.extend(sender.task());
                last
            }
        };
        self.handoff.close();
        last
    }

    /// At shutdown, once no instance can take over: when another instance serves the same
    /// addresses beside this one (a second DaemonSet), hands the queries to it, answering what
    /// is queued (up to `limit`). Returns whether one does: this instance is then not the last.
    pub async fn step_aside(&self, limit: Duration) -> bool {
        let udp: Vec<_> = self
            .listeners
            .sockets()
            .iter()
            .filter(|s| s.kind == handoff::Kind::Udp)
            .map(|s| s.as_fd())
            .collect();
        let addrs: BTreeSet<SocketAddr> = self
            .endpoints
            .iter()
            .filter(|(_, e)| matches!(e, serve::Endpoint::Dns))
            .map(|(a, _)| *a)
            .collect();
        serve::sibling::step_aside(&udp, &addrs, limit).await
    }
}

/// Writes this instance's cache into the stream a hand-over gives it (on a blocking thread).
/// Off (`--no-cache-handover`), it closes the stream unwritten: the new instance starts cold.
struct Sender {
    shared: Arc<Shared>,
    on: bool,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Sender {
    fn new(shared: &Arc<Shared>, on: bool) -> Sender {
        Sender {
            shared: shared.clone(),
            on,
            task: Mutex::new(None),
        }
    }

    /// Starts writing into `stream` (the hand-over's [`handoff::Follow`]).
    fn start(&self, stream: OwnedFd) {
        if !self.on {
            tracing::info!("--no-cache-handover: no cache sent to the new instance");
            return;
        }
        let snapshot = self.shared.snapshot.load_full();
        let task = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            match warm::send(stream, &snapshot) {
                Ok(written) => tracing::info!(
                    entries = written.entries,
                    bytes = written.bytes,
                    took_ms = started.elapsed().as_millis() as u64,
                    "sent the cache to the new instance"
                ),
                Err(err) => tracing::warn!(%err, "cache not sent to the new instance"),
            }
        });
        *self.task.lock().unwrap_or_else(PoisonError::into_inner) = Some(task);
    }

    fn task(self) -> Option<JoinHandle<()>> {
        self.task
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// One log line for a load: what was stored, from where, how old, how long it took.
fn log_loaded(from: &str, loaded: &warm::Loaded, started: Instant) {
    tracing::info!(
        entries = loaded.stored,
        refused = loaded.refused,
        unmatched = loaded.unmatched,
        bytes = loaded.bytes,
        age_ms = loaded.age.as_millis() as u64,
        took_ms = started.elapsed().as_millis() as u64,
        "loaded {from}"
    );
}
