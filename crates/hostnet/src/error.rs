//! What can fail, named by the operation that failed.

use std::net::IpAddr;
use std::process::ExitStatus;

use crate::metrics::ErrorKind;

/// A failed host-networking operation. [`Error::kind`] maps it to node-cache's
/// `coredns_nodecache_setup_errors_total{errortype}` label.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("opening the rtnetlink socket")]
    NetlinkOpen(#[source] std::io::Error),
    #[error(
        "creating link {name}: the kernel has no `{kind}` link driver ({config}); use --link-kind bridge on such kernels"
    )]
    LinkDriverMissing {
        name: String,
        kind: &'static str,
        config: &'static str,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("creating link {name} of kind {kind}")]
    LinkAdd {
        name: String,
        kind: &'static str,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error(
        "link {name} exists with kind `{found}`, which nodedns does not manage; remove it or choose another --interface-name"
    )]
    LinkForeign { name: String, found: String },
    #[error("looking up link {name}")]
    LinkGet {
        name: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("setting link {name} up")]
    LinkUp {
        name: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("deleting link {name}")]
    LinkDelete {
        name: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("listing the addresses of link {name}")]
    AddressList {
        name: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("adding address {ip} to link {name}")]
    AddressAdd {
        name: String,
        ip: IpAddr,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("removing address {ip} from link {name}")]
    AddressDelete {
        name: String,
        ip: IpAddr,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("nftables: {operation}")]
    Nftables {
        operation: &'static str,
        #[source]
        source: CommandError,
    },
    #[error("iptables: {operation}")]
    Iptables {
        operation: &'static str,
        #[source]
        source: CommandError,
    },
    #[error(
        "choosing a rules backend: {0} (install nftables or iptables, or run with --setup-rules=false)"
    )]
    NoBackend(&'static str),
}

impl Error {
    /// The setup-errors label this failure is counted under (node-cache's values, plus
    /// `nftables`).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::LinkDriverMissing { .. } | Error::LinkAdd { .. } | Error::LinkForeign { .. } => {
                ErrorKind::InterfaceAdd
            }
            Error::NetlinkOpen(_)
            | Error::LinkGet { .. }
            | Error::LinkUp { .. }
            | Error::LinkDelete { .. }
            | Error::AddressList { .. }
            | Error::AddressAdd { .. }
            | Error::AddressDelete { .. } => ErrorKind::InterfaceCheck,
            Error::Nftables { .. } => ErrorKind::Nftables,
            Error::Iptables { source, .. } if source.is_xtables_lock() => ErrorKind::IptablesLock,
            Error::Iptables { .. } | Error::NoBackend(_) => ErrorKind::Iptables,
        }
    }
}

/// An external program (`nft`, `iptables-restore`, ...) that could not run or failed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("cannot run `{program}`")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{program}` exited with {status}: {stderr}")]
    Failed {
        program: String,
        status: ExitStatus,
        stderr: String,
    },
}

impl CommandError {
    /// The program is not installed.
    pub fn is_not_found(&self) -> bool {
        matches!(self, CommandError::Spawn { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }

    /// iptables gave up waiting for the xtables lock (legacy mode only; node-cache counts this
    /// apart as `iptables_lock`).
    pub fn is_xtables_lock(&self) -> bool {
        matches!(self, CommandError::Failed { stderr, .. } if stderr.contains("xtables lock"))
    }
}

/// Missing capabilities, found by [`crate::check_capabilities`].
#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    #[error("reading the effective capabilities from /proc/self/status")]
    Read(#[source] std::io::Error),
    #[error("no CapEff line in /proc/self/status")]
    Unparsable,
    #[error(
        "missing capabilities {}: add them to the container's securityContext.capabilities.add (CapEff={cap_eff:#x})",
        .missing.join(", ")
    )]
    Missing {
        missing: Vec<&'static str>,
        cap_eff: u64,
    },
}
