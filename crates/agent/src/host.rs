//! Host networking glue: the flags, the capability check, and the reconcile loop around
//! `nodedns_hostnet::Host`.
//!
//! node-cache's flag names are accepted as aliases (the config module also rewrites their
//! single-dash Go spelling), and its boolean flags take an optional `=VALUE`
//! (`--setup-interface=false`), as Go's flag package does.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::ArgAction;
use nodedns_hostnet::{Backend, Host, LinkKind, Metrics, Spec, error_chain};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Debug, Clone, clap::Args)]
pub struct HostArgs {
    /// Create and maintain the link holding the local IPs (node-cache `-setupinterface`).
    #[arg(long, alias = "setupinterface", default_value_t = true, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set)]
    pub setup_interface: bool,

    /// Write and maintain the NOTRACK/ACCEPT rules (node-cache `-setupiptables`).
    #[arg(long, alias = "setupiptables", default_value_t = true, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set)]
    pub setup_rules: bool,

    /// On shutdown, leave the link and the rules in place (node-cache `-skipteardown`).
    #[arg(long, alias = "skipteardown", default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set)]
    pub skip_teardown: bool,

    /// Name of the link that holds the local IPs (node-cache `-interfacename`).
    #[arg(long, alias = "interfacename", default_value = nodedns_hostnet::NODE_CACHE_LINK)]
    pub interface_name: String,

    /// Kind of that link: `dummy` (node-cache's), or `bridge` for kernels without the dummy
    /// driver (CONFIG_DUMMY), such as some CI machines.
    #[arg(long, default_value = "dummy")]
    pub link_kind: LinkKind,

    /// How often the link, addresses and rules are re-checked and repaired: a Go duration
    /// (`60s`, `1m30s`, `500ms`) or a bare number of seconds. See [`HostArgs::interval`].
    #[arg(long, default_value = "60s", value_parser = parse_interval)]
    pub sync_interval: Duration,

    /// node-cache's `-syncinterval`, with node-cache's meaning: it multiplies the Go duration
    /// by one second, so `1ns` (the lablabs chart's default) is 1 s and `60s` is 60e9 s
    /// ([`node_cache_interval`]). Wins over --sync-interval's default; both given is an error.
    #[arg(long = "syncinterval", value_name = "DURATION", hide = true,
          value_parser = node_cache_interval, conflicts_with = "sync_interval")]
    pub node_cache_sync_interval: Option<NodeCacheInterval>,

    /// Where the rules go: `auto` (match kube-proxy: nftables if it runs in nftables mode,
    /// else iptables in the node's iptables mode), `nftables`, or `iptables`.
    #[arg(long, default_value = "auto")]
    pub rules_backend: Backend,

    /// No link and no rules at all, just serve (Cilium local redirect policy, where the agent
    /// runs as an ordinary pod and Cilium steers the ClusterIP's traffic to it).
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true",
          action = ArgAction::Set)]
    pub no_setup: bool,
}

/// A Go `time.Duration` string (`1h2m3.5s`, `500ms`, `90s`) or a bare number of seconds
/// (node-cache multiplies its `-syncinterval` by one second). Zero is refused: the loop would spin.
pub fn parse_interval(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let interval = match text.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => crate::config::go_duration(text)?,
    };
    if interval.is_zero() {
        return Err(format!(
            "invalid interval `{text}`: must be more than zero (e.g. 60s)"
        ));
    }
    // Go's limit, and far below where a deadline would overflow the clock.
    if interval > Duration::from_nanos(i64::MAX.unsigned_abs()) {
        return Err(format!(
            "invalid interval `{text}`: at most about 292 years"
        ));
    }
    Ok(interval)
}

/// Why the host plumbing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A capability the setup needs is missing (the message says which).
    #[error(transparent)]
    Capabilities(nodedns_hostnet::CapabilityError),
    /// The link, addresses or rules could not be put in place (the message names what failed,
    /// e.g. a kernel without the dummy driver).
    #[error("host networking setup")]
    Setup(#[source] nodedns_hostnet::Error),
}

/// node-cache's `-syncinterval` as node-cache runs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCacheInterval {
    /// As written on the command line.
    pub written: String,
    /// The period node-cache's ticker gets: the Go duration's count of nanoseconds, in seconds.
    pub period: Duration,
    /// Whether node-cache's multiplication overflowed (and wrapped around) on the way.
    pub wrapped: bool,
    /// Written with a unit (`1ns`, `60s`); a bare number of seconds means what it says.
    pub unit: bool,
}

/// node-cache reads `-syncinterval` with Go's `flag.DurationVar` (`1ns`, `60s`, `1m30s`; a bare
/// number is refused there, except `0`) and runs its ticker every `value * time.Second`:
/// an int64 product of nanoseconds, which wraps around from about 9.22 s on (`60s` gives about
/// 147 years; `10s` a negative period, on which Go's ticker panics). The same here, wrap-around
/// included, so the agent does what the DaemonSet already did; a period node-cache cannot start
/// with is an error. A bare number of seconds (nodedns's extension) means that many seconds,
/// which is also what node-cache's product gives for that many nanoseconds.
pub fn node_cache_interval(text: &str) -> Result<NodeCacheInterval, String> {
    let text = text.trim();
    if text.parse::<u64>().is_ok() {
        return parse_interval(text).map(|period| NodeCacheInterval {
            written: text.to_owned(),
            period,
            wrapped: false,
            unit: false,
        });
    }
    let duration = crate::config::go_duration(text)?;
    let nanos = i64::try_from(duration.as_nanos()).map_err(|_| {
        format!("`{text}` is out of range for node-cache (Go durations end at about 292 years)")
    })?;
    let (product, wrapped) = nanos.overflowing_mul(1_000_000_000);
    if product <= 0 {
        return Err(format!(
            "`{text}` times one second (node-cache multiplies -syncinterval by a second) is not \
             a positive period{}: node-cache does not start with it either. For a check every \
             {text}, write --sync-interval {text}",
            if wrapped {
                " once the product wraps around"
            } else {
                ""
            }
        ));
    }
    Ok(NodeCacheInterval {
        written: text.to_owned(),
        period: Duration::from_nanos(product.unsigned_abs()),
        wrapped,
        unit: true,
    })
}

/// `d` for a log line: seconds, and years when there are many.
fn human(d: Duration) -> String {
    const YEAR: u64 = 365 * 24 * 3600;
    let secs = d.as_secs_f64();
    if d.as_secs() >= YEAR {
        format!("{secs:.0}s (about {} years)", d.as_secs() / YEAR)
    } else {
        format!("{d:?}")
    }
}

impl HostArgs {
    /// The reconcile period: node-cache's `-syncinterval` as node-cache runs it when given,
    /// else --sync-interval.
    pub fn interval(&self) -> Duration {
        self.node_cache_sync_interval
            .as_ref()
            .map_or(self.sync_interval, |n| n.period)
    }

    /// What the flags mean that an operator may not expect, for the log.
    pub fn warnings(&self) -> Vec<String> {
        let Some(n) = self.node_cache_sync_interval.as_ref().filter(|n| n.unit) else {
            return Vec::new();
        };
        let period = human(n.period);
        let written = &n.written;
        if n.wrapped {
            vec![format!(
                "-syncinterval {written}: node-cache multiplies this flag by one second and the \
                 product wraps around to {period}, so the link and rules are in practice never \
                 re-checked, by node-cache or by nodedns. For a check every {written}, write \
                 --sync-interval {written}"
            )]
        } else {
            vec![format!(
                "-syncinterval {written}: node-cache multiplies this flag by one second, so it \
                 means {period}, and nodedns re-checks the link and rules every {period} too. \
                 --sync-interval {period} says so plainly"
            )]
        }
    }
}

/// The running host plumbing and its reconcile loop.
#[derive(Debug)]
pub struct HostHandle {
    host: Arc<Host>,
    stop: watch::Sender<bool>,
    reconcile: JoinHandle<()>,
    skip_teardown: bool,
}

/// Sets up the host networking for `local_ips` and starts the reconcile loop. Does nothing
/// (`Ok(None)`) when `local_ips` is empty or with `--no-setup`, or when both the link and the
/// rules are switched off. Fails when a capability is missing or setup fails (the error names
/// what failed, e.g. a kernel without the dummy driver).
pub async fn start(
    args: &HostArgs,
    local_ips: &[IpAddr],
    health_port: Option<u16>,
    metrics: &Metrics,
) -> Result<Option<HostHandle>, Error> {
    if local_ips.is_empty() || args.no_setup || !(args.setup_interface || args.setup_rules) {
        tracing::info!("host networking: no setup (no local IPs, or --no-setup)");
        return Ok(None);
    }
    for warning in args.warnings() {
        tracing::warn!("{warning}");
    }
    nodedns_hostnet::check_capabilities().map_err(Error::Capabilities)?;
    let spec = Spec {
        link_name: args.interface_name.clone(),
        link_kind: args.link_kind,
        health_port,
        backend: args.rules_backend,
        setup_link: args.setup_interface,
        setup_rules: args.setup_rules,
        ..Spec::new(local_ips.to_vec())
    };
    let host = Host::setup(spec, metrics).await.map_err(Error::Setup)?;
    tracing::info!(
        link = %args.interface_name,
        ips = ?local_ips,
        rules = %host.ruleset().map_or("not managed".to_owned(), |r| r.to_string()),
        interval = ?args.interval(),
        "host networking ready"
    );
    let host = Arc::new(host);
    let (stop, stopped) = watch::channel(false);
    let reconcile = tokio::spawn(reconcile_loop(host.clone(), args.interval(), stopped));
    Ok(Some(HostHandle {
        host,
        stop,
        reconcile,
        skip_teardown: args.skip_teardown,
    }))
}

async fn reconcile_loop(host: Arc<Host>, interval: Duration, mut stopped: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopped.changed() => return,
        }
        // Failures are counted by kind inside; repairs are logged there too.
        if let Err(e) = host.reconcile().await {
            tracing::warn!(error = %error_chain(&e), "host networking check failed");
        }
    }
}

impl HostHandle {
    /// Step 1 of shutdown: withdraws the rules for the service IPs (the kube-dns ClusterIP), so
    /// new queries go through kube-proxy to CoreDNS while we still answer what already arrived.
    /// The reconcile loop keeps running and keeps them withdrawn. Skipped with
    /// `--skip-teardown`, which leaves everything as it is.
    pub async fn withdraw(&self) {
        if self.skip_teardown {
            return;
        }
        match self.host.withdraw_service_ips().await {
            Ok(()) => tracing::info!("service-IP rules withdrawn"),
            Err(e) => tracing::error!(error = %error_chain(&e), "withdrawing service-IP rules"),
        }
    }

    /// Stops the reconcile loop and leaves the link and the rules as they are: another
    /// instance on the node serves (it took the listening sockets over) and maintains them.
    pub async fn release(self) {
        let _ = self.stop.send(true);
        let _ = self.reconcile.await;
    }

    /// Last step of shutdown: stops the reconcile loop, then (unless `--skip-teardown`)
    /// removes the remaining rules and the link.
    pub async fn teardown(self) {
        let _ = self.stop.send(true);
        let _ = self.reconcile.await;
        if self.skip_teardown {
            tracing::info!("--skip-teardown: leaving the link and rules in place");
            return;
        }
        let Some(host) = Arc::into_inner(self.host) else {
            tracing::error!("host networking still in use; not tearing down");
            return;
        };
        match host.teardown().await {
            Ok(()) => tracing::info!("host networking removed"),
            Err(e) => tracing::error!(error = %error_chain(&e), "tearing down host networking"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        host: HostArgs,
    }

    fn parse(args: &[&str]) -> HostArgs {
        Cli::try_parse_from(std::iter::once("nodedns").chain(args.iter().copied()))
            .unwrap()
            .host
    }

    #[test]
    fn defaults_are_node_caches() {
        let a = parse(&[]);
        assert!(a.setup_interface && a.setup_rules && !a.skip_teardown && !a.no_setup);
        assert_eq!(a.interface_name, "nodelocaldns");
        assert_eq!(a.link_kind, LinkKind::Dummy);
        assert_eq!(a.interval(), Duration::from_secs(60));
        assert_eq!(a.rules_backend, Backend::Auto);
    }

    #[test]
    fn boolean_flags_take_an_optional_go_style_value() {
        let a = parse(&[
            "--setup-interface=false",
            "--skip-teardown",
            "--setup-rules",
            "false",
        ]);
        assert!(!a.setup_interface && a.skip_teardown && !a.setup_rules);
        let a = parse(&[
            "--setupinterface=false",
            "--setupiptables=true",
            "--skipteardown=false",
        ]);
        assert!(!a.setup_interface && a.setup_rules && !a.skip_teardown);
        assert!(parse(&["--no-setup"]).no_setup);
        assert!(!parse(&["--no-setup=false"]).no_setup);
    }

    #[test]
    fn node_cache_names_and_ours_both_set_the_link_and_interval() {
        let a = parse(&[
            "--interfacename",
            "nl",
            "--syncinterval",
            "30ns",
            "--link-kind",
            "bridge",
        ]);
        assert_eq!(a.interface_name, "nl");
        assert_eq!(a.interval(), Duration::from_secs(30));
        assert_eq!(a.link_kind, LinkKind::Bridge);
        let a = parse(&["--rules-backend", "nftables", "--sync-interval", "1s"]);
        assert_eq!(a.rules_backend, Backend::Nftables);
        assert_eq!(a.interval(), Duration::from_secs(1));
        assert!(a.warnings().is_empty());
        assert!(Cli::try_parse_from(["nodedns", "--link-kind", "veth"]).is_err());
        assert!(Cli::try_parse_from(["nodedns", "--rules-backend", "ipvs"]).is_err());
    }

    #[test]
    fn node_cache_syncinterval_is_multiplied_by_a_second_as_node_cache_does() {
        // The lablabs chart's default: 1 s to node-cache, and to nodedns, with a warning.
        let a = parse(&["--syncinterval", "1ns"]);
        assert_eq!(a.interval(), Duration::from_secs(1));
        let warnings = a.warnings();
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].starts_with(
                "-syncinterval 1ns: node-cache multiplies this flag by one second, so it means 1s"
            ),
            "{warnings:?}"
        );
        assert_eq!(
            parse(&["--syncinterval=250us"]).interval(),
            Duration::from_secs(250_000)
        );
        // nodedns's own spelling keeps its meaning.
        let a = parse(&["--sync-interval", "1ns"]);
        assert_eq!(a.interval(), Duration::from_nanos(1));
        assert!(a.warnings().is_empty());
        // A bare number is seconds in both spellings (what node-cache's product gives for
        // that many nanoseconds), and needs no warning.
        let a = parse(&["--syncinterval", "60"]);
        assert_eq!(a.interval(), Duration::from_secs(60));
        assert!(a.warnings().is_empty());
        // Without the flag: --sync-interval's default.
        assert_eq!(parse(&[]).interval(), Duration::from_secs(60));
    }

    #[test]
    fn node_cache_syncinterval_wraps_around_as_go_int64_does() {
        // 60e9 ns × 1e9 wraps to about 147 years: node-cache never re-checks, and says nothing.
        let a = parse(&["--syncinterval", "60s"]);
        let wrapped = 60_000_000_000_i64.wrapping_mul(1_000_000_000);
        assert_eq!(a.interval(), Duration::from_nanos(wrapped.unsigned_abs()));
        assert!(a.interval() > Duration::from_secs(100 * 365 * 24 * 3600));
        let warnings = a.warnings();
        assert!(
            warnings[0].contains("wraps around") && warnings[0].contains("--sync-interval 60s"),
            "{warnings:?}"
        );
        // 10 s and 1m30s wrap to a negative period, on which node-cache's ticker panics.
        for text in ["10s", "1m30s"] {
            let err = node_cache_interval(text).unwrap_err();
            assert!(
                err.contains("not a positive period once the product wraps around"),
                "{err}"
            );
            assert!(err.contains(&format!("--sync-interval {text}")), "{err}");
        }
        for bad in ["0", "0s", "-1ns", "1d", "2562048h"] {
            assert!(node_cache_interval(bad).is_err(), "{bad}");
        }
        // Both spellings at once: which one meant what is unclear, so clap refuses.
        let both = ["nodedns", "--sync-interval", "5s", "--syncinterval", "5ns"];
        assert!(Cli::try_parse_from(both).is_err());
    }

    #[test]
    fn intervals_are_go_durations_or_bare_seconds() {
        assert_eq!(parse_interval("60"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_interval("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_interval("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_interval("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_interval("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_interval("1.5s"), Ok(Duration::from_millis(1500)));
        for bad in [
            "",
            "0",
            "0s",
            "s",
            "10x",
            "1m30",
            "-1s",
            "1e400s",
            "..s",
            "🦀",
            "2562048h",
            "18446744073709551615",
        ] {
            assert!(parse_interval(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn nothing_is_set_up_without_local_ips_or_with_no_setup() {
        let metrics = Metrics::default();
        assert!(
            start(&parse(&[]), &[], None, &metrics)
                .await
                .unwrap()
                .is_none()
        );
        let ips = ["169.254.20.10".parse().unwrap()];
        assert!(
            start(&parse(&["--no-setup"]), &ips, None, &metrics)
                .await
                .unwrap()
                .is_none()
        );
        let off = parse(&["--setup-interface=false", "--setup-rules=false"]);
        assert!(start(&off, &ips, None, &metrics).await.unwrap().is_none());
    }
}
