//! Serving DNS: the listeners and the request pipeline.
//!
//! - [`udp`]: one blocking OS thread per listen address and worker, each with its own
//!   `SO_REUSEPORT` socket, reading and answering in batches (`recvmmsg`/`sendmmsg`). Cache hits
//!   never leave that thread and never touch the async runtime.
//! - [`tcp`]: tokio tasks, one per client connection, pipelined.
//! - [`pipeline`]: what both share: parse, route, cache lookup, and for misses the async path
//!   (single-flight, upstream, insert, answer every waiter).
//! - [`loopcheck`]: the start-up forwarding-loop check (the `loop` directive).
//!
//! Data-path code reads one immutable [`Snapshot`] per batch (arc-swap); reload publishes a new
//! one and never blocks a reader.

pub mod loopcheck;
pub mod pipeline;
pub mod tcp;
pub mod udp;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use nodedns_cache::{Cache, Flights};
use nodedns_upstream::Group;

use crate::config::{Config, Route, Router, Server};
use crate::metrics::Metrics;
use pipeline::Waiter;

/// Waiters queued behind one key's upstream fetch, at most. Beyond it a query gets SERVFAIL at
/// once: a flood of one name must not queue unbounded memory.
pub const MAX_WAITERS_PER_KEY: usize = 4096;

/// One server block, ready to serve: its config and the live objects built from it.
#[derive(Debug)]
pub struct Zone {
    pub server: Server,
    /// Index of this block in the configuration (its metrics labels).
    pub label: usize,
    pub cache: Option<Arc<Cache>>,
    /// In-progress upstream fetches; lives as long as the cache so a reload that keeps the cache
    /// keeps the fetches it is waiting on.
    pub flights: Arc<Flights<Waiter>>,
    pub group: Option<Arc<Group>>,
}

/// Everything the data path reads, swapped as a whole on reload.
#[derive(Debug)]
pub struct Snapshot {
    pub config: Arc<Config>,
    pub router: Router,
    /// One per server block, in configuration order (a [`Route`] indexes it).
    pub zones: Vec<Arc<Zone>>,
}

impl Snapshot {
    /// The block serving `qname` (lowercase wire form) on `local`, and whether its `forward`
    /// takes the name.
    pub fn route(&self, qname: &[u8], local: SocketAddr) -> Option<(&Arc<Zone>, Route)> {
        let route = self.router.route(qname, local)?;
        Some((self.zones.get(route.server)?, route))
    }
}

/// State shared by every listener and task.
#[derive(Debug)]
pub struct Shared {
    pub snapshot: ArcSwap<Snapshot>,
    pub metrics: Arc<Metrics>,
    /// The start-up forwarding-loop check; the miss path reports probe names to it.
    pub loops: loopcheck::Detector,
    /// Set when shutdown begins: listeners stop reading new queries.
    stopping: AtomicBool,
    /// Misses being resolved, so shutdown can wait for their answers.
    in_flight: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl Shared {
    pub fn new(snapshot: Snapshot, metrics: Arc<Metrics>) -> Self {
        Shared {
            snapshot: ArcSwap::from_pointee(snapshot),
            metrics,
            loops: loopcheck::Detector::default(),
            stopping: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            idle: tokio::sync::Notify::new(),
        }
    }

    /// Marks one miss in flight until the guard drops, unless `limit` misses are in flight
    /// already: a flood of unique names must not queue unbounded work (and memory) in the
    /// runtime.
    pub fn track(self: &Arc<Self>, limit: usize) -> Option<InFlight> {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= limit {
            self.release();
            return None;
        }
        Some(InFlight(self.clone()))
    }

    fn release(&self) {
        if self.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.idle.notify_waiters();
        }
    }

    /// Waits until no miss is in flight, or `limit` passes.
    pub async fn wait_idle(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, async {
            loop {
                let notified = self.idle.notified();
                if self.in_flight.load(Ordering::SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Relaxed)
    }

    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }
}

/// One miss in flight (see [`Shared::track`]).
#[derive(Debug)]
pub struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.release();
    }
}
