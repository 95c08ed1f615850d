//! The iptables backend: chains of our own, written with `iptables-restore --noflush`, and one
//! jump to each at the top of the built-in chain it serves.
//!
//! | table | built-in chain | our chain |
//! | --- | --- | --- |
//! | raw | PREROUTING | NODEDNS-PREROUTING |
//! | raw | OUTPUT | NODEDNS-OUTPUT |
//! | filter | INPUT | NODEDNS-INPUT |
//! | filter | OUTPUT | NODEDNS-OUTPUT |
//!
//! Every write is one `iptables-restore --noflush -w 5` per address family: declaring one of our
//! chains in the restore file flushes it, so a table's rules are replaced atomically without
//! touching anyone else's. Deletions use the exact text `iptables-save` printed for the rule
//! (`-A` turned into `-D`): if the rule changed in between, the restore fails instead of
//! deleting something else, and the next pass retries.
//!
//! Reconcile reads `iptables-save`, compares our chains with what the same command printed right
//! after our last write (iptables prints its own canonical form, e.g. `-j NOTRACK` and `-m udp`,
//! so no second renderer is needed), and checks that each built-in chain has exactly one jump
//! to ours, in first position. Anything else is rewritten in one restore.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::IpAddr;

use crate::error::{CommandError, Error};
use crate::exec;
use crate::rules::{Chain, NODE_CACHE_COMMENT_PREFIX, Rule, Side, Verdict};

/// Comment on the jumps from the built-in chains to ours.
pub(crate) const JUMP_COMMENT: &str = "nodedns: node-local DNS cache rules";

/// Which iptables implementation the node uses (detected as kube-proxy's iptables wrapper does; see `Backend::Auto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `iptables-nft`: the iptables command line over nf_tables.
    Nft,
    /// `iptables-legacy`: the old x_tables kernel interface.
    Legacy,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Nft => "nft",
            Mode::Legacy => "legacy",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Family {
    V4,
    V6,
}

impl Family {
    pub(crate) fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    fn command(self) -> &'static str {
        match self {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        }
    }
}

/// `iptables-nft-save`, `ip6tables-legacy-restore`, ...
fn program(family: Family, mode: Mode, what: &str) -> String {
    format!("{}-{}-{what}", family.command(), mode.name())
}

fn table_of(chain: Chain) -> &'static str {
    match chain {
        Chain::RawPrerouting | Chain::RawOutput => "raw",
        Chain::FilterInput | Chain::FilterOutput => "filter",
    }
}

fn builtin(chain: Chain) -> &'static str {
    match chain {
        Chain::RawPrerouting => "PREROUTING",
        Chain::RawOutput | Chain::FilterOutput => "OUTPUT",
        Chain::FilterInput => "INPUT",
    }
}

fn own(chain: Chain) -> &'static str {
    match chain {
        Chain::RawPrerouting => "NODEDNS-PREROUTING",
        Chain::RawOutput | Chain::FilterOutput => "NODEDNS-OUTPUT",
        Chain::FilterInput => "NODEDNS-INPUT",
    }
}

const TABLES: [(&str, [Chain; 2]); 2] = [
    ("raw", [Chain::RawPrerouting, Chain::RawOutput]),
    ("filter", [Chain::FilterInput, Chain::FilterOutput]),
];

/// One rule in restore syntax, e.g. `-A NODEDNS-PREROUTING -d 10.96.0.10/32 -p udp -m udp
/// --dport 53 -m comment --comment "nodedns: skip conntrack" -j NOTRACK`.
pub(crate) fn render_rule(rule: &Rule) -> String {
    let prefix = match rule.ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    };
    let (addr, port) = match rule.side {
        Side::Dst => ("-d", "--dport"),
        Side::Src => ("-s", "--sport"),
    };
    let proto = rule.proto.name();
    let target = match rule.chain.verdict() {
        Verdict::Notrack => "NOTRACK",
        Verdict::Accept => "ACCEPT",
    };
    format!(
        "-A {chain} {addr} {ip}/{prefix} -p {proto} -m {proto} {port} {number} -m comment --comment \"{comment}\" -j {target}",
        chain = own(rule.chain),
        ip = rule.ip,
        number = rule.port,
        comment = rule.chain.verdict().comment(),
    )
}

/// One table of `iptables-save` output: the chains it declares and its rules, in order, as
/// printed (`-A CHAIN ...`).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct TableDump {
    chains: Vec<String>,
    rules: Vec<String>,
}

impl TableDump {
    /// Our own rules (`-A NODEDNS-...`), as printed.
    fn own_rules(&self) -> Vec<String> {
        self.rules
            .iter()
            .filter(|line| line.starts_with("-A NODEDNS-"))
            .cloned()
            .collect()
    }

    /// The rules of built-in chain `name`, in order.
    fn chain_rules<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a String> + 'a {
        self.rules.iter().filter(move |line| {
            line.strip_prefix("-A ")
                .and_then(|rest| rest.strip_prefix(name))
                .is_some_and(|rest| rest.starts_with(' ') || rest.is_empty())
        })
    }

    fn declares(&self, chain: &str) -> bool {
        self.chains.iter().any(|c| c == chain)
    }
}

/// `iptables-save` output, by table name.
pub(crate) type Save = BTreeMap<String, TableDump>;

/// Parses `iptables-save` output. Lines it does not know (comments, counters, `COMMIT`) are
/// skipped; a malformed dump yields fewer rules, never a panic.
pub(crate) fn parse_save(text: &str) -> Save {
    let mut save = Save::new();
    let mut current: Option<&mut TableDump> = None;
    for line in text.lines() {
        let line = line.trim_end();
        if let Some(name) = line.strip_prefix('*') {
            current = Some(save.entry(name.to_owned()).or_default());
        } else if let Some(decl) = line.strip_prefix(':') {
            if let (Some(table), Some(name)) = (current.as_deref_mut(), decl.split(' ').next()) {
                table.chains.push(name.to_owned());
            }
        } else if line.starts_with("-A ") {
            if let Some(table) = current.as_deref_mut() {
                table.rules.push(line.to_owned());
            }
        } else if line == "COMMIT" {
            current = None;
        }
    }
    save
}

/// Whether a saved rule line jumps to chain `target`.
fn jumps_to(line: &str, target: &str) -> bool {
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .windows(2)
        .any(|pair| matches!(pair, ["-j" | "-g", t] if *t == target))
}

fn is_node_cache_rule(line: &str) -> bool {
    line.contains(&format!("--comment \"{NODE_CACHE_COMMENT_PREFIX}"))
}

/// `-A CHAIN rest` → `-D CHAIN rest`: delete exactly the rule iptables-save printed.
fn deletion(line: &str) -> String {
    format!("-D {}", line.strip_prefix("-A ").unwrap_or(line))
}

/// Our chains' rules per table as iptables printed them after our last write.
pub(crate) type Fingerprint = BTreeMap<String, Vec<String>>;

/// What a restore file is going to change.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The restore file; empty when nothing needs changing.
    pub text: String,
    /// Our chains are (re)written.
    pub rules: bool,
    /// A jump is added, de-duplicated or moved back to the top.
    pub jumps: bool,
    /// node-cache rules removed.
    pub node_cache: usize,
}

/// Plans bringing `save` to `rules` (all of one family). `expected` is the fingerprint of our
/// last write (`None` forces a rewrite: first setup, or the wanted rules changed); with
/// `adopt`, node-cache's leftover rules in the built-in chains are deleted too.
pub(crate) fn plan_apply(
    save: &Save,
    rules: &[Rule],
    expected: Option<&Fingerprint>,
    adopt: bool,
) -> Plan {
    let mut plan = Plan::default();
    let empty = TableDump::default();
    for (table, chains) in TABLES {
        let dump = save.get(table).unwrap_or(&empty);
        let rewrite = expected.and_then(|fp| fp.get(table)) != Some(&dump.own_rules())
            || chains.iter().any(|&c| !dump.declares(own(c)));
        let mut body = String::new();
        if rewrite {
            for chain in chains {
                let _ = writeln!(body, ":{} - [0:0]", own(chain));
            }
        }
        for chain in chains {
            let lines: Vec<&String> = dump.chain_rules(builtin(chain)).collect();
            if adopt {
                for line in lines.iter().filter(|l| is_node_cache_rule(l)) {
                    let _ = writeln!(body, "{}", deletion(line));
                    plan.node_cache += 1;
                }
            }
            let jumps: Vec<usize> = (0..lines.len())
                .filter(|&i| jumps_to(lines[i], own(chain)))
                .collect();
            if jumps != [0] {
                for &i in &jumps {
                    let _ = writeln!(body, "{}", deletion(lines[i]));
                }
                let _ = writeln!(
                    body,
                    "-I {} 1 -m comment --comment \"{JUMP_COMMENT}\" -j {}",
                    builtin(chain),
                    own(chain)
                );
                plan.jumps = true;
            }
        }
        if rewrite {
            for rule in rules.iter().filter(|r| table_of(r.chain) == table) {
                let _ = writeln!(body, "{}", render_rule(rule));
            }
            plan.rules = true;
        }
        if !body.is_empty() {
            let _ = write!(plan.text, "*{table}\n{body}COMMIT\n");
        }
    }
    plan
}

/// Plans deleting node-cache's leftover rules only (when our rules live elsewhere).
pub(crate) fn plan_adopt(save: &Save) -> Plan {
    let mut plan = Plan::default();
    for (table, chains) in TABLES {
        let Some(dump) = save.get(table) else {
            continue;
        };
        let mut body = String::new();
        for chain in chains {
            for line in dump
                .chain_rules(builtin(chain))
                .filter(|l| is_node_cache_rule(l))
            {
                let _ = writeln!(body, "{}", deletion(line));
                plan.node_cache += 1;
            }
        }
        if !body.is_empty() {
            let _ = write!(plan.text, "*{table}\n{body}COMMIT\n");
        }
    }
    plan
}

/// Plans removing our jumps and chains.
pub(crate) fn plan_teardown(save: &Save) -> Plan {
    let mut plan = Plan::default();
    for (table, chains) in TABLES {
        let Some(dump) = save.get(table) else {
            continue;
        };
        let mut declare = String::new();
        let mut body = String::new();
        for chain in chains {
            for line in dump
                .chain_rules(builtin(chain))
                .filter(|l| jumps_to(l, own(chain)))
            {
                let _ = writeln!(body, "{}", deletion(line));
                plan.jumps = true;
            }
            if dump.declares(own(chain)) {
                // Declaring flushes it; then it can be deleted once nothing jumps to it.
                let _ = writeln!(declare, ":{} - [0:0]", own(chain));
                plan.rules = true;
            }
        }
        for chain in chains {
            if dump.declares(own(chain)) {
                let _ = writeln!(body, "-X {}", own(chain));
            }
        }
        if !body.is_empty() {
            let _ = write!(plan.text, "*{table}\n{declare}{body}COMMIT\n");
        }
    }
    plan
}

/// Our rules as `save` shows them, for the next reconcile to compare against.
pub(crate) fn fingerprint(save: &Save) -> Fingerprint {
    TABLES
        .iter()
        .map(|(table, _)| {
            let rules = save
                .get(*table)
                .map(TableDump::own_rules)
                .unwrap_or_default();
            ((*table).to_owned(), rules)
        })
        .collect()
}

fn iptables_error(operation: &'static str) -> impl FnOnce(CommandError) -> Error {
    move |source| Error::Iptables { operation, source }
}

pub(crate) async fn save(mode: Mode, family: Family) -> Result<Save, Error> {
    let text = exec::run(&program(family, mode, "save"), &[], None)
        .await
        .map_err(iptables_error("reading the rules (iptables-save)"))?;
    Ok(parse_save(&text))
}

/// Applies a restore file, waiting up to 5 s for the xtables lock (legacy mode; nft mode has
/// no such lock and ignores the flag).
pub(crate) async fn restore(
    mode: Mode,
    family: Family,
    text: &str,
    operation: &'static str,
) -> Result<(), Error> {
    if text.is_empty() {
        return Ok(());
    }
    exec::run(
        &program(family, mode, "restore"),
        &["-w", "5", "--noflush"],
        Some(text),
    )
    .await
    .map_err(iptables_error(operation))?;
    Ok(())
}

/// Saves, plans, restores if needed, and returns the plan with the new fingerprint.
pub(crate) async fn apply(
    mode: Mode,
    family: Family,
    rules: &[Rule],
    expected: Option<&Fingerprint>,
    adopt: bool,
) -> Result<(Plan, Fingerprint), Error> {
    let before = save(mode, family).await?;
    let plan = plan_apply(&before, rules, expected, adopt);
    if plan.text.is_empty() {
        return Ok((plan, fingerprint(&before)));
    }
    restore(
        mode,
        family,
        &plan.text,
        "writing our chains (iptables-restore)",
    )
    .await?;
    let after = save(mode, family).await?;
    Ok((plan, fingerprint(&after)))
}

/// Removes node-cache's leftovers; returns how many rules were removed.
pub(crate) async fn adopt(mode: Mode, family: Family) -> Result<usize, Error> {
    let plan = plan_adopt(&save(mode, family).await?);
    restore(mode, family, &plan.text, "removing node-cache's rules").await?;
    Ok(plan.node_cache)
}

/// Removes our jumps and chains; returns whether anything was there.
pub(crate) async fn teardown(mode: Mode, family: Family) -> Result<bool, Error> {
    let plan = plan_teardown(&save(mode, family).await?);
    restore(mode, family, &plan.text, "removing our chains").await?;
    Ok(!plan.text.is_empty())
}

/// What `iptables-save` shows of one mode, for [`choose_mode`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Observed {
    /// kubelet's `KUBE-IPTABLES-HINT` or `KUBE-KUBELET-CANARY` chain exists (Kubernetes ≥ 1.17
    /// creates one in the mode the node uses).
    pub kubelet_hint: bool,
    /// Number of rules (`-A` lines), IPv4 and IPv6.
    pub rules: usize,
}

impl Observed {
    pub(crate) fn from_save(text: &str) -> Observed {
        Observed {
            kubelet_hint: text.lines().any(|l| {
                l.starts_with(":KUBE-IPTABLES-HINT ") || l.starts_with(":KUBE-KUBELET-CANARY ")
            }),
            rules: text.lines().filter(|l| l.starts_with("-A ")).count(),
        }
    }

    fn merge(self, other: Observed) -> Observed {
        Observed {
            kubelet_hint: self.kubelet_hint || other.kubelet_hint,
            rules: self.rules + other.rules,
        }
    }
}

/// The iptables mode the node uses, as kube-proxy's iptables wrapper decides it: kubelet's hint
/// chain in nft mode, then in legacy mode; failing both, the mode holding more rules (ties go
/// to nft, the default of current distributions). `None` for a mode whose tools are missing.
pub(crate) fn choose_mode(nft: Option<Observed>, legacy: Option<Observed>) -> Option<Mode> {
    match (nft, legacy) {
        (Some(n), _) if n.kubelet_hint => Some(Mode::Nft),
        (_, Some(l)) if l.kubelet_hint => Some(Mode::Legacy),
        (Some(n), Some(l)) if l.rules > n.rules => Some(Mode::Legacy),
        (Some(_), _) => Some(Mode::Nft),
        (None, Some(_)) => Some(Mode::Legacy),
        (None, None) => None,
    }
}

/// Looks at both modes' rules (full `*-save`, which never creates tables) and picks one.
pub(crate) async fn detect_mode() -> Option<Mode> {
    async fn observe(mode: Mode) -> Option<Observed> {
        if !exec::installed(&program(Family::V4, mode, "restore")) {
            return None;
        }
        let mut seen = Observed::default();
        for family in [Family::V4, Family::V6] {
            if let Ok(text) = exec::run(&program(family, mode, "save"), &[], None).await {
                seen = seen.merge(Observed::from_save(&text));
            }
        }
        Some(seen)
    }
    let nft = observe(Mode::Nft).await;
    let legacy = observe(Mode::Legacy).await;
    let mode = choose_mode(nft, legacy);
    tracing::debug!(?nft, ?legacy, ?mode, "iptables mode detection");
    mode
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules;

    const FRESH: &str = "\
# Generated by iptables-nft-save v1.8.9 (nf_tables)
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -j KUBE-FIREWALL
COMMIT
";

    fn v4_rules() -> Vec<Rule> {
        rules::for_ips(&["10.96.0.10".parse().unwrap()], 53, Some(8080))
    }

    #[test]
    fn rules_render_in_restore_syntax_with_a_nodedns_comment() {
        let rule = v4_rules()[0];
        assert_eq!(
            render_rule(&rule),
            "-A NODEDNS-PREROUTING -d 10.96.0.10/32 -p udp -m udp --dport 53 -m comment --comment \"nodedns: skip conntrack\" -j NOTRACK"
        );
        let v6 = rules::for_ips(&["fd00::10".parse().unwrap()], 53, None);
        let accept = v6.iter().find(|r| r.chain == Chain::FilterOutput).unwrap();
        assert_eq!(
            render_rule(accept),
            "-A NODEDNS-OUTPUT -s fd00::10/128 -p udp -m udp --sport 53 -m comment --comment \"nodedns: allow DNS traffic\" -j ACCEPT"
        );
    }

    #[test]
    fn first_apply_declares_our_chains_and_puts_jumps_first() {
        let plan = plan_apply(&parse_save(FRESH), &v4_rules(), None, true);
        assert!(plan.rules && plan.jumps);
        assert_eq!(plan.node_cache, 0);
        let raw = plan.text.split("COMMIT\n").next().unwrap();
        assert!(raw.starts_with("*raw\n:NODEDNS-PREROUTING - [0:0]\n:NODEDNS-OUTPUT - [0:0]\n"));
        assert!(raw.contains(
            "-I PREROUTING 1 -m comment --comment \"nodedns: node-local DNS cache rules\" -j NODEDNS-PREROUTING\n"
        ));
        assert!(raw.contains("-I OUTPUT 1 -m comment"));
        assert_eq!(raw.matches("-j NOTRACK").count(), 8);
        assert!(!raw.contains("ACCEPT"));
        let filter = plan.text.split("COMMIT\n").nth(1).unwrap();
        assert!(filter.starts_with("*filter\n:NODEDNS-INPUT - [0:0]\n:NODEDNS-OUTPUT - [0:0]\n"));
        assert_eq!(filter.matches("-j ACCEPT").count(), 4);
        assert!(
            !filter.contains("KUBE-FIREWALL"),
            "never touches other rules"
        );
    }

    /// What iptables prints after our first write, with something inserted above our jump.
    fn applied(extra_first: &str) -> String {
        let plan = plan_apply(&parse_save(FRESH), &v4_rules(), None, false);
        let mut out = String::new();
        for block in plan.text.split("COMMIT\n").filter(|b| !b.is_empty()) {
            let mut lines = block.lines();
            let table = lines.next().unwrap();
            out.push_str(table);
            out.push('\n');
            let builtins: &[&str] = if table == "*raw" {
                &["PREROUTING", "OUTPUT"]
            } else {
                &["INPUT", "FORWARD", "OUTPUT"]
            };
            for b in builtins {
                let _ = writeln!(out, ":{b} ACCEPT [0:0]");
            }
            let mut rules = Vec::new();
            for line in lines {
                if line.starts_with(':') {
                    out.push_str(line);
                    out.push('\n');
                } else if let Some(rest) = line.strip_prefix("-I ") {
                    let (chain, spec) = rest.split_once(" 1 ").unwrap();
                    if table == "*raw" && chain == "PREROUTING" && !extra_first.is_empty() {
                        rules.push(extra_first.to_owned());
                    }
                    rules.push(format!("-A {chain} {spec}"));
                } else {
                    rules.push(line.to_owned());
                }
            }
            for r in rules {
                out.push_str(&r);
                out.push('\n');
            }
            out.push_str("COMMIT\n");
        }
        out
    }

    #[test]
    fn nothing_to_do_when_rules_match_the_fingerprint_and_jumps_are_first() {
        let save = parse_save(&applied(""));
        let fp = fingerprint(&save);
        let plan = plan_apply(&save, &v4_rules(), Some(&fp), true);
        assert_eq!(plan, Plan::default());
    }

    #[test]
    fn a_deleted_rule_of_ours_rewrites_only_that_table() {
        let text = applied("");
        let fp = fingerprint(&parse_save(&text));
        let damaged: String = text
            .lines()
            .filter(|l| !(l.starts_with("-A NODEDNS-INPUT") && l.contains("-p tcp")))
            .map(|l| format!("{l}\n"))
            .collect();
        let plan = plan_apply(&parse_save(&damaged), &v4_rules(), Some(&fp), true);
        assert!(plan.rules && !plan.jumps);
        assert!(!plan.text.contains("*raw"));
        assert!(plan.text.starts_with("*filter\n:NODEDNS-INPUT - [0:0]\n"));
        assert_eq!(plan.text.matches("-j ACCEPT").count(), 4);
    }

    #[test]
    fn a_rule_inserted_above_our_jump_moves_the_jump_back_to_the_top() {
        let text = applied("-A PREROUTING -j DROP");
        let save = parse_save(&text);
        let fp = fingerprint(&save);
        let plan = plan_apply(&save, &v4_rules(), Some(&fp), true);
        assert!(plan.jumps && !plan.rules);
        assert_eq!(
            plan.text,
            "*raw\n-D PREROUTING -m comment --comment \"nodedns: node-local DNS cache rules\" -j NODEDNS-PREROUTING\n\
             -I PREROUTING 1 -m comment --comment \"nodedns: node-local DNS cache rules\" -j NODEDNS-PREROUTING\nCOMMIT\n"
        );
    }

    #[test]
    fn duplicate_jumps_left_by_a_crash_are_reduced_to_one() {
        let mut text = applied("");
        text = text.replacen(
            "-A NODEDNS-PREROUTING",
            "-A PREROUTING -m comment --comment \"nodedns: node-local DNS cache rules\" -j NODEDNS-PREROUTING\n-A NODEDNS-PREROUTING",
            1,
        );
        let save = parse_save(&text);
        let plan = plan_apply(&save, &v4_rules(), Some(&fingerprint(&save)), true);
        assert_eq!(plan.text.matches("-D PREROUTING").count(), 2);
        assert!(!plan.rules);
        assert_eq!(plan.text.matches("-I PREROUTING 1").count(), 1);
    }

    #[test]
    fn node_cache_leftovers_are_deleted_by_their_exact_text() {
        let leftover = "-A PREROUTING -d 10.96.0.10/32 -p udp -m udp --dport 53 -m comment --comment \"NodeLocal DNS Cache: skip conntrack\" -j NOTRACK";
        let mut text = applied("");
        text = text.replace(
            "COMMIT\n*filter",
            &format!("{leftover}\n{leftover}\nCOMMIT\n*filter"),
        );
        let save = parse_save(&text);
        let fp = fingerprint(&save);
        let plan = plan_apply(&save, &v4_rules(), Some(&fp), true);
        assert_eq!(plan.node_cache, 2);
        assert_eq!(
            plan.text.matches(&leftover.replacen("-A", "-D", 1)).count(),
            2
        );
        assert_eq!(
            plan_apply(&save, &v4_rules(), Some(&fp), false).node_cache,
            0
        );
        assert_eq!(plan_adopt(&save).node_cache, 2);
    }

    #[test]
    fn teardown_removes_jumps_then_flushes_and_deletes_our_chains() {
        let save = parse_save(&applied("-A PREROUTING -j ACCEPT"));
        let plan = plan_teardown(&save);
        let raw = plan.text.split("COMMIT\n").next().unwrap();
        assert_eq!(
            raw,
            "*raw\n:NODEDNS-PREROUTING - [0:0]\n:NODEDNS-OUTPUT - [0:0]\n\
             -D PREROUTING -m comment --comment \"nodedns: node-local DNS cache rules\" -j NODEDNS-PREROUTING\n\
             -D OUTPUT -m comment --comment \"nodedns: node-local DNS cache rules\" -j NODEDNS-OUTPUT\n\
             -X NODEDNS-PREROUTING\n-X NODEDNS-OUTPUT\n"
        );
        assert!(!plan.text.contains("-j ACCEPT"), "leaves other rules alone");
        assert_eq!(plan_teardown(&parse_save(FRESH)), Plan::default());
    }

    #[test]
    fn malformed_save_output_parses_to_fewer_rules_without_panicking() {
        for text in [
            "",
            "*",
            ":",
            "-A",
            "COMMIT",
            "*raw\n:\n-A \n",
            "-A X\n*raw",
            "\u{0}*raw\n",
        ] {
            let save = parse_save(text);
            let _ = plan_apply(&save, &v4_rules(), None, true);
            let _ = plan_teardown(&save);
        }
    }

    #[test]
    fn mode_follows_kubelets_hint_chain_then_the_rule_count() {
        let hint = Observed {
            kubelet_hint: true,
            rules: 0,
        };
        let rules = |n| Observed {
            kubelet_hint: false,
            rules: n,
        };
        assert_eq!(choose_mode(Some(hint), Some(rules(100))), Some(Mode::Nft));
        assert_eq!(
            choose_mode(Some(rules(100)), Some(hint)),
            Some(Mode::Legacy)
        );
        assert_eq!(
            choose_mode(Some(rules(3)), Some(rules(40))),
            Some(Mode::Legacy)
        );
        assert_eq!(choose_mode(Some(rules(3)), Some(rules(3))), Some(Mode::Nft));
        assert_eq!(choose_mode(None, Some(rules(0))), Some(Mode::Legacy));
        assert_eq!(choose_mode(None, None), None);
        let seen = Observed::from_save("*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n-A X -j Y\nCOMMIT\n");
        assert!(seen.kubelet_hint);
        assert_eq!(seen.rules, 1);
    }
}
