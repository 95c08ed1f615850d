//! `nodedns run`: the agent's life, in the order linkerd2-proxy's main reads:
//! [`Settings::new`] (the configuration and the runtime settings, validated together), then
//! [`App::build`] (host plumbing, metrics, the first snapshot, the listening sockets: everything
//! bound, nothing served), then [`App::serve`] (serve until SIGTERM or SIGINT, then shut down in
//! order).
//!
//! Start-up order: host plumbing (link, addresses, rules) → listeners → admin endpoints →
//! readiness (once the first upstream check answered). Shutdown order, so that pods never lose an
//! answer: readiness false → withdraw the kube-dns ClusterIP rules (new queries fall back to
//! kube-proxy → CoreDNS) → keep answering for the drain period → stop reading → answer what is
//! in flight → remove the remaining rules and the link → exit.
//!
//! With `--handoff-dir`, the listeners are taken over from the instance already serving on the
//! node, and handed to the next one ([`crate::handoff`]); only the last instance to exit
//! withdraws and tears down.
//!
//! The parts, each a type:
//! - [`Settings`] (`settings`): what the app is told, read once;
//! - `Reloader` and `LoopCheck` (`reload`): a new configuration on file change or SIGHUP, and
//!   the `loop` check after start and after every reload (a loop at start stops the agent, one
//!   in a reload undoes it);
//! - `Handover` (`handover`): who serves the listening sockets, this instance or a newer one;
//! - `Pidfile` (`pidfile`): `--pidfile`, written once serving, removed at exit;
//! - [`descriptors`]: the descriptor limit raised at start, and the TCP caps derived from it;
//! - `Shutdown` (`shutdown`): the order above.

pub mod descriptors;
mod handover;
mod pidfile;
mod reload;
mod settings;
mod shutdown;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use crate::admin::{self, Readiness};
use crate::clients;
use crate::config::Config;
use crate::dnstap;
use crate::handoff::{self, Handoff, Listeners};
use crate::host;
use crate::logging;
use crate::metrics::{self, Metrics};
use crate::serve::loopcheck::Loop;
use crate::serve::{Shared, Snapshot, SnapshotError, tcp};
use handover::Handover;
use reload::{LoopCheck, Reloader};
pub use settings::{Settings, Tcp};
use shutdown::Shutdown;

/// Why the agent could not start, or stopped with an error (exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Host(#[from] host::Error),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Handoff(#[from] handoff::Error),
    /// Binding, duplicating or serving the listening sockets.
    #[error("listening sockets")]
    Listeners(#[from] handoff::ListenError),
    /// The loop check found a forwarding loop in the configuration the agent started with.
    #[error("exiting: forwarding loop in zone `{}` (see above)", .0.zone)]
    Loop(Arc<Loop>),
}

/// Everything the admin endpoints read.
#[derive(Debug)]
struct State {
    shared: Arc<Shared>,
    /// Every metric: the crates' and the agent's ([`metrics::Exposition`]).
    registry: Registry,
    readiness: Readiness,
    log: Arc<logging::Handle>,
    admin: admin::Metrics,
}

impl admin::Source for State {
    fn metrics(&self) -> String {
        metrics::text(&self.registry)
    }

    fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    fn log(&self) -> Option<&logging::Handle> {
        Some(&self.log)
    }

    fn counters(&self) -> &admin::Metrics {
        &self.admin
    }
}

/// Every address DNS is served on, with its blocks' scheme (the `server` label).
fn listen_schemes(config: &Config) -> Vec<(SocketAddr, &'static str)> {
    let mut out: BTreeMap<SocketAddr, &'static str> = BTreeMap::new();
    for server in &config.servers {
        for addr in &server.listen {
            out.entry(*addr).or_insert(server.scheme.as_str());
        }
    }
    out.into_iter().collect()
}

/// The agent, built: every socket bound, the host plumbing in place, nothing served yet.
#[derive(Debug)]
pub struct App {
    shared: Arc<Shared>,
    state: Arc<State>,
    handover: Handover,
    reloader: Arc<Reloader>,
    drain: Duration,
}

impl App {
    /// Sets up the host plumbing, the metrics and the first snapshot, and opens the listening
    /// sockets: taken over from the instance serving on this node (an upgrade), or bound here.
    /// Everything is bound before anything is served, so a bad address fails start-up whole.
    pub async fn build(settings: Settings, log: Arc<logging::Handle>) -> Result<App, Error> {
        logging::spawn_signal_handler(log.clone());
        let Settings {
            config,
            sources,
            host: host_args,
            check_only: _,
            threads,
            drain,
            tcp,
            udp_rate_limit,
            handoff_dir,
            cache_snapshot_max_age,
            cache_handover,
            pidfile,
            counting,
            querylog,
            clients,
            cli_mode,
        } = settings;
        let mut registry = Registry::default();
        let upstream_metrics = nodedns_upstream::Metrics::register(&mut registry);
        let host_metrics = nodedns_hostnet::Metrics::register(&mut registry);
        let plugin_metrics = crate::plugin::Metrics::register(&mut registry);

        let health_port = config.host_health_port;
        let host = host::start(&host_args, &config.local_ips, health_port, &host_metrics).await?;

        log_warnings(&config);
        let config = Arc::new(config);
        let endpoints = crate::serve::endpoints(&config);
        let schemes = listen_schemes(&config);
        let metrics = Arc::new(Metrics::with_schemes(&schemes, counting));
        let taps = Arc::new(dnstap::Metrics::default());
        let snapshot = Snapshot::build(
            config.clone(),
            None,
            &upstream_metrics,
            &plugin_metrics,
            &metrics,
            &taps,
        )?;
        let clients = Arc::new(clients::Board::new(clients));
        let shared = Arc::new(
            Shared::new(snapshot, metrics.clone(), clients.clone(), querylog)
                .with_udp_limit(udp_rate_limit),
        );
        let figures = {
            let shared = shared.clone();
            move || shared.snapshot.load().figures()
        };
        registry.register_collector(Box::new(metrics::Exposition::new(metrics, figures)));
        registry.register_collector(Box::new(clients::Collector(clients)));
        registry.register_collector(Box::new(dnstap::Collector(taps.clone())));

        let (handoff, inherited) = Handoff::start(handoff_dir.as_deref()).await?;
        let snapshot = handoff_dir
            .filter(|_| !cache_snapshot_max_age.is_zero())
            .map(|dir| (dir, cache_snapshot_max_age));
        let admin_metrics = admin::Metrics::default();
        admin_metrics.register(&mut registry, &admin::NAMES);
        log_tcp_caps(&tcp);
        let connections = Arc::new(tcp::Connections::new(
            tcp.max_connections,
            tcp.max_connections_per_client,
        ));
        connections
            .metrics()
            .register(&mut registry, &crate::serve::tcp::NAMES);
        let state = Arc::new(State {
            shared: shared.clone(),
            admin: admin_metrics,
            registry,
            readiness: Readiness::default(),
            log,
        });
        let admin_addrs = admin::addresses(&config, cli_mode);
        let (listeners, opened) = Listeners::open(&endpoints, &admin_addrs, threads, inherited)?;
        let handover = Handover {
            handoff,
            listeners,
            opened: handover::Opened {
                inherited: opened.inherited,
                bound: opened.bound,
                unused: opened.unused,
            },
            generation: None,
            host,
            endpoints,
            admin_addrs,
            threads,
            shared: shared.clone(),
            state: state.clone(),
            limits: tcp.limits,
            connections,
            host_args,
            local_ips: config.local_ips.clone(),
            health_port,
            host_metrics: host_metrics.clone(),
            quiet: sources.quiet,
            pidfile: pidfile.map(pidfile::Pidfile::new),
            snapshot,
            cache_handover,
            sending: Vec::new(),
        };
        let reloader = Arc::new(Reloader {
            shared: shared.clone(),
            sources,
            upstream_metrics,
            plugin_metrics,
            host_metrics,
            taps,
        });
        Ok(App {
            shared,
            state,
            handover,
            reloader,
            drain,
        })
    }

    /// Serves until SIGTERM or SIGINT (or a forwarding loop found at start), then shuts down in
    /// order. Meanwhile: readiness once every block's upstream answered, reloads, the loop
    /// check, and the hand-over of the sockets to a newer instance and back.
    pub async fn serve(self) -> Result<(), Error> {
        let App {
            shared,
            state,
            mut handover,
            reloader,
            drain,
        } = self;
        handover.serve().await?;
        spawn_readiness(state.clone());

        // The `loop` directive: a loop in the configuration at start stops the agent, one in a
        // reloaded configuration undoes the reload.
        let (applied_tx, applied_rx) = mpsc::unbounded_channel();
        let mut loop_check = LoopCheck::spawn(reloader.clone(), applied_rx);
        // Reload: file changes and SIGHUP both lead here.
        let reload_tx = reloader.spawn(applied_tx);

        let signals = wait_for_signals(reload_tx);
        tokio::pin!(signals);
        loop {
            let event = tokio::select! {
                // A signal first: a hand-over waits on the other instance, shutdown must not.
                biased;
                _ = &mut signals => break,
                found = loop_check.found() => {
                    tracing::error!("{found}");
                    break;
                }
                event = handover.next() => event,
            };
            handover.on(event).await?;
        }

        Shutdown {
            readiness: &state.readiness,
            shared: &shared,
            drain,
        }
        .run(handover)
        .await;
        let found = loop_check.end();
        tracing::info!("stopped");
        match found {
            Some(found) => Err(Error::Loop(found)),
            None => Ok(()),
        }
    }
}

/// Readiness: listeners and rules are up; wait for one upstream answer per block.
fn spawn_readiness(state: Arc<State>) {
    tokio::spawn(async move {
        let snap = state.shared.snapshot.load_full();
        for zone in &snap.zones {
            for group in zone.forwards.iter().map(|f| &f.group) {
                while !group.probe().await {
                    tracing::warn!(zones = ?zone.server.zones, "no upstream answers yet");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        state.readiness.set_ready();
        tracing::info!("ready");
    });
}

/// Raises the soft descriptor limit to the hard one, as Go's runtime does (CoreDNS and node-cache
/// run with it raised), and says so. Call once at start, before the runtime's threads.
pub fn raise_descriptor_limit() {
    match descriptors::raise() {
        Ok(limit) if limit.before < limit.soft => tracing::info!(
            from = limit.before,
            to = limit.soft,
            "descriptor limit (RLIMIT_NOFILE) raised to the hard limit"
        ),
        Ok(_) => {}
        Err(err) => tracing::warn!(%err, "cannot raise the descriptor limit (RLIMIT_NOFILE)"),
    }
}

/// What the TCP client connections may take of the descriptors, once at start.
fn log_tcp_caps(tcp: &Tcp) {
    let caps = descriptors::Caps {
        total: tcp.max_connections,
        per_client: tcp.max_connections_per_client,
    };
    if caps.fit(tcp.descriptors, tcp.reserve) {
        tracing::info!(
            connections = caps.total,
            per_client = caps.per_client,
            descriptor_limit = tcp.descriptors,
            reserved = tcp.reserve,
            "TCP client connections capped"
        );
    } else {
        tracing::warn!(
            connections = caps.total,
            descriptor_limit = tcp.descriptors,
            reserved = tcp.reserve,
            "the TCP connection cap and the descriptors the agent keeps for upstreams, listeners, reloads and the hand-over exceed the descriptor limit: TCP clients can leave it without descriptors"
        );
    }
}

/// Settings that were accepted but mean something slightly different here, once per load.
fn log_warnings(config: &Config) {
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
}

/// Returns on SIGTERM or SIGINT; SIGHUP asks for a reload.
async fn wait_for_signals(reload: mpsc::Sender<()>) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let mut hup = signal(SignalKind::hangup()).expect("SIGHUP handler");
    loop {
        tokio::select! {
            _ = term.recv() => return,
            _ = int.recv() => return,
            _ = hup.recv() => {
                let _ = reload.try_send(());
            }
        }
    }
}

/// What `--check-config` prints: each server block with where it listens, its upstreams and its
/// cache, one line each; the admin addresses and local IPs; then the warnings a start with this
/// configuration logs (the configuration's and the flags'), and where nodedns's defaults differ
/// from what node-cache would do with it.
pub fn summary(settings: &Settings) -> String {
    use std::fmt::Write;
    let config = &settings.config;
    let mut out = String::new();
    for server in &config.servers {
        let listen: Vec<String> = server
            .listen
            .iter()
            .map(|a| match (server.scheme, &server.tls) {
                (crate::config::Scheme::Dns, _) => a.to_string(),
                (scheme, Some(_)) => format!("{}://{a}", scheme.as_str()),
                (scheme, None) => format!("{}://{a} (without tls)", scheme.as_str()),
            })
            .collect();
        let lines: Vec<String> = server
            .forwards
            .iter()
            .map(|f| {
                let tls =
                    |a: &SocketAddr| f.upstream.tls.as_ref().is_some_and(|t| t.addrs.contains(a));
                let to: Vec<String> = f
                    .upstream
                    .addrs
                    .iter()
                    .map(|a| {
                        if tls(a) {
                            format!("tls://{a}")
                        } else {
                            a.to_string()
                        }
                    })
                    .collect();
                // A line for the whole block reads as before there could be several.
                let from = if f.from == "." {
                    String::new()
                } else {
                    format!("{} ", f.from)
                };
                format!(
                    "forward {from}{:?} to {}",
                    f.upstream.transport,
                    to.join(" ")
                )
            })
            .collect();
        let upstream = if lines.is_empty() {
            "no forward (REFUSED)".to_string()
        } else {
            lines.join(", then ")
        };
        let cache = server.cache.as_ref().map_or_else(
            || "no cache".to_string(),
            |c| format!("cache {} bytes", c.capacity_bytes),
        );
        let _ = writeln!(
            out,
            "{} on {}: {upstream}; {cache}",
            server.zones.join(" "),
            listen.join(" ")
        );
    }
    for (name, addr) in [
        ("health", config.health),
        ("ready", config.ready),
        ("metrics", config.metrics),
        ("node-cache metrics", config.node_cache_metrics),
    ] {
        if let Some(addr) = addr {
            let _ = writeln!(out, "{name} on {addr}");
        }
    }
    for addr in &config.extra_metrics {
        let _ = writeln!(out, "metrics on {addr}");
    }
    if !config.local_ips.is_empty() {
        let ips: Vec<String> = config.local_ips.iter().map(|ip| ip.to_string()).collect();
        let _ = writeln!(out, "local IPs {}", ips.join(" "));
    }
    let warnings: Vec<String> = config
        .warnings
        .iter()
        .cloned()
        .chain(settings.host.warnings())
        .collect();
    if !warnings.is_empty() {
        let _ = writeln!(out, "warnings:");
        for warning in &warnings {
            let _ = writeln!(out, "  {warning}");
        }
    }
    // Each difference once, with every place it applies (the stock Corefile has four blocks
    // alike).
    let mut differences: Vec<(&str, Vec<&str>)> = Vec::new();
    for d in &config.differences {
        match differences.iter_mut().find(|(what, _)| *what == d.what) {
            Some((_, at)) => at.push(&d.at),
            None => differences.push((&d.what, vec![&d.at])),
        }
    }
    if !differences.is_empty() {
        let _ = writeln!(out, "differences from node-cache:");
        for (what, at) in differences {
            let _ = writeln!(out, "  {} ({})", what, at.join(", "));
        }
    }
    out
}
