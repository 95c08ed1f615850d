//! Linux host plumbing for nodedns: the link that holds the node-local addresses, the rules that
//! keep DNS traffic to and from them out of conntrack, and keeping both in place.
//!
//! This is the only privileged code of nodedns. It knows nothing of DNS: it is given addresses
//! and ports and makes the kernel deliver packets for them locally, untracked.
//!
//! - `link`: a link (`nodelocaldns`, kind `dummy`) holding every local IP as /32 or /128, over
//!   rtnetlink, IPv4 and IPv6 together.
//! - `rules`: node-cache's NOTRACK/ACCEPT rule set per local IP, written by one of two
//!   backends chosen to match the node: `nft` (one `table inet nodedns`, replaced in one
//!   transaction) or `iptables` (chains of our own, `iptables-restore --noflush`, jumps at the
//!   top of the built-in chains).
//! - [`Host`]: setup (adopting what a previous node-cache or nodedns left behind), periodic
//!   [`Host::reconcile`], and the two-step shutdown: [`Host::withdraw_service_ips`] first (pods
//!   fall back to kube-proxy → CoreDNS while we still answer what arrived), [`Host::teardown`]
//!   last.
//!
//! Invariants: every rule carries a comment naming nodedns; we only ever delete rules we can
//! name exactly (our own chains and jumps, node-cache's commented rules); a failure is counted in
//! `coredns_nodecache_setup_errors_total{errortype}` with node-cache's label values and never
//! panics.
//!
//! This crate must never parse DNS, bind sockets, or decide *which* addresses to serve (the
//! agent does).

mod caps;
mod error;
mod exec;
mod iptables;
mod link;
mod metrics;
mod nft;
mod rules;

use std::collections::BTreeMap;
use std::net::IpAddr;

pub use caps::check_capabilities;
pub use error::{CapabilityError, CommandError, Error};
pub use iptables::Mode as IptablesMode;
pub use metrics::{ErrorKind, Metrics, Outcome, RepairKind};
pub use rules::is_service_ip;

use iptables::Family;
use tokio::sync::Mutex;

/// The link name node-cache uses: a link of that name and kind `dummy`, holding only our
/// addresses, is node-cache's leftover and is removed when ours has another name.
pub const NODE_CACHE_LINK: &str = "nodelocaldns";

/// The kind of link created to hold the local IPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkKind {
    /// What node-cache uses. Needs the kernel's `dummy` driver (CONFIG_DUMMY).
    #[default]
    Dummy,
    /// For kernels without the dummy driver (some CI and test machines): a bridge with no ports
    /// delivers its addresses locally just the same.
    Bridge,
}

impl LinkKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LinkKind::Dummy => "dummy",
            LinkKind::Bridge => "bridge",
        }
    }
}

impl std::fmt::Display for LinkKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LinkKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "dummy" => Ok(LinkKind::Dummy),
            "bridge" => Ok(LinkKind::Bridge),
            other => Err(format!("unknown link kind `{other}` (dummy|bridge)")),
        }
    }
}

/// Which rules backend to use (`--rules-backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// Match the node: nftables when kube-proxy runs in nftables mode (its `table ip kube-proxy`
    /// or `table ip6 kube-proxy` exists), else iptables in the mode the node's rules use (as
    /// kube-proxy's iptables wrapper decides), else nftables if only `nft` is installed.
    #[default]
    Auto,
    Nftables,
    Iptables,
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Backend::Auto),
            "nftables" | "nft" => Ok(Backend::Nftables),
            "iptables" => Ok(Backend::Iptables),
            other => Err(format!(
                "unknown rules backend `{other}` (auto|nftables|iptables)"
            )),
        }
    }
}

/// Where the rules live once a backend is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ruleset {
    /// `table inet nodedns`.
    Nftables,
    /// Chains `NODEDNS-*` in the raw and filter tables, through `iptables-<mode>-restore`.
    Iptables(IptablesMode),
}

impl std::fmt::Display for Ruleset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ruleset::Nftables => f.write_str("nftables (table inet nodedns)"),
            Ruleset::Iptables(mode) => write!(f, "iptables ({mode} mode, chains NODEDNS-*)"),
        }
    }
}

/// What to set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// Name of the link that holds the local IPs (node-cache `-interfacename`).
    pub link_name: String,
    pub link_kind: LinkKind,
    /// The local IPs (node-cache `-localip`): the link-local address and, in iptables/nftables
    /// mode, the kube-dns ClusterIP. IPv4 and IPv6 may be mixed.
    pub ips: Vec<IpAddr>,
    /// The DNS port the rules cover (53).
    pub dns_port: u16,
    /// The health-check port whose probe traffic also skips conntrack (node-cache
    /// `-health-port`); `None` for no health rules.
    pub health_port: Option<u16>,
    pub backend: Backend,
    /// Create and maintain the link (node-cache `-setupinterface`).
    pub setup_link: bool,
    /// Write and maintain the rules (node-cache `-setupiptables`).
    pub setup_rules: bool,
}

impl Spec {
    /// node-cache's defaults for `ips`: link `nodelocaldns` of kind dummy, port 53, no health
    /// port, backend auto, link and rules both managed.
    pub fn new(ips: Vec<IpAddr>) -> Spec {
        Spec {
            link_name: NODE_CACHE_LINK.to_owned(),
            link_kind: LinkKind::Dummy,
            ips,
            dns_port: 53,
            health_port: None,
            backend: Backend::Auto,
            setup_link: true,
            setup_rules: true,
        }
    }

    /// Address families in use, each once.
    fn families(&self) -> Vec<Family> {
        let mut families: Vec<Family> = self.ips.iter().map(|ip| Family::of(*ip)).collect();
        families.sort();
        families.dedup();
        families
    }
}

/// One thing that was found missing, displaced or left over, and fixed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    /// The link was created (or re-created with the wanted kind).
    Link,
    /// The link was down and has been set up.
    LinkUp,
    AddressAdded(IpAddr),
    /// An address that is not one of ours was on our link.
    AddressRemoved(IpAddr),
    /// Our rules were (re)written: some were missing or changed.
    Rules,
    /// A jump to our chains was missing, duplicated or no longer first (iptables backend).
    Jump,
    /// This many of node-cache's rules were removed.
    NodeCacheRules(usize),
    /// node-cache's link (differently named from ours) was removed.
    NodeCacheLink,
}

impl Repair {
    pub fn kind(self) -> RepairKind {
        match self {
            Repair::Link | Repair::LinkUp | Repair::NodeCacheLink => RepairKind::Link,
            Repair::AddressAdded(_) | Repair::AddressRemoved(_) => RepairKind::Address,
            Repair::Rules | Repair::NodeCacheRules(_) => RepairKind::Rules,
            Repair::Jump => RepairKind::Jump,
        }
    }
}

/// What one [`Host::reconcile`] pass changed (empty when all was in place).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub repairs: Vec<Repair>,
}

/// Mutable state, behind one lock so that reconcile, withdraw and teardown never interleave.
#[derive(Debug, Default)]
struct State {
    /// Service-IP rules have been withdrawn (shutdown has begun): reconcile must not restore them.
    withdrawn: bool,
    /// nft's listing of our table right after our last write.
    nft: Option<String>,
    /// iptables-save's view of our chains right after our last write, per family.
    iptables: BTreeMap<Family, iptables::Fingerprint>,
}

/// The host plumbing, set up. Dropping it leaves everything in place (like `--skip-teardown`);
/// [`Host::teardown`] removes it.
#[derive(Debug)]
pub struct Host {
    spec: Spec,
    ruleset: Option<Ruleset>,
    netlink: Option<link::Netlink>,
    metrics: Metrics,
    state: Mutex<State>,
}

impl Host {
    /// Chooses the backend, removes what a previous node-cache (or a nodedns with another
    /// backend) left behind, then creates the link with its addresses and writes the rules.
    /// Idempotent: re-running it on a node where everything exists repairs what differs and
    /// duplicates nothing. Must run inside a tokio runtime.
    pub async fn setup(spec: Spec, metrics: &Metrics) -> Result<Host, Error> {
        let counted = |e: Error| {
            metrics.setup_error(e.kind());
            e
        };
        let ruleset = if spec.setup_rules {
            Some(choose_ruleset(spec.backend).await.map_err(counted)?)
        } else {
            None
        };
        let netlink = if spec.setup_link {
            Some(link::Netlink::open().map_err(counted)?)
        } else {
            None
        };
        let host = Host {
            spec,
            ruleset,
            netlink,
            metrics: metrics.clone(),
            state: Mutex::new(State::default()),
        };
        tracing::info!(
            link = %host.spec.link_name,
            kind = %host.spec.link_kind,
            ips = ?host.spec.ips,
            rules = ?host.ruleset.map(|r| r.to_string()),
            "setting up host networking"
        );
        host.adopt().await;
        let mut state = host.state.lock().await;
        if let Some(netlink) = &host.netlink {
            let mut done = Vec::new();
            netlink
                .ensure(
                    &host.spec.link_name,
                    host.spec.link_kind,
                    &host.spec.ips,
                    &mut |r| done.push(r),
                )
                .await
                .map_err(counted)?;
            tracing::debug!(?done, "link ready");
        }
        if host.ruleset.is_some() {
            let mut done = Vec::new();
            host.write_rules(&mut state, true, &mut |r| done.push(r))
                .await
                .map_err(counted)?;
            tracing::debug!(?done, "rules written");
        }
        drop(state);
        Ok(host)
    }

    /// The spec this host was set up with.
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// Where the rules live (`None` when rules are not managed).
    pub fn ruleset(&self) -> Option<Ruleset> {
        self.ruleset
    }

    /// Re-checks the link, its addresses and the rules, and restores whatever is missing,
    /// changed, or (iptables) no longer first in its chain. Every part is attempted; each
    /// failure is counted by kind and logged; the first is returned.
    pub async fn reconcile(&self) -> Result<Report, Error> {
        let mut state = self.state.lock().await;
        let mut report = Report::default();
        let mut errors = Vec::new();
        // Each repair is counted and logged as soon as it is made, not at the end of the pass:
        // whoever sees the host restored (the link back, say, while the rules are still being
        // checked) sees it counted, and a pass that fails half-way still counts what it did.
        let metrics = &self.metrics;
        let mut made = |repair: Repair| {
            metrics.repaired(repair.kind());
            tracing::info!(?repair, "host networking restored");
            report.repairs.push(repair);
        };
        if let Some(netlink) = &self.netlink {
            if let Err(e) = netlink
                .ensure(
                    &self.spec.link_name,
                    self.spec.link_kind,
                    &self.spec.ips,
                    &mut made,
                )
                .await
            {
                errors.push(e);
            }
        }
        if self.ruleset.is_some() {
            if let Err(e) = self.write_rules(&mut state, false, &mut made).await {
                errors.push(e);
            }
        }
        drop(state);
        let outcome = match (errors.is_empty(), report.repairs.is_empty()) {
            (false, _) => Outcome::Failed,
            (true, false) => Outcome::Repaired,
            (true, true) => Outcome::Ok,
        };
        self.metrics.reconciled(outcome);
        let mut errors = errors.into_iter();
        match errors.next() {
            None => Ok(report),
            Some(first) => {
                self.metrics.setup_error(first.kind());
                for other in errors {
                    self.metrics.setup_error(other.kind());
                    tracing::warn!(error = %error_chain(&other), "host networking check failed");
                }
                Err(first)
            }
        }
    }

    /// First step of shutdown: removes the rules for the service IPs (see [`is_service_ip`]),
    /// so that new queries to the kube-dns ClusterIP are conntracked and DNATed to CoreDNS
    /// again, while the link-local rules and every address stay (in-flight queries still get
    /// their answers). Later reconciles keep them withdrawn.
    pub async fn withdraw_service_ips(&self) -> Result<(), Error> {
        let mut state = self.state.lock().await;
        state.withdrawn = true;
        if self.ruleset.is_none() {
            return Ok(());
        }
        self.write_rules(&mut state, true, &mut |_| {})
            .await
            .inspect_err(|e| self.metrics.setup_error(e.kind()))
    }

    /// Last step of shutdown: removes the remaining rules, then the link. Every part is
    /// attempted; the first failure is returned.
    pub async fn teardown(self) -> Result<(), Error> {
        let _state = self.state.lock().await;
        let mut errors = Vec::new();
        match self.ruleset {
            Some(Ruleset::Nftables) => {
                if let Err(e) = nft::delete().await {
                    errors.push(e);
                }
            }
            Some(Ruleset::Iptables(mode)) => {
                for family in self.spec.families() {
                    if let Err(e) = iptables::teardown(mode, family).await {
                        errors.push(e);
                    }
                }
            }
            None => {}
        }
        if let Some(netlink) = &self.netlink {
            let name = &self.spec.link_name;
            match netlink.find(name).await {
                Ok(Some(link)) => {
                    if let Err(e) = netlink.delete(name, link.index).await {
                        errors.push(e);
                    }
                }
                Ok(None) => {}
                Err(e) => errors.push(e),
            }
        }
        for e in &errors {
            self.metrics.setup_error(e.kind());
        }
        match errors.into_iter().next() {
            Some(e) => Err(e),
            None => {
                tracing::info!(link = %self.spec.link_name, "host networking removed");
                Ok(())
            }
        }
    }

    /// The local IPs whose rules are currently wanted.
    fn active_ips(&self, withdrawn: bool) -> Vec<IpAddr> {
        self.spec
            .ips
            .iter()
            .copied()
            .filter(|ip| !(withdrawn && is_service_ip(*ip)))
            .collect()
    }

    /// Writes the wanted rules: always with `force`, otherwise only where the current state
    /// differs from our last write. Tells `made` what it repaired as soon as each write is
    /// done (one per family with iptables).
    async fn write_rules(
        &self,
        state: &mut State,
        force: bool,
        made: &mut impl FnMut(Repair),
    ) -> Result<(), Error> {
        let ips = self.active_ips(state.withdrawn);
        let wanted = rules::for_ips(&ips, self.spec.dns_port, self.spec.health_port);
        match self.ruleset {
            None => {}
            Some(Ruleset::Nftables) => {
                if !force && state.nft.is_some() && nft::list().await? == state.nft {
                    return Ok(());
                }
                state.nft = Some(nft::apply(&wanted).await?);
                made(Repair::Rules);
            }
            Some(Ruleset::Iptables(mode)) => {
                for family in self.spec.families() {
                    let of_family: Vec<rules::Rule> = wanted
                        .iter()
                        .copied()
                        .filter(|r| Family::of(r.ip) == family)
                        .collect();
                    let expected = if force {
                        None
                    } else {
                        state.iptables.get(&family)
                    };
                    let (plan, fingerprint) =
                        iptables::apply(mode, family, &of_family, expected, true).await?;
                    state.iptables.insert(family, fingerprint);
                    if plan.node_cache > 0 {
                        made(Repair::NodeCacheRules(plan.node_cache));
                    }
                    if plan.rules {
                        made(Repair::Rules);
                    }
                    if plan.jumps {
                        made(Repair::Jump);
                    }
                }
            }
        }
        Ok(())
    }

    /// Best effort, at setup: removes node-cache's rules and link, and our own rules of the
    /// other backend (a previous run with another `--rules-backend`). Failures are logged and
    /// counted but do not stop setup: leftovers of that kind duplicate ours, they do not
    /// conflict with them.
    async fn adopt(&self) {
        let mut failures = Vec::new();
        if let Some(ruleset) = self.ruleset {
            let mode = match ruleset {
                Ruleset::Iptables(mode) => Some(mode),
                Ruleset::Nftables => iptables::detect_mode().await,
            };
            for family in self.spec.families() {
                let Some(mode) = mode else { break };
                match iptables::adopt(mode, family).await {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(rules = n, ?family, "removed node-cache's rules"),
                    Err(e) => failures.push(e),
                }
                if ruleset == Ruleset::Nftables {
                    match iptables::teardown(mode, family).await {
                        Ok(true) => tracing::info!(?family, "removed our old iptables chains"),
                        Ok(false) => {}
                        Err(e) => failures.push(e),
                    }
                }
            }
            if let Ruleset::Iptables(_) = ruleset {
                if exec::installed(nft::PROGRAM) {
                    match nft::delete().await {
                        Ok(true) => tracing::info!("removed our old table inet nodedns"),
                        Ok(false) => {}
                        Err(e) => failures.push(e),
                    }
                }
            }
        }
        if let Some(netlink) = &self.netlink {
            if self.spec.link_name != NODE_CACHE_LINK {
                if let Err(e) = self.remove_node_cache_link(netlink).await {
                    failures.push(e);
                }
            }
        }
        for e in failures {
            let missing_tool = matches!(
                &e,
                Error::Iptables { source, .. } | Error::Nftables { source, .. } if source.is_not_found()
            );
            if missing_tool {
                tracing::debug!(error = %error_chain(&e), "skipping leftover cleanup");
            } else {
                self.metrics.setup_error(e.kind());
                tracing::warn!(error = %error_chain(&e), "removing leftovers failed");
            }
        }
    }

    /// Removes a `nodelocaldns` dummy link that holds nothing but our addresses.
    async fn remove_node_cache_link(&self, netlink: &link::Netlink) -> Result<(), Error> {
        let Some(found) = netlink.find(NODE_CACHE_LINK).await? else {
            return Ok(());
        };
        if found.kind.as_deref() != Some(LinkKind::Dummy.as_str()) {
            return Ok(());
        }
        let addresses = netlink.addresses(NODE_CACHE_LINK, found.index).await?;
        let only_ours = addresses.iter().all(|(ip, _)| {
            self.spec.ips.contains(ip)
                || matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80)
        });
        if only_ours {
            netlink.delete(NODE_CACHE_LINK, found.index).await?;
            tracing::info!(link = NODE_CACHE_LINK, "removed node-cache's link");
        }
        Ok(())
    }
}

/// `error: cause: cause`, for one-line logs.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

async fn choose_ruleset(request: Backend) -> Result<Ruleset, Error> {
    let nft_installed = exec::installed(nft::PROGRAM);
    match request {
        Backend::Nftables if nft_installed => Ok(Ruleset::Nftables),
        Backend::Nftables => Err(Error::NoBackend(
            "--rules-backend nftables, but `nft` is not installed",
        )),
        Backend::Iptables => iptables::detect_mode()
            .await
            .map(Ruleset::Iptables)
            .ok_or(Error::NoBackend(
                "--rules-backend iptables, but neither iptables-nft-restore nor iptables-legacy-restore is installed",
            )),
        Backend::Auto => {
            let tables = if nft_installed {
                nft::tables().await
            } else {
                None
            };
            let mode = iptables::detect_mode().await;
            decide_auto(tables.as_deref(), nft_installed, mode).ok_or(Error::NoBackend(
                "neither `nft` nor iptables-restore is installed",
            ))
        }
    }
}

/// The auto-detection rule (documented on [`Backend::Auto`]).
fn decide_auto(
    nft_tables: Option<&str>,
    nft_installed: bool,
    mode: Option<IptablesMode>,
) -> Option<Ruleset> {
    if nft_tables.is_some_and(nft::has_kube_proxy_table) {
        return Some(Ruleset::Nftables);
    }
    match mode {
        Some(mode) => Some(Ruleset::Iptables(mode)),
        None if nft_installed => Some(Ruleset::Nftables),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_nftables_when_kube_proxy_runs_in_nftables_mode() {
        let tables = "table ip filter\ntable ip kube-proxy\ntable ip6 kube-proxy\n";
        assert_eq!(
            decide_auto(Some(tables), true, Some(IptablesMode::Nft)),
            Some(Ruleset::Nftables)
        );
    }

    #[test]
    fn auto_follows_the_iptables_mode_otherwise() {
        let tables = "table ip raw\ntable ip filter\ntable ip nat\n";
        assert_eq!(
            decide_auto(Some(tables), true, Some(IptablesMode::Legacy)),
            Some(Ruleset::Iptables(IptablesMode::Legacy))
        );
        assert_eq!(
            decide_auto(None, false, Some(IptablesMode::Nft)),
            Some(Ruleset::Iptables(IptablesMode::Nft))
        );
    }

    #[test]
    fn auto_falls_back_to_nftables_without_iptables_tools() {
        assert_eq!(decide_auto(Some(""), true, None), Some(Ruleset::Nftables));
        assert_eq!(decide_auto(None, false, None), None);
    }

    #[test]
    fn flags_parse_to_kinds_and_backends() {
        assert_eq!("bridge".parse::<LinkKind>(), Ok(LinkKind::Bridge));
        assert_eq!("dummy".parse::<LinkKind>(), Ok(LinkKind::Dummy));
        assert!("veth".parse::<LinkKind>().is_err());
        assert_eq!("nftables".parse::<Backend>(), Ok(Backend::Nftables));
        assert_eq!("iptables".parse::<Backend>(), Ok(Backend::Iptables));
        assert_eq!("auto".parse::<Backend>(), Ok(Backend::Auto));
        assert!("ipvs".parse::<Backend>().is_err());
    }

    #[test]
    fn withdrawing_keeps_only_link_local_rules() {
        let spec = Spec::new(vec![
            "169.254.20.10".parse().unwrap(),
            "10.96.0.10".parse().unwrap(),
            "fd00::10".parse().unwrap(),
        ]);
        let host = Host {
            spec,
            ruleset: None,
            netlink: None,
            metrics: Metrics::default(),
            state: Mutex::new(State::default()),
        };
        assert_eq!(host.active_ips(false).len(), 3);
        assert_eq!(
            host.active_ips(true),
            vec!["169.254.20.10".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(host.spec.families(), vec![Family::V4, Family::V6]);
    }

    #[test]
    fn the_missing_dummy_driver_error_names_the_driver_and_the_switch() {
        let error = Error::LinkDriverMissing {
            name: "nodelocaldns".into(),
            kind: "dummy",
            config: "CONFIG_DUMMY",
            source: Box::new(rtnetlink::Error::RequestFailed),
        };
        let text = error.to_string();
        assert!(
            text.contains(
                "the kernel has no `dummy` link driver (CONFIG_DUMMY); use --link-kind bridge on such kernels"
            ),
            "{text}"
        );
        assert_eq!(error.kind(), ErrorKind::InterfaceAdd);
    }
}
