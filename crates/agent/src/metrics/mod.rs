//! The agent's metrics: the counters the request path writes, and the one exposition of every
//! metric.
//!
//! Names, label names and values, HELP texts and histogram buckets are CoreDNS 1.11's (the
//! version node-cache 1.2x embeds: `plugin/metrics/vars`, `plugin/cache/metrics.go`,
//! `plugin/reload`), so node-local-dns dashboards and alerts read nodedns unchanged; what CoreDNS
//! has no name for is `nodedns_*`. `docs/metrics.md` lists every series.
//!
//! Map:
//! - [`Metrics`] (here): every counter block, the zone label slots, the counts of the control
//!   paths (reloads, upstream failures);
//! - [`counters`]: the blocks the request path counts into, without lock or allocation;
//! - [`labels`]: the label vocabulary (types, RCODEs, `proto`, `plugin`, buckets);
//! - [`exposition`]: the collector that writes it all at scrape time, with the per-zone figures
//!   the request path hands over ([`ZoneFigures`]);
//! - `process`: `process_*`, from `/proc`.
//!
//! This module depends on nothing else in the agent: the request path maps what it did onto an
//! [`Answer`] in a [`Series`], and describes the running configuration as a plain list of
//! [`ZoneFigures`]. It never sees a query's client, a snapshot or a log.

pub mod counters;
pub mod exposition;
pub mod labels;
mod process;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

pub use counters::{Answer, CacheUse, Counters, Series, ZONE_SLOTS};
pub use exposition::{CONTENT_TYPE, CacheFigures, Exposition, ZoneFigures, text};
pub use labels::{Plugin, Transport, scheme_label, server_label};

use counters::{DROPPED, OVERFLOW};
use labels::{UNUSABLE_REPLY, UPSTREAM_ERRORS, upstream_error_kind};

/// What became of one later search-list step the ndots cascade prefetch considered (the
/// `outcome` label of `nodedns_cascade_prefetches_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cascade {
    /// Its fetch was started.
    Started,
    /// A client asked for it while it was in flight or fresh in the cache.
    Used,
    /// Nobody asked for it before it expired (or its fetch failed unasked).
    Wasted,
    /// Not fetched: the bound on cascade fetches was reached, the upstream was failing, or it
    /// was busy.
    Skipped,
}

impl Cascade {
    pub const ALL: [Cascade; 4] = [
        Cascade::Started,
        Cascade::Used,
        Cascade::Wasted,
        Cascade::Skipped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Cascade::Started => "started",
            Cascade::Used => "used",
            Cascade::Wasted => "wasted",
            Cascade::Skipped => "skipped",
        }
    }
}

/// A listen address and its label values.
#[derive(Debug)]
struct Server {
    addr: SocketAddr,
    /// `server`: as CoreDNS writes it, `dns://169.254.20.10:53`, or `dns://:53` for a wildcard.
    name: Arc<str>,
}

/// Names of the zone slots.
#[derive(Debug)]
struct Names {
    /// Per slot: the zone (`zone` label) and its block's zones joined by commas (`zones`).
    slots: Vec<Option<(String, String)>>,
    /// Zone lists given slots, with their first slot.
    blocks: Vec<(Vec<String>, usize)>,
    next: usize,
}

impl Default for Names {
    fn default() -> Self {
        let mut slots = vec![None; ZONE_SLOTS];
        slots[DROPPED] = Some(("dropped".to_owned(), String::new()));
        Names {
            slots,
            blocks: Vec::new(),
            next: DROPPED + 1,
        }
    }
}

/// Every counter block, the zone label slots, and the counts of the control paths.
#[derive(Debug)]
pub struct Metrics {
    /// `--no-metrics` turns counting on the request path off.
    counting: bool,
    servers: Vec<Server>,
    /// One per listen address: its TCP connections and async answers.
    shared: Vec<Counters>,
    /// The UDP workers' blocks (registered once per worker; the lock is never taken per query).
    workers: Mutex<Vec<Arc<Counters>>>,
    names: Mutex<Names>,
    reload_failed: AtomicU64,
    /// The ndots cascade prefetch's fetches, by [`Cascade`] outcome.
    cascade: [AtomicU64; Cascade::ALL.len()],
    /// [first zone slot of the block][error kind]
    upstream_failures: Box<[AtomicU64]>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new(&[], true)
    }
}

impl Metrics {
    /// Counter blocks for the listen addresses `servers` (fixed for the life of the process:
    /// changing them needs a restart). Without `counting` the request path counts nothing (the
    /// families stay, empty).
    pub fn new(servers: &[SocketAddr], counting: bool) -> Self {
        let servers: Vec<(SocketAddr, &str)> = servers.iter().map(|a| (*a, "dns")).collect();
        Metrics::with_schemes(&servers, counting)
    }

    /// [`Metrics::new`] for listen addresses of blocks of each scheme (their `server` label).
    pub fn with_schemes(servers: &[(SocketAddr, &str)], counting: bool) -> Self {
        let mut servers: Vec<Server> = servers
            .iter()
            .map(|&(addr, scheme)| Server {
                addr,
                name: labels::scheme_label(scheme, addr).into(),
            })
            .collect();
        if servers.is_empty() {
            // Never indexed out of range, even with nothing to serve.
            let addr = SocketAddr::from(([0, 0, 0, 0], 0));
            servers.push(Server {
                addr,
                name: server_label(addr).into(),
            });
        }
        let shared = servers
            .iter()
            .enumerate()
            .map(|(i, s)| Counters::new(i, s.name.clone(), false, counting))
            .collect();
        Metrics {
            counting,
            servers,
            shared,
            workers: Mutex::new(Vec::new()),
            names: Mutex::new(Names::default()),
            reload_failed: AtomicU64::new(0),
            cascade: Default::default(),
            upstream_failures: (0..ZONE_SLOTS * UPSTREAM_ERRORS.len())
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    fn server_index(&self, local: SocketAddr) -> usize {
        self.servers
            .iter()
            .position(|s| s.addr == local)
            .unwrap_or(0)
    }

    /// The block shared by the async paths: counts without labels (malformed, send failures)
    /// from anywhere.
    pub fn counters(&self) -> &Counters {
        &self.shared[0]
    }

    /// The block the TCP connections of `local` and async answers to its clients share.
    pub fn listener(&self, local: SocketAddr) -> &Counters {
        &self.shared[self.server_index(local)]
    }

    /// The block for the async answer of a query counted in `series`.
    pub fn shared(&self, series: Series) -> &Counters {
        self.shared
            .get(usize::from(series.server))
            .unwrap_or(&self.shared[0])
    }

    /// A new block for one UDP worker thread of `local`, which only that thread may count into.
    pub fn worker(&self, local: SocketAddr) -> Arc<Counters> {
        let server = self.server_index(local);
        let counters = Arc::new(Counters::new(
            server,
            self.servers[server].name.clone(),
            true,
            self.counting,
        ));
        self.workers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(counters.clone());
        counters
    }

    /// The first zone slot of a server block serving `zones`: the same list always gets the
    /// same slots, so counts stay with their names across reloads.
    pub fn zone_slots(&self, zones: &[String]) -> usize {
        let mut names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, first)) = names.blocks.iter().find(|(z, _)| z == zones) {
            return *first;
        }
        let first = if names.next + zones.len() <= OVERFLOW {
            names.next
        } else {
            OVERFLOW
        };
        if first == OVERFLOW {
            names.slots[OVERFLOW] = Some(("other".to_owned(), "other".to_owned()));
        } else {
            let joined = zones.join(",");
            for (i, zone) in zones.iter().enumerate() {
                names.slots[first + i] = Some((zone.clone(), joined.clone()));
            }
            names.next = first + zones.len();
        }
        names.blocks.push((zones.to_vec(), first));
        first
    }

    /// An upstream exchange of the block whose first zone slot is `slot` failed.
    pub fn upstream_failed(&self, slot: usize, err: &nodedns_upstream::Error) {
        self.upstream_failure(slot, upstream_error_kind(err));
    }

    /// An upstream reply of the block whose first zone slot is `slot` could not be used.
    pub fn unusable_reply(&self, slot: usize) {
        self.upstream_failure(slot, UNUSABLE_REPLY);
    }

    fn upstream_failure(&self, slot: usize, kind: usize) {
        let i = slot.min(OVERFLOW) * UPSTREAM_ERRORS.len() + kind;
        if let Some(count) = self.upstream_failures.get(i) {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A reload found a bad configuration and kept the running one.
    pub fn reload_failed(&self) {
        self.reload_failed.fetch_add(1, Ordering::Relaxed);
    }

    /// One fetch of the ndots cascade prefetch came to `outcome`.
    pub fn cascade(&self, outcome: Cascade) {
        self.cascade[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Every block of `server` summed, cell by cell.
    fn sum(&self, server: usize) -> Vec<u64> {
        let mut total = vec![0u64; counters::event::CELLS];
        let mut add = |c: &Counters| {
            for (t, cell) in total.iter_mut().zip(c.cells.iter()) {
                *t = t.wrapping_add(cell.load(Ordering::Relaxed));
            }
        };
        if let Some(shared) = self.shared.get(server) {
            add(shared);
        }
        let workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        for worker in workers.iter().filter(|w| usize::from(w.server) == server) {
            add(worker);
        }
        total
    }

    /// One count without labels, over every block.
    fn event(&self, i: usize) -> u64 {
        let workers = self.workers.lock().unwrap_or_else(PoisonError::into_inner);
        self.shared
            .iter()
            .map(|c| c.get(i))
            .chain(workers.iter().map(|c| c.get(i)))
            .fold(0u64, u64::wrapping_add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zone_slots_are_stable_per_zone_list_and_overflow_into_other() {
        let m = Metrics::default();
        let dot = vec![".".to_owned()];
        let cl = vec!["cluster.local.".to_owned(), "in-addr.arpa.".to_owned()];
        assert_eq!(m.zone_slots(&dot), 1);
        assert_eq!(m.zone_slots(&cl), 2);
        assert_eq!(m.zone_slots(&dot), 1, "same list, same slots");
        for i in 0..40 {
            let slot = m.zone_slots(&[format!("z{i}.")]);
            assert!(slot <= OVERFLOW);
        }
        assert_eq!(m.zone_slots(&["late.".to_owned()]), OVERFLOW);
    }
}
