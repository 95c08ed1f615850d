//! The nftables backend: one table of our own, `table inet nodedns`, replaced as a whole in one
//! `nft -f -` transaction.
//!
//! The table has four base chains, at the priorities of the iptables tables they stand for:
//! `raw-prerouting` and `raw-output` (priority `raw`, -300, before conntrack at -200) hold the
//! NOTRACK rules; `filter-input` and `filter-output` (priority `filter`, 0) the ACCEPT rules.
//! nftables has no "top of the chain" between tables: what decides order is the priority, so
//! there is no jump to keep in place. An `accept` is final only within its own base chain; a
//! `drop` in another table's chain on the same hook still drops (see `docs/hostnet.md`).
//!
//! Reconcile compares `nft list table inet nodedns` with the listing taken right after our last
//! write (nft prints its own canonical form, so no second renderer is needed) and rewrites the
//! table when they differ: a deleted rule, an added one, or a missing table.

use std::fmt::Write;
use std::net::IpAddr;

use crate::error::{CommandError, Error};
use crate::exec;
use crate::rules::{Chain, Rule, Side};

pub(crate) const PROGRAM: &str = "nft";
pub(crate) const TABLE: &str = "nodedns";

fn chain_name(chain: Chain) -> &'static str {
    match chain {
        Chain::RawPrerouting => "raw-prerouting",
        Chain::RawOutput => "raw-output",
        Chain::FilterInput => "filter-input",
        Chain::FilterOutput => "filter-output",
    }
}

fn chain_hook(chain: Chain) -> (&'static str, &'static str) {
    match chain {
        Chain::RawPrerouting => ("prerouting", "raw"),
        Chain::RawOutput => ("output", "raw"),
        Chain::FilterInput => ("input", "filter"),
        Chain::FilterOutput => ("output", "filter"),
    }
}

/// One rule as nft syntax, e.g.
/// `ip daddr 10.96.0.10 udp dport 53 notrack comment "nodedns: skip conntrack"`.
pub(crate) fn render_rule(rule: &Rule) -> String {
    let family = match rule.ip {
        IpAddr::V4(_) => "ip",
        IpAddr::V6(_) => "ip6",
    };
    let (addr, port) = match rule.side {
        Side::Dst => ("daddr", "dport"),
        Side::Src => ("saddr", "sport"),
    };
    let verdict = match rule.chain.verdict() {
        crate::rules::Verdict::Notrack => "notrack",
        crate::rules::Verdict::Accept => "accept",
    };
    format!(
        "{family} {addr} {ip} {proto} {port} {number} {verdict} comment \"{comment}\"",
        ip = rule.ip,
        proto = rule.proto.name(),
        number = rule.port,
        comment = rule.chain.verdict().comment(),
    )
}

/// The whole transaction: create the table if absent (so the delete cannot fail), delete it,
/// and declare it anew with every rule. nft applies the file atomically: there is no moment
/// without rules.
pub(crate) fn render(rules: &[Rule]) -> String {
    let mut out = format!("table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    for chain in Chain::ALL {
        let (hook, priority) = chain_hook(chain);
        let _ = writeln!(out, "\tchain {} {{", chain_name(chain));
        let _ = writeln!(
            out,
            "\t\ttype filter hook {hook} priority {priority}; policy accept;"
        );
        for rule in rules.iter().filter(|r| r.chain == chain) {
            let _ = writeln!(out, "\t\t{}", render_rule(rule));
        }
        out.push_str("\t}\n");
    }
    out.push_str("}\n");
    out
}

/// Deleting the table, whether or not it exists, in one transaction.
pub(crate) fn render_delete() -> String {
    format!("table inet {TABLE}\ndelete table inet {TABLE}\n")
}

fn nft_error(operation: &'static str) -> impl FnOnce(CommandError) -> Error {
    move |source| Error::Nftables { operation, source }
}

/// Replaces our table with one holding `rules`; returns nft's listing of the result (empty if
/// the table is already gone again, which makes the next reconcile rewrite it).
pub(crate) async fn apply(rules: &[Rule]) -> Result<String, Error> {
    exec::run(PROGRAM, &["-f", "-"], Some(&render(rules)))
        .await
        .map_err(nft_error("writing table inet nodedns"))?;
    Ok(list().await?.unwrap_or_default())
}

/// Our table as nft lists it, or `None` when it does not exist.
pub(crate) async fn list() -> Result<Option<String>, Error> {
    match exec::run(PROGRAM, &["list", "table", "inet", TABLE], None).await {
        Ok(text) => Ok(Some(text)),
        Err(CommandError::Failed { stderr, .. })
            if stderr.contains("No such file or directory") =>
        {
            Ok(None)
        }
        Err(e) => Err(nft_error("listing table inet nodedns")(e)),
    }
}

/// Removes our table; returns whether it existed.
pub(crate) async fn delete() -> Result<bool, Error> {
    let existed = list().await?.is_some();
    if existed {
        exec::run(PROGRAM, &["-f", "-"], Some(&render_delete()))
            .await
            .map_err(nft_error("deleting table inet nodedns"))?;
    }
    Ok(existed)
}

/// `nft list tables`, for backend detection; `None` when nft is missing or fails.
pub(crate) async fn tables() -> Option<String> {
    exec::run(PROGRAM, &["list", "tables"], None).await.ok()
}

/// Whether kube-proxy runs in nftables mode: it keeps its rules in `table ip kube-proxy` and
/// `table ip6 kube-proxy`.
pub(crate) fn has_kube_proxy_table(tables: &str) -> bool {
    tables.lines().any(|line| {
        let words: Vec<&str> = line.split_whitespace().collect();
        matches!(words.as_slice(), ["table", "ip" | "ip6", "kube-proxy"])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules;

    #[test]
    fn rules_render_as_nft_statements_naming_nodedns() {
        let ips: Vec<IpAddr> = vec![
            "169.254.20.10".parse().unwrap(),
            "fd00::10".parse().unwrap(),
        ];
        let text = render(&rules::for_ips(&ips, 53, Some(8080)));
        assert!(
            text.starts_with(
                "table inet nodedns\ndelete table inet nodedns\ntable inet nodedns {\n"
            )
        );
        assert!(text.contains("\tchain raw-prerouting {\n\t\ttype filter hook prerouting priority raw; policy accept;\n"));
        assert!(text.contains(
            "\tchain filter-output {\n\t\ttype filter hook output priority filter; policy accept;\n"
        ));
        assert!(text.contains(
            "\t\tip daddr 169.254.20.10 udp dport 53 notrack comment \"nodedns: skip conntrack\"\n"
        ));
        assert!(text.contains(
            "\t\tip6 saddr fd00::10 tcp sport 53 accept comment \"nodedns: allow DNS traffic\"\n"
        ));
        assert!(text.contains("\t\tip6 daddr fd00::10 tcp dport 8080 notrack"));
        assert_eq!(text.matches(" notrack ").count(), 2 * (3 * 2 + 2));
        assert_eq!(text.matches(" accept ").count(), 2 * (2 * 2));
        assert!(text.ends_with("\t}\n}\n"));
    }

    #[test]
    fn notrack_rules_go_to_raw_chains_and_accept_rules_to_filter_chains() {
        let text = render(&rules::for_ips(&["10.96.0.10".parse().unwrap()], 53, None));
        let mut chain = "";
        for line in text.lines() {
            if let Some(name) = line.trim().strip_prefix("chain ") {
                chain = name;
            } else if line.contains(" notrack ") {
                assert!(chain.starts_with("raw-"), "{line} in {chain}");
            } else if line.contains(" accept ") {
                assert!(chain.starts_with("filter-"), "{line} in {chain}");
            }
        }
    }

    #[test]
    fn kube_proxy_nftables_mode_is_recognised_by_its_tables() {
        assert!(has_kube_proxy_table(
            "table ip filter\ntable ip kube-proxy\n"
        ));
        assert!(has_kube_proxy_table("table ip6 kube-proxy\n"));
        assert!(!has_kube_proxy_table(
            "table ip raw\ntable inet kube-proxy-like\n"
        ));
        assert!(!has_kube_proxy_table("table inet filter\n"));
        assert!(!has_kube_proxy_table(""));
    }
}
