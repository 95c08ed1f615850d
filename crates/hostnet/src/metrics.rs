//! Host-networking metrics.
//!
//! - `coredns_nodecache_setup_errors_total{errortype}`: node-cache's own metric, same name and
//!   label values (`iptables`, `iptables_lock`, `interface_add`, `interface_check`,
//!   `configmap`), plus `nftables`, so existing node-local-dns alerts keep working.
//! - `nodedns_hostnet_reconcile_total{result}`: reconcile passes by outcome (`ok`, `repaired`,
//!   `failed`), counted when the pass is over.
//! - `nodedns_hostnet_repairs_total{what}`: things a reconcile pass found missing or displaced and
//!   put back (`link`, `address`, `rules`, `jump`), each counted as soon as it is put back.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// The `errortype` label of `coredns_nodecache_setup_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    Iptables,
    IptablesLock,
    Nftables,
    InterfaceAdd,
    InterfaceCheck,
    /// Counted by the agent (reading the kube-dns ConfigMap), not by this crate.
    Configmap,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::Iptables,
        ErrorKind::IptablesLock,
        ErrorKind::Nftables,
        ErrorKind::InterfaceAdd,
        ErrorKind::InterfaceCheck,
        ErrorKind::Configmap,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Iptables => "iptables",
            ErrorKind::IptablesLock => "iptables_lock",
            ErrorKind::Nftables => "nftables",
            ErrorKind::InterfaceAdd => "interface_add",
            ErrorKind::InterfaceCheck => "interface_check",
            ErrorKind::Configmap => "configmap",
        }
    }
}

/// The outcome of one reconcile pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Everything was in place.
    Ok,
    /// Something was missing or displaced and has been put back.
    Repaired,
    /// At least one check or repair failed (counted in the setup errors too).
    Failed,
}

/// What a reconcile pass put back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RepairKind {
    Link,
    Address,
    Rules,
    Jump,
}

macro_rules! label_value {
    ($ty:ty, $($variant:ident => $text:literal),+) => {
        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                use std::fmt::Write;
                encoder.write_str(match self { $(Self::$variant => $text),+ })
            }
        }
    };
}

impl EncodeLabelValue for ErrorKind {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        encoder.write_str(self.as_str())
    }
}
label_value!(Outcome, Ok => "ok", Repaired => "repaired", Failed => "failed");
label_value!(RepairKind, Link => "link", Address => "address", Rules => "rules", Jump => "jump");

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ErrorLabels {
    errortype: ErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OutcomeLabels {
    result: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RepairLabels {
    what: RepairKind,
}

/// Host-networking counters. Cheap to clone: clones count into the same series.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    setup_errors: Family<ErrorLabels, Counter>,
    reconciles: Family<OutcomeLabels, Counter>,
    repairs: Family<RepairLabels, Counter>,
}

impl Metrics {
    /// Registers the counters in `registry` (which must not add a prefix: the setup-errors name
    /// is node-cache's). Every `errortype` starts at zero so that alerts see the series.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        for kind in ErrorKind::ALL {
            let _ = metrics
                .setup_errors
                .get_or_create(&ErrorLabels { errortype: kind });
        }
        registry.register(
            "coredns_nodecache_setup_errors",
            "The number of errors during periodic network setup for node-cache",
            metrics.setup_errors.clone(),
        );
        registry.register(
            "nodedns_hostnet_reconcile",
            "Host networking reconcile passes, by result",
            metrics.reconciles.clone(),
        );
        registry.register(
            "nodedns_hostnet_repairs",
            "Host networking objects found missing or displaced and restored, by kind",
            metrics.repairs.clone(),
        );
        metrics
    }

    /// Counts one setup error of `kind`.
    pub fn setup_error(&self, kind: ErrorKind) {
        self.setup_errors
            .get_or_create(&ErrorLabels { errortype: kind })
            .inc();
    }

    pub(crate) fn reconciled(&self, result: Outcome) {
        self.reconciles
            .get_or_create(&OutcomeLabels { result })
            .inc();
    }

    pub(crate) fn repaired(&self, what: RepairKind) {
        self.repairs.get_or_create(&RepairLabels { what }).inc();
    }

    /// The current count of setup errors of `kind` (for tests and status output).
    pub fn setup_errors(&self, kind: ErrorKind) -> u64 {
        self.setup_errors
            .get_or_create(&ErrorLabels { errortype: kind })
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_errors_use_node_caches_name_and_labels() {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        metrics.setup_error(ErrorKind::IptablesLock);
        metrics.reconciled(Outcome::Repaired);
        metrics.repaired(RepairKind::Jump);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("coredns_nodecache_setup_errors_total{errortype=\"iptables_lock\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("coredns_nodecache_setup_errors_total{errortype=\"interface_add\"} 0")
        );
        assert!(text.contains("coredns_nodecache_setup_errors_total{errortype=\"configmap\"} 0"));
        assert!(text.contains("nodedns_hostnet_reconcile_total{result=\"repaired\"} 1"));
        assert!(text.contains("nodedns_hostnet_repairs_total{what=\"jump\"} 1"));
    }
}
