//! The tests that need a real node, as one test binary (one build, one link): nodedns run as a
//! black box against real servers, clients and kernel rules. One module per subject:
//!
//! - `blackbox_*`: the agent on loopback with a real Knot or a scripted upstream (answers,
//!   caching, configuration, Corefile forms (imports, keys, cache options), directives' options,
//!   node-cache's flags, metrics, per-client figures, dnstap read by golang-dnstap's reader,
//!   readiness, reload, serve-stale against an upstream's failure answers, DNS over TLS to the
//!   upstream, zone transfers, how a UDP worker waits, the upstream pool, the wire format), and
//!   the harness's own parts
//!   checked against real tools;
//! - `corpus`: the NodeLocal DNSCache configurations of installers, charts and users
//!   (`testdata/corpus/`), each loaded and answered as node-cache answered it;
//! - `hostile_*`: the DNS listeners, the admin server and the hand-over socket against clients
//!   and processes that mean harm;
//! - `node_*`: simulated nodes (network namespaces, iptables/nftables rules, conntrack): serving
//!   pods, every resolver a pod may run, the ndots cascade prefetch, a CoreDNS pod that
//!   vanishes under load, reconcile, restarts, a second instance beside the first, shutdown,
//!   and the baseline without nodedns;
//! - `reliability_*`: losses, latency and memory under load: floods, upstream failures,
//!   upgrades, and the cache carried across upgrades and restarts.
//!
//! `stock_node` and `reliability_support` are what several of them share. One module:
//! `cargo test -p nodedns-integration --test suite blackbox_cache::`.
//!
//! Every test starts by taking its turn and holds it to its end: `let _turn = crate::shared();`,
//! or [`alone`] for a test that loads the machine or measures time, CPU or memory. A new file of tests is a `mod` here (files in
//! this directory are not test binaries of their own).

mod blackbox_answers;
mod blackbox_before_cache;
mod blackbox_cache;
mod blackbox_clients;
mod blackbox_config;
mod blackbox_dnstap;
mod blackbox_flags;
mod blackbox_forms;
mod blackbox_forward_lines;
mod blackbox_harness;
mod blackbox_metrics;
mod blackbox_options;
mod blackbox_plugins;
mod blackbox_ready;
mod blackbox_reload;
mod blackbox_replies;
mod blackbox_serve_tls;
mod blackbox_stale;
mod blackbox_tls;
mod blackbox_transfers;
mod blackbox_udp_worker;
mod blackbox_upstream;
mod blackbox_wire;
mod corpus;
mod hostile_admin;
mod hostile_clients;
mod hostile_handoff;
mod node_baseline;
mod node_cascade;
mod node_failover;
mod node_reconcile;
mod node_resolvers;
mod node_restart;
mod node_second_instance;
mod node_serving;
mod node_shutdown;
mod reliability_overload;
mod reliability_support;
mod reliability_upgrade;
mod reliability_upstream;
mod reliability_warm;
mod stock_node;

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Which tests may run at the same time.
///
/// The test harness runs the tests of a binary in parallel threads (one per core unless
/// `--test-threads` or `RUST_TEST_THREADS` says otherwise; `scripts/test` runs two per core), all
/// in this process. Some tests load the machine on purpose and count what fails, or measure memory
/// or latency: thousands of queries a second through hand-overs, upstream restarts and floods, with
/// a 2 s deadline per query; a reload under three clients that never pause; two instances restarted
/// and killed under a pod's lookup loop; 800 misses a second while a CoreDNS pod vanishes, every
/// answer within 250 ms. Others hold the agent to a bound in time or CPU: a connection closed
/// within its time-out, `/health` within a second beside 200 held connections, the CPU an accept
/// loop spends out of descriptors, an exit beside silent hand-over peers. Beside another test, they
/// would measure that test too, and their load would push that test's own deadlines (a lookup with
/// a 1 s timeout, a SERVFAIL within the agent's deadline, a TTL window) over the edge. They run
/// [`alone`]. Every other test runs [`shared`]: beside other shared tests, never beside one that
/// runs alone — as each did beside the tests of its own file when every file was a binary of its
/// own and cargo ran the binaries one after another.
///
/// A test waiting to run alone waits only for the tests already running: std's `RwLock` on Linux
/// lets no new reader in while a writer waits.
static MACHINE: RwLock<()> = RwLock::new(());

/// A test's turn on the machine: held to the end of the test. (Held across `.await` in async
/// tests, and harmlessly: it is taken once, on the test's own thread, before the test starts
/// anything, and no task ever waits for it.)
#[derive(Debug)]
pub struct Turn {
    _alone: Option<RwLockWriteGuard<'static, ()>>,
    _shared: Option<RwLockReadGuard<'static, ()>>,
}

/// For a test that loads the machine or measures memory or latency under load: no other test
/// runs meanwhile.
pub fn alone() -> Turn {
    Turn {
        // A failed test that ran alone poisons the lock; the next one runs all the same.
        _alone: Some(MACHINE.write().unwrap_or_else(|e| e.into_inner())),
        _shared: None,
    }
}

/// For every other test: it runs beside other shared tests.
pub fn shared() -> Turn {
    Turn {
        _alone: None,
        _shared: Some(MACHINE.read().unwrap_or_else(|e| e.into_inner())),
    }
}
