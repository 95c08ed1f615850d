//! The shutdown order, so that pods never lose an answer: readiness false (Cilium and Kubernetes
//! stop sending) → the sockets to another instance if one is there → the queries to a sibling
//! instance on the same addresses if one is there (a second DaemonSet) → withdraw the kube-dns
//! ClusterIP rules (new queries fall back to kube-proxy → CoreDNS) → keep answering for the
//! drain period → stop reading → answer what is in flight → the cache: its stream to the next
//! instance finished, or (the last instance) written to the snapshot file → remove the remaining
//! rules and the link → close the dnstap sessions (their last messages written, the readers'
//! FINISH awaited, for a second at most). Only the last instance on the node touches the host
//! plumbing: an idle one (it handed
//! over) or one that handed the sockets back leaves it to the instance that serves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::handover::Handover;
use crate::admin::Readiness;
use crate::dnstap::{self, Tap};
use crate::serve::Shared;

/// How long misses still in flight may take to get their answers (the upstream deadline bounds
/// them well before).
const IN_FLIGHT: Duration = Duration::from_secs(3);

/// How long the dnstap readers may take to acknowledge the end of their session (FINISH): a
/// reader that is gone or stuck must not hold the exit up.
const TAP_FINISH: Duration = Duration::from_secs(1);

/// What the shutdown acts on besides the sockets.
#[derive(Debug)]
pub(super) struct Shutdown<'a> {
    pub readiness: &'a Readiness,
    pub shared: &'a Shared,
    /// How long to keep answering once the ClusterIP rules are withdrawn.
    pub drain: Duration,
}

impl Shutdown<'_> {
    pub async fn run(self, mut handover: Handover) {
        tracing::info!("shutting down");
        self.readiness.drain();
        let last = handover.leave().await;
        // Nor is this one the last while another instance serves the same addresses beside it
        // (a second DaemonSet): that one gets the queries from now on (serve::sibling).
        let last = last && !handover.step_aside(self.drain).await;
        if last {
            if let Some(host) = &handover.host {
                host.withdraw().await;
            }
            tokio::time::sleep(self.drain).await;
        } else {
            tracing::info!("another instance serves: leaving the host networking in place");
        }
        self.shared.stop();
        if let Some(generation) = handover.generation.take() {
            generation.stop().await;
        }
        self.shared.wait_idle(IN_FLIGHT).await;
        // The cache, complete now: to the next instance on this node, through the hand-over
        // (being written), or, from the last one, into the snapshot a plain restart loads.
        handover.finish_sending().await;
        if last {
            handover.save_snapshot().await;
        }
        if let Some(host) = handover.host.take() {
            if last {
                host.teardown().await;
            } else {
                host.release().await;
            }
        }
        // Last: a reader that is slow to finish holds up nothing else.
        self.finish_taps().await;
    }

    /// The answers are all sent, and tapped: each dnstap writer writes out its queue and closes
    /// its session, all within [`TAP_FINISH`].
    async fn finish_taps(&self) {
        let snapshot = self.shared.snapshot.load_full();
        let mut taps: Vec<Arc<Tap>> = Vec::new();
        for tap in snapshot.zones.iter().flat_map(|z| &z.taps) {
            if !taps.iter().any(|t| Arc::ptr_eq(t, tap)) {
                taps.push(tap.clone());
            }
        }
        if taps.is_empty() {
            return;
        }
        let deadline = Instant::now() + TAP_FINISH;
        let waited = tokio::task::spawn_blocking(move || {
            dnstap::finish(taps.iter().map(|t| &**t), deadline)
        });
        if let Ok(unfinished) = waited.await {
            for sink in unfinished {
                tracing::warn!(endpoint = %sink, "dnstap: the reader did not finish the session in time; its last messages may be lost");
            }
        }
    }
}
