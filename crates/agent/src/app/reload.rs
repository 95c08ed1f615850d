//! Reloads and the loop check.
//!
//! [`Reloader`]: file changes ([`config::watch`]) and SIGHUP ask for a reload; the configuration
//! is loaded again and, if valid and different, published as a new snapshot. A bad configuration
//! keeps the running one and is counted twice, as node-cache counts it:
//! `coredns_reload_failed_total` and the `configmap` setup error.
//!
//! [`LoopCheck`]: the `loop` directive ([`crate::serve::loopcheck`]). The zones of the
//! configuration at start are probed for a forwarding loop, and those of every configuration a
//! reload applies. A loop at start stops the agent; a loop in a reloaded configuration undoes the
//! reload, as any other bad configuration is refused.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::log_warnings;
use crate::config::{self, ConfigArgs};
use crate::dnstap;
use crate::serve::loopcheck::{self, Loop};
use crate::serve::{Shared, Snapshot};

/// Loads and publishes new configurations.
#[derive(Debug)]
pub(super) struct Reloader {
    pub shared: Arc<Shared>,
    /// Where the configuration comes from.
    pub sources: ConfigArgs,
    pub upstream_metrics: nodedns_upstream::Metrics,
    pub plugin_metrics: crate::plugin::Metrics,
    pub host_metrics: nodedns_hostnet::Metrics,
    /// What the `dnstap` sinks count, across reloads.
    pub taps: Arc<dnstap::Metrics>,
}

/// A configuration a reload applied, and the one it replaced.
#[derive(Debug)]
pub(super) struct Applied {
    previous: Arc<Snapshot>,
    current: Arc<Snapshot>,
}

impl Reloader {
    /// Watches the configuration's files and reloads on every change and on every request sent
    /// on the returned channel (SIGHUP); each configuration applied goes to `applied` (the loop
    /// check).
    pub fn spawn(self: &Arc<Self>, applied: mpsc::UnboundedSender<Applied>) -> mpsc::Sender<()> {
        let (requests, mut requested) = mpsc::channel::<()>(1);
        tokio::spawn(config::watch(self.sources.clone(), requests.clone()));
        let reloader = self.clone();
        tokio::spawn(async move {
            while requested.recv().await.is_some() {
                if let Some(done) = reloader.reload() {
                    // Only the loop check's end closes the channel.
                    let _ = applied.send(done);
                }
            }
        });
        requests
    }

    /// Loads the configuration again and, if it is valid and differs, publishes it.
    fn reload(&self) -> Option<Applied> {
        let current = self.shared.snapshot.load_full();
        let config = match config::load(&self.sources) {
            Ok(config) => config,
            Err(err) => {
                self.failed();
                tracing::error!(%err, "reload failed; keeping the running configuration");
                return None;
            }
        };
        if config == *current.config {
            return None;
        }
        log_warnings(&config);
        for change in current.config.restart_needed(&config) {
            tracing::warn!(%change, "this change takes effect only after a restart");
        }
        match Snapshot::build(
            Arc::new(config),
            Some(&current),
            &self.upstream_metrics,
            &self.plugin_metrics,
            &self.shared.metrics,
            &self.taps,
        ) {
            Ok(snapshot) => {
                let snapshot = Arc::new(snapshot);
                self.shared.snapshot.store(snapshot.clone());
                tracing::info!("configuration reloaded");
                Some(Applied {
                    previous: current,
                    current: snapshot,
                })
            }
            Err(err) => {
                self.failed();
                tracing::error!(
                    err = %nodedns_hostnet::error_chain(&err),
                    "reload failed; keeping the running configuration"
                );
                None
            }
        }
    }

    /// The loop check found `found` in the configuration `applied` put in place: the one it
    /// replaced serves again, unless a later reload replaced it already (that one is checked in
    /// turn).
    fn undo(&self, applied: Applied, found: &Loop) {
        let was = self
            .shared
            .snapshot
            .compare_and_swap(&applied.current, applied.previous);
        if !Arc::ptr_eq(&was, &applied.current) {
            tracing::error!("{found}. A later reload replaced that configuration already");
            return;
        }
        self.failed();
        tracing::error!("{found}. The reload is undone: the previous configuration serves again");
    }

    /// A bad configuration was refused: counted as node-cache and CoreDNS count it.
    fn failed(&self) {
        self.shared.metrics.reload_failed();
        self.host_metrics
            .setup_error(nodedns_hostnet::ErrorKind::Configmap);
    }
}

/// The loop check's task, and what it found at start.
#[derive(Debug)]
pub(super) enum LoopCheck {
    /// Checking the configuration at start, then each one a reload applies. The task ends only
    /// with a loop found at start.
    Running(JoinHandle<Arc<Loop>>),
    /// The task failed (it panicked): serving goes on without it.
    Failed,
    /// A loop in the configuration at start: the agent shuts down and exits with an error.
    Found(Arc<Loop>),
}

impl LoopCheck {
    pub fn spawn(reloader: Arc<Reloader>, mut applied: mpsc::UnboundedReceiver<Applied>) -> Self {
        LoopCheck::Running(tokio::spawn(async move {
            let shared = &reloader.shared;
            let targets = loopcheck::targets(&shared.snapshot.load());
            if let Some(found) = loopcheck::check(&shared.loops, targets).await {
                return found;
            }
            while let Some(done) = applied.recv().await {
                let targets = loopcheck::targets(&done.current);
                if let Some(found) = loopcheck::check(&shared.loops, targets).await {
                    reloader.undo(done, &found);
                }
            }
            std::future::pending().await
        }))
    }

    /// Resolves with the loop found at start; pending otherwise (also once the task failed).
    /// Cancel-safe.
    pub async fn found(&mut self) -> Arc<Loop> {
        let LoopCheck::Running(task) = self else {
            return std::future::pending().await;
        };
        match task.await {
            Ok(found) => {
                *self = LoopCheck::Found(found.clone());
                found
            }
            Err(err) => {
                tracing::warn!(%err, "the loop check failed");
                *self = LoopCheck::Failed;
                std::future::pending().await
            }
        }
    }

    /// Stops the check; the loop it found at start, if any.
    pub fn end(self) -> Option<Arc<Loop>> {
        match self {
            LoopCheck::Running(task) => {
                task.abort();
                None
            }
            LoopCheck::Failed => None,
            LoopCheck::Found(found) => Some(found),
        }
    }
}
