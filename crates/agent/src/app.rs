//! `nodedns run`: assembles the agent from a [`Config`] and runs it until a signal.
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

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use nodedns_cache::{Cache, Flights};
use nodedns_upstream::Group;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use crate::admin::{self, Readiness};
use crate::cli::RunArgs;
use crate::config::{self, Config};
use crate::handoff::{self, Generation, Handoff, Listeners};
use crate::host;
use crate::logging;
use crate::metrics::{self, Metrics};
use crate::serve::{self, Shared, Snapshot, Zone, tcp};

/// Everything the admin endpoints read.
#[derive(Debug)]
struct State {
    shared: Arc<Shared>,
    /// Every metric: the crates' and the agent's ([`metrics::Exposition`]).
    registry: Registry,
    readiness: Readiness,
    log: Arc<logging::Handle>,
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
}

/// Builds the data-path snapshot for `config`. Blocks whose zones, cache policy and `forward` are
/// unchanged from `previous` keep their cache (and its in-flight fetches); a block whose
/// upstreams changed starts with an empty one, so it never answers from what the old upstreams
/// said. Unchanged upstreams keep their pools. Each block's metric label slots come from `metrics`.
pub fn build_snapshot(
    config: Arc<Config>,
    previous: Option<&Snapshot>,
    upstream_metrics: &nodedns_upstream::Metrics,
    metrics: &Metrics,
) -> anyhow::Result<Snapshot> {
    let mut zones = Vec::with_capacity(config.servers.len());
    for server in &config.servers {
        let label = metrics.zone_slots(&server.zones);
        let same = |z: &&Arc<Zone>| z.server.zones == server.zones;
        let old = previous.and_then(|p| p.zones.iter().find(same));
        let (cache, flights) = match (old, &server.cache) {
            (Some(old), Some(policy))
                if old.server.cache.as_ref() == Some(policy)
                    && old.server.forward == server.forward
                    && old.cache.is_some() =>
            {
                (old.cache.clone(), old.flights.clone())
            }
            (_, Some(policy)) => (
                Some(Arc::new(Cache::new(policy.clone()))),
                Arc::new(Flights::new(serve::MAX_WAITERS_PER_KEY)),
            ),
            (_, None) => (None, Arc::new(Flights::new(serve::MAX_WAITERS_PER_KEY))),
        };
        let group = match (&server.forward, old) {
            (Some(forward), Some(old))
                if old.server.forward.as_ref().map(|f| &f.upstream) == Some(&forward.upstream) =>
            {
                old.group.clone()
            }
            (Some(forward), _) => Some(Arc::new(
                Group::new(forward.upstream.clone(), upstream_metrics)
                    .with_context(|| format!("forward of {}", server.zones.join(" ")))?,
            )),
            (None, _) => None,
        };
        zones.push(Arc::new(Zone {
            label,
            cache,
            flights,
            group,
            server: server.clone(),
        }));
    }
    let router = config::Router::new(&config.servers);
    Ok(Snapshot {
        config,
        router,
        zones,
    })
}

/// Every address DNS is served on.
fn listen_addrs(config: &Config) -> BTreeSet<SocketAddr> {
    config
        .servers
        .iter()
        .flat_map(|s| s.listen.iter().copied())
        .collect()
}

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(args: RunArgs, config: Config, log: Arc<logging::Handle>) -> anyhow::Result<()> {
    logging::spawn_signal_handler(log.clone());
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut registry = Registry::default();
    let upstream_metrics = nodedns_upstream::Metrics::register(&mut registry);
    let host_metrics = nodedns_hostnet::Metrics::register(&mut registry);

    let health_port = config.health.map(|a| a.port());
    let host = host::start(&args.host, &config.local_ips, health_port, &host_metrics).await?;

    log_warnings(&config);
    let drain = config
        .lameduck
        .map_or(args.drain, |lameduck| lameduck.max(args.drain));
    let config = Arc::new(config);
    let dns_addrs = listen_addrs(&config);
    let metrics = Arc::new(Metrics::new(
        &dns_addrs.iter().copied().collect::<Vec<_>>(),
        metrics::Options {
            counting: !args.no_metrics,
            log_queries: args.query_log,
            log_sample: args.query_log_sample,
        },
    ));
    let snapshot = build_snapshot(config.clone(), None, &upstream_metrics, &metrics)?;
    let shared = Arc::new(Shared::new(snapshot, metrics));
    registry.register_collector(Box::new(metrics::Exposition::new(shared.clone())));

    // Listeners: taken over from the instance serving on this node (an upgrade), or bound here.
    // Everything is bound before anything is served, so a bad address fails start-up whole.
    let (mut handoff, inherited) = Handoff::start(args.handoff_dir.as_deref()).await?;
    let connections = Arc::new(tcp::Connections::new(
        args.tcp_max_connections,
        args.tcp_max_connections_per_client,
    ));
    let limits = tcp::Limits {
        idle_timeout: args.tcp_idle_timeout,
        ..tcp::Limits::default()
    };
    let state = Arc::new(State {
        shared: shared.clone(),
        registry,
        readiness: Readiness::default(),
        log,
    });
    let cli_mode = args.config.conf.is_none() && args.config.basecorefile.is_none();
    let admin_addrs = admin::addresses(&config, cli_mode);
    let (mut listeners, opened) = Listeners::open(&dns_addrs, &admin_addrs, threads, inherited)?;
    let mut generation = Some(Generation::spawn(
        &listeners,
        &shared,
        &state,
        limits,
        &connections,
    )?);
    handoff.serving().await?;
    for addr in &dns_addrs {
        tracing::info!(%addr, "serving DNS (UDP, TCP)");
    }
    for addr in &admin_addrs {
        tracing::info!(%addr, "serving /health, /ready, /metrics");
    }
    if opened.inherited > 0 {
        tracing::info!(
            inherited = opened.inherited,
            bound = opened.bound,
            unused = opened.unused,
            "took the listening sockets over from the running instance"
        );
    }

    // Readiness: listeners and rules are up; wait for one upstream answer per block.
    {
        let state = state.clone();
        tokio::spawn(async move {
            let snap = state.shared.snapshot.load_full();
            for zone in &snap.zones {
                if let Some(group) = &zone.group {
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

    // The `loop` directive (serve::loopcheck): the zones of the configuration at start are
    // probed for a forwarding loop, and those of every configuration a reload applies. A loop at
    // start stops the agent: the task ends only with that verdict. A loop in a reloaded
    // configuration undoes the reload, as any other bad configuration is refused.
    let (applied_tx, mut applied_rx) = mpsc::unbounded_channel::<Applied>();
    let mut loop_check = {
        let shared = shared.clone();
        let host_metrics = host_metrics.clone();
        tokio::spawn(async move {
            let targets = serve::loopcheck::targets(&shared.snapshot.load());
            if let Some(found) = serve::loopcheck::check(&shared.loops, targets).await {
                return found;
            }
            while let Some(applied) = applied_rx.recv().await {
                let targets = serve::loopcheck::targets(&applied.current);
                if let Some(found) = serve::loopcheck::check(&shared.loops, targets).await {
                    undo_reload(&shared, &host_metrics, applied, &found);
                }
            }
            std::future::pending().await
        })
    };
    let mut looped = None;

    // Reload: file changes and SIGHUP both lead here.
    let (reload_tx, mut reload_rx) = mpsc::channel::<()>(1);
    tokio::spawn(config::watch(args.config.clone(), reload_tx.clone()));
    {
        let shared = shared.clone();
        let args_config = args.config.clone();
        let upstream_metrics = upstream_metrics.clone();
        let host_metrics = host_metrics.clone();
        tokio::spawn(async move {
            while reload_rx.recv().await.is_some() {
                if let Some(applied) =
                    reload(&shared, &args_config, &upstream_metrics, &host_metrics)
                {
                    // Only the loop check's end closes the channel.
                    let _ = applied_tx.send(applied);
                }
            }
        });
    }

    // Until a signal: hand the sockets to a new instance, or serve them again when it leaves.
    let mut host = host;
    let signals = wait_for_signals(reload_tx);
    tokio::pin!(signals);
    loop {
        let event = tokio::select! {
            _ = &mut signals => break,
            found = &mut loop_check, if looped.is_none() => match found {
                Ok(found) => {
                    tracing::error!("{found}");
                    looped = Some(Ok(found));
                    break;
                }
                Err(err) => {
                    tracing::warn!(%err, "the loop check failed");
                    looped = Some(Err(()));
                    continue;
                }
            },
            event = handoff.next() => event,
        };
        match event {
            handoff::Event::Successor(link) => match handoff.hand_over(link, &listeners).await {
                Ok(pid) => {
                    // It reads every socket now: stop reading (answering what was read) and
                    // leave the host to it. Idle until SIGTERM: exiting would make the kubelet
                    // restart this container, which would take the sockets back.
                    if let Some(generation) = generation.take() {
                        generation.stop().await;
                    }
                    if let Some(host) = host.take() {
                        host.release().await;
                    }
                    tracing::info!(pid, "handed the listening sockets over; idle until SIGTERM");
                }
                Err(err) => tracing::warn!(%err, "still serving"),
            },
            handoff::Event::TakeBack | handoff::Event::SuccessorLost => {
                let sockets = if matches!(event, handoff::Event::TakeBack) {
                    handoff.take_back().await
                } else {
                    tracing::warn!("the instance serving the sockets is gone; serving them again");
                    Vec::new()
                };
                let sockets = if sockets.is_empty() {
                    listeners.try_clone()?.into_sockets()
                } else {
                    sockets
                };
                listeners = Listeners::open(&dns_addrs, &admin_addrs, threads, sockets)?.0;
                generation = Some(Generation::spawn(
                    &listeners,
                    &shared,
                    &state,
                    limits,
                    &connections,
                )?);
                handoff.resumed().await?;
                tracing::info!("serving the listening sockets again");
                host = host::start(&args.host, &config.local_ips, health_port, &host_metrics)
                    .await
                    .inspect_err(|err| tracing::error!("{err:#}"))
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
    }

    // Shutdown, in the order that never leaves a pod without an answer. Only the last instance
    // on the node touches the host plumbing: an idle one (it handed over) or one that handed
    // the sockets back leaves it to the instance that serves.
    tracing::info!("shutting down");
    state.readiness.drain();
    let last = match &generation {
        None => {
            handoff.bye().await;
            false
        }
        // A new instance that connected meanwhile gets the sockets (it then serves, and this
        // one leaves the host to it); otherwise the one this instance took over from, if any.
        Some(_) => match handoff.try_accept() {
            Some(link) => match handoff.hand_over(link, &listeners).await {
                Ok(pid) => {
                    tracing::info!(pid, "handed the listening sockets over while shutting down");
                    handoff.bye().await;
                    false
                }
                Err(err) => {
                    tracing::warn!(%err, "hand-over while shutting down");
                    !handoff.give_back(&listeners).await
                }
            },
            None => !handoff.give_back(&listeners).await,
        },
    };
    // From here on no instance can take over from this one: a new one binds its own sockets.
    handoff.close();
    if last {
        if let Some(host) = &host {
            host.withdraw().await;
        }
        tokio::time::sleep(drain).await;
    } else {
        tracing::info!("another instance serves: leaving the host networking in place");
    }
    shared.stop();
    if let Some(generation) = generation {
        generation.stop().await;
    }
    // Misses still in flight get their answers (the upstream deadline bounds the wait).
    shared.wait_idle(Duration::from_secs(3)).await;
    if let Some(host) = host {
        if last {
            host.teardown().await;
        } else {
            host.release().await;
        }
    }
    loop_check.abort();
    tracing::info!("stopped");
    match looped {
        Some(Ok(found)) => Err(anyhow::anyhow!(
            "exiting: forwarding loop in zone `{}` (see above)",
            found.zone
        )),
        Some(Err(())) | None => Ok(()),
    }
}

/// Loads the configuration again and, if it is valid, publishes it. A bad configuration keeps
/// the running one and is counted twice, as node-cache counts it: `coredns_reload_failed_total`
/// and the `configmap` setup error.
fn reload(
    shared: &Shared,
    args: &config::ConfigArgs,
    upstream_metrics: &nodedns_upstream::Metrics,
    host_metrics: &nodedns_hostnet::Metrics,
) -> Option<Applied> {
    let current = shared.snapshot.load_full();
    let config = match config::load(args) {
        Ok(config) => config,
        Err(err) => {
            reload_failed(shared, host_metrics);
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
    match build_snapshot(
        Arc::new(config),
        Some(&current),
        upstream_metrics,
        &shared.metrics,
    ) {
        Ok(snapshot) => {
            let snapshot = Arc::new(snapshot);
            shared.snapshot.store(snapshot.clone());
            tracing::info!("configuration reloaded");
            Some(Applied {
                previous: current,
                current: snapshot,
            })
        }
        Err(err) => {
            reload_failed(shared, host_metrics);
            tracing::error!(err = %format!("{err:#}"), "reload failed; keeping the running configuration");
            None
        }
    }
}

/// A configuration a reload applied, and the one it replaced.
struct Applied {
    previous: Arc<Snapshot>,
    current: Arc<Snapshot>,
}

/// A bad configuration was refused: counted as node-cache and CoreDNS count it.
fn reload_failed(shared: &Shared, host_metrics: &nodedns_hostnet::Metrics) {
    shared.metrics.reload_failed();
    host_metrics.setup_error(nodedns_hostnet::ErrorKind::Configmap);
}

/// The loop check found `found` in the configuration `applied` put in place: the one it replaced
/// serves again, unless a later reload replaced it already (that one is checked in turn).
fn undo_reload(
    shared: &Shared,
    host_metrics: &nodedns_hostnet::Metrics,
    applied: Applied,
    found: &serve::loopcheck::Loop,
) {
    let was = shared
        .snapshot
        .compare_and_swap(&applied.current, applied.previous);
    if !Arc::ptr_eq(&was, &applied.current) {
        tracing::error!("{found}. A later reload replaced that configuration already");
        return;
    }
    reload_failed(shared, host_metrics);
    tracing::error!("{found}. The reload is undone: the previous configuration serves again");
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
/// cache, one line each.
pub fn summary(config: &Config) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for server in &config.servers {
        let listen: Vec<String> = server.listen.iter().map(|a| a.to_string()).collect();
        let upstream = server.forward.as_ref().map_or_else(
            || "no forward (REFUSED)".to_string(),
            |f| {
                let to: Vec<String> = f.upstream.addrs.iter().map(|a| a.to_string()).collect();
                format!("forward {:?} to {}", f.upstream.transport, to.join(" "))
            },
        );
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
    ] {
        if let Some(addr) = addr {
            let _ = writeln!(out, "{name} on {addr}");
        }
    }
    if !config.local_ips.is_empty() {
        let ips: Vec<String> = config.local_ips.iter().map(|ip| ip.to_string()).collect();
        let _ = writeln!(out, "local IPs {}", ips.join(" "));
    }
    out
}
