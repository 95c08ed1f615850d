//! `cache`: the block's cache, as CoreDNS's `plugin/cache` configures it (`cache [TTL] [ZONES...]
//! { success CAPACITY [TTL [MINTTL]]; denial ...; prefetch AMOUNT [[DURATION] [PERCENTAGE%]];
//! serve_stale [DURATION] [REFRESH_MODE ...]; serve_stale_policy prefer_positive; servfail
//! DURATION; keepttl; disable success|denial [ZONES...] }`), with nodedns's defaults where a
//! Corefile says nothing (prefetch and serve-stale on, a budget in bytes). ZONES limit the cache
//! to names under them (the scope, [`Scope`]).
//!
//! Its logic is the `nodedns-cache` crate; its place in the chain is the pipeline's lookup
//! (`serve::pipeline`), between the plugins that see every query and those after the cache
//! ([`super::Chain`]); its metrics are the pipeline's (`coredns_cache_*`, `crate::metrics`).

use std::time::Duration;

use nodedns_cache::{Clamp, PREFETCH_WINDOW, Policy, Prefetch, Refresh, Scope, Stale};

use crate::config::corefile::{Directive, Word};
use crate::config::directives::{Out, duration, whole};
use crate::config::values;

/// Bytes one cache entry is counted as when a Corefile gives capacities in entries (CoreDNS's
/// CAPACITY): a typical cluster answer (~150 B), its key and the bookkeeping around it.
pub(crate) const BYTES_PER_ENTRY: u64 = 512;
/// CoreDNS's default capacity per class (256 shards × 39 entries).
pub(crate) const DEFAULT_ENTRIES: u64 = 9984;
/// CoreDNS's smallest capacity per class (256 shards × 4 entries).
const MIN_ENTRIES: u64 = 1024;
/// CoreDNS's longest `servfail` duration.
const MAX_SERVFAIL: Duration = Duration::from_secs(300);

/// nodedns's serve-stale when a Corefile does not configure it: CoreDNS's 1 h window, RFC 8767's
/// 30 s TTL; the upstream is asked first (`verify`), and stale entries are answered at once while
/// it is known to be down, and for 5 s after a fetch of the name failed (a failure recheck
/// shorter than RFC 8767's 30 s: CoreDNS is in the cluster, and names must be fresh again
/// within seconds of its return).
pub(crate) const DEFAULT_STALE: Stale = Stale {
    window: Duration::from_secs(3600),
    ttl: 30,
    refresh: Refresh::Verify { timeout: None },
    recheck: Duration::from_secs(5),
    prefer_positive: false,
};
/// nodedns's prefetch when a Corefile does not configure it: an entry asked for at least twice,
/// with no gap of more than a minute, is refreshed when 10 % of its TTL is left (CoreDNS's
/// DURATION and percentage).
pub(crate) const DEFAULT_PREFETCH: Prefetch = Prefetch {
    amount: 2,
    window: PREFETCH_WINDOW,
    percentage: 10,
};

/// A cache policy with CoreDNS's TTL clamps and nodedns's defaults for everything else.
pub(crate) fn default_policy(capacity_bytes: u64) -> Policy {
    Policy {
        capacity_bytes,
        stale: Some(DEFAULT_STALE),
        prefetch: Some(DEFAULT_PREFETCH),
        ..Policy::default()
    }
}

/// TTL (max) and MINTTL of a `success`/`denial` line or of `cache TTL`.
pub(crate) fn ttl(w: &Word, what: &str, zero_ok: bool, out: &mut Out<'_>) -> Option<u32> {
    let v: i64 = whole(w, what, out)?;
    if v < 0 || (v == 0 && !zero_ok) {
        let bound = if zero_ok {
            "negative"
        } else {
            "zero or negative"
        };
        out.err(w.line, format!("{what} cannot be {bound}: {v}"));
        return None;
    }
    match u32::try_from(v) {
        Ok(v) => Some(v),
        Err(_) => {
            out.err(w.line, format!("{what} is too large: {v}"));
            None
        }
    }
}

/// Zones of `cache` or of its `disable`, canonical; each bad one reported.
fn cache_zones(words: &[Word], what: &str, out: &mut Out<'_>) -> Vec<String> {
    let mut zones = Vec::new();
    for w in words {
        match values::zone(&w.text) {
            Ok(z) => zones.push(z),
            Err(e) => out.err(w.line, format!("{what}: {e}")),
        }
    }
    zones
}

/// Entries of a `success`/`denial` CAPACITY as CoreDNS sizes them: rounded down to a multiple
/// of its 256 shards, at least 1024.
fn entries(cap: u64) -> u64 {
    (cap - cap % 256).max(MIN_ENTRIES)
}

pub(crate) fn parse(d: &Directive, block_zones: &[String], out: &mut Out<'_>) -> Option<Policy> {
    let mut max = [None::<u32>; 2]; // success, denial
    let mut min = [None::<u32>; 2];
    let mut cap = [DEFAULT_ENTRIES; 2];
    let mut stale = Some(DEFAULT_STALE);
    let mut prefetch = Some(DEFAULT_PREFETCH);
    let (mut stale_written, mut prefetch_written) = (false, false);
    // `serve_stale_policy`: its line, and whether it asked for `prefer_positive`.
    let (mut policy_line, mut prefer_positive) = (None, false);
    let mut servfail = 5;
    let mut keep_ttl = false;
    let mut scope = Scope::default();
    let before = out.problems.len();

    let mut args = d.args.as_slice();
    if let Some(first) = args.first() {
        if first.text.parse::<i64>().is_ok() {
            if let Some(t) = ttl(first, "cache TTL", false, out) {
                max = [Some(t), Some(t)];
            }
            args = &args[1..];
        }
    }
    // ZONES: only names under them use the cache; none (or zones covering the whole block)
    // leaves the scope open, which costs the hit path nothing.
    let zones = cache_zones(args, "cache ZONES", out);
    if !block_zones
        .iter()
        .all(|b| zones.is_empty() || zones.iter().any(|z| values::is_under(b, z)))
    {
        scope.zones = zones.iter().map(|z| values::wire(z).into()).collect();
    }

    for o in &d.block {
        let name = o.name.as_str();
        match name {
            "success" | "denial" => {
                out.no_block(o, name);
                let syntax = format!("{name} CAPACITY [TTL [MINTTL]]");
                if !out.arity(o, name, 1, 3, &syntax) {
                    continue;
                }
                let class = usize::from(name == "denial");
                if let Some(c) = whole::<u64>(&o.args[0], &format!("{name} CAPACITY"), out) {
                    cap[class] = c;
                }
                if let Some(w) = o.args.get(1) {
                    max[class] = ttl(w, &format!("{name} TTL"), false, out);
                }
                if let Some(w) = o.args.get(2) {
                    min[class] = ttl(w, &format!("{name} MINTTL"), true, out);
                }
            }
            "prefetch" => {
                prefetch_written = true;
                out.no_block(o, name);
                if !out.arity(o, name, 1, 3, "prefetch AMOUNT [[DURATION] [PERCENTAGE%]]") {
                    continue;
                }
                let amount = whole::<u32>(&o.args[0], "prefetch AMOUNT", out);
                let mut percentage = DEFAULT_PREFETCH.percentage;
                let window = match o.args.get(1) {
                    Some(w) => duration(w, "prefetch DURATION", out).unwrap_or(PREFETCH_WINDOW),
                    None => PREFETCH_WINDOW,
                };
                if let Some(w) = o.args.get(2) {
                    match w.text.strip_suffix('%').map(str::parse::<u8>) {
                        Some(Ok(p)) if (10..=90).contains(&p) => percentage = p,
                        Some(Ok(p)) => out.err(w.line, format!("prefetch PERCENTAGE must be from 10% to 90%, not {p}%")),
                        _ => out.err(w.line, format!("prefetch PERCENTAGE must be a whole number and `%`, such as `10%`, not `{}`", w.text)),
                    }
                }
                prefetch = match amount {
                    Some(0) => None,
                    Some(amount) => Some(Prefetch {
                        amount,
                        window,
                        percentage,
                    }),
                    None => prefetch,
                };
            }
            "serve_stale" => {
                stale_written = true;
                out.no_block(o, name);
                if !out.arity(o, name, 0, 5, SERVE_STALE_SYNTAX) {
                    continue;
                }
                stale = serve_stale(o, out).unwrap_or(stale);
            }
            "serve_stale_policy" => {
                out.no_block(o, name);
                if policy_line.is_some() {
                    out.err(
                        o.line,
                        "serve_stale_policy can only be given once".to_owned(),
                    );
                    continue;
                }
                policy_line = Some(o.line);
                if !out.arity(o, name, 1, 1, "serve_stale_policy prefer_positive") {
                    continue;
                }
                let policy = &o.args[0].text;
                if policy.eq_ignore_ascii_case("prefer_positive") {
                    prefer_positive = true;
                } else {
                    out.err(
                        o.line,
                        format!("serve_stale_policy must be `prefer_positive`, not `{policy}`"),
                    );
                }
            }
            "servfail" => {
                out.no_block(o, name);
                if !out.arity(o, name, 1, 1, "servfail DURATION") {
                    continue;
                }
                if let Some(dur) = duration(&o.args[0], "servfail", out) {
                    if dur > MAX_SERVFAIL {
                        out.err(
                            o.line,
                            format!(
                                "servfail DURATION may not be longer than 5m, not `{}`",
                                o.args[0].text
                            ),
                        );
                    } else {
                        servfail = values::ceil_secs(dur);
                    }
                }
            }
            // CoreDNS 1.11.
            "keepttl" => {
                out.no_block(o, name);
                keep_ttl = out.arity(o, name, 0, 0, "keepttl");
            }
            "disable" => {
                out.no_block(o, name);
                if !out.arity(o, name, 1, usize::MAX, "disable success|denial [ZONES...]") {
                    continue;
                }
                let mut zones = cache_zones(&o.args[1..], "cache disable ZONES", out);
                if zones.is_empty() {
                    zones.push(".".to_owned());
                }
                let zones = zones.iter().map(|z| values::wire(z).into()).collect();
                // The last `disable` of a class wins, as in CoreDNS.
                match o.args[0].text.as_str() {
                    "success" => scope.no_success = zones,
                    "denial" => scope.no_denial = zones,
                    other => out.err(
                        o.line,
                        format!("cache disable: expected `success` or `denial`, not `{other}`"),
                    ),
                }
            }
            other => out.err(o.line, format!("unknown option `{other}` of `cache`")),
        }
    }
    if let Some(line) = policy_line {
        match &mut stale {
            Some(stale) => stale.prefer_positive = prefer_positive,
            None => out.err(
                line,
                "serve_stale_policy needs serve-stale, which `serve_stale 0s` turns off".to_owned(),
            ),
        }
    }
    if out.problems.len() > before {
        return None;
    }
    let defaults = Policy::default();
    let mut clamps = [defaults.success, defaults.denial];
    for (i, clamp) in clamps.iter_mut().enumerate() {
        let class = ["success", "denial"][i];
        let max = max[i].unwrap_or(clamp.max);
        let mut lo = min[i].unwrap_or(clamp.min);
        // CoreDNS applies the minimum, then the maximum: when they cross, the maximum wins.
        if lo > max {
            if min[i].is_some() {
                out.warn(
                    d.line,
                    format!(
                        "cache {class}: MINTTL {lo} is above TTL {max}; TTL wins, as in CoreDNS"
                    ),
                );
            }
            lo = max;
        }
        *clamp = Clamp { min: lo, max };
    }
    let policy = Policy {
        capacity_bytes: entries(cap[0])
            .saturating_add(entries(cap[1]))
            .saturating_mul(BYTES_PER_ENTRY),
        success: clamps[0],
        denial: clamps[1],
        servfail_ttl: servfail,
        stale,
        prefetch,
        keep_ttl,
        scope,
    };
    if let Err(e) = policy.validate() {
        for p in e.problems {
            out.err(d.line, format!("cache: {p}"));
        }
        return None;
    }
    let [success, denial] = cap.map(entries);
    out.differ(d.line, cache_size_difference(success, denial));
    if !prefetch_written {
        out.differ(d.line, PREFETCH_DIFFERENCE.to_owned());
    }
    if !stale_written {
        out.differ(d.line, STALE_DIFFERENCE.to_owned());
    }
    Some(policy)
}

const SERVE_STALE_SYNTAX: &str = "serve_stale [DURATION] [immediate [RESPONSE_TTL \
     [FAILURE_RECHECK]] | verify [VERIFY_TIMEOUT [RESPONSE_TTL [FAILURE_RECHECK]]]]";

/// `serve_stale`'s arguments as CoreDNS 1.14 reads them: `None` when one is wrong (reported),
/// `Some(None)` for a window of 0 (serve-stale off). What is not written takes CoreDNS's
/// default for a written `serve_stale` (`immediate`, no verify timeout, no failure recheck),
/// but the response TTL, which is RFC 8767's 30 s rather than CoreDNS's 0.
fn serve_stale(o: &Directive, out: &mut Out<'_>) -> Option<Option<Stale>> {
    let before = out.problems.len();
    let window = match o.args.first() {
        Some(w) => duration(w, "serve_stale DURATION", out),
        None => Some(DEFAULT_STALE.window),
    };
    let mut stale = Stale {
        window: window.unwrap_or_default(),
        refresh: Refresh::Immediate,
        recheck: Duration::ZERO,
        ..DEFAULT_STALE
    };
    // The words after the mode: (VERIFY_TIMEOUT) RESPONSE_TTL FAILURE_RECHECK.
    let mut rest = o.args.get(2..).unwrap_or_default();
    match o
        .args
        .get(1)
        .map(|w| w.text.to_ascii_lowercase())
        .as_deref()
    {
        None | Some("immediate") => {}
        Some("verify") => {
            let timeout = rest
                .first()
                .and_then(|w| duration(w, "serve_stale VERIFY_TIMEOUT", out));
            stale.refresh = Refresh::Verify {
                timeout: timeout.filter(|t| !t.is_zero()),
            };
            rest = rest.get(1..).unwrap_or_default();
        }
        Some(_) => out.err(
            o.line,
            format!(
                "serve_stale REFRESH_MODE must be `immediate` or `verify`, not `{}`",
                o.args[1].text
            ),
        ),
    }
    if rest.len() > 2 {
        out.err(
            o.line,
            format!(
                "serve_stale: expected `{SERVE_STALE_SYNTAX}`, got {} argument(s)",
                o.args.len()
            ),
        );
    }
    if let Some(w) = rest.first() {
        match duration(w, "serve_stale RESPONSE_TTL", out) {
            Some(ttl) if ttl.subsec_nanos() != 0 => out.err(
                w.line,
                format!(
                    "serve_stale RESPONSE_TTL must be a whole number of seconds, not `{}`",
                    w.text
                ),
            ),
            Some(ttl) if ttl.is_zero() => out.err(
                w.line,
                "serve_stale RESPONSE_TTL must be above 0: RFC 8767 §4 gives stale answers a TTL \
                 (30s unless told)"
                    .to_owned(),
            ),
            Some(ttl) => match u32::try_from(ttl.as_secs()) {
                Ok(secs) if secs <= nodedns_cache::MAX_TTL => stale.ttl = secs,
                _ => out.err(
                    w.line,
                    format!(
                        "serve_stale RESPONSE_TTL `{}` exceeds the DNS TTL range",
                        w.text
                    ),
                ),
            },
            None => {}
        }
    }
    if let Some(w) = rest.get(1) {
        match duration(w, "serve_stale FAILURE_RECHECK", out) {
            Some(recheck) if recheck > nodedns_cache::MAX_RECHECK => out.err(
                w.line,
                format!(
                    "serve_stale FAILURE_RECHECK cannot exceed 5m, not `{}`",
                    w.text
                ),
            ),
            Some(recheck) => stale.recheck = recheck,
            None => {}
        }
    }
    if out.problems.len() > before {
        return None;
    }
    Some((!stale.window.is_zero()).then_some(stale))
}

/// What nodedns's default prefetch does that CoreDNS's absent one does not.
const PREFETCH_DIFFERENCE: &str = "cache: prefetch is on without a `prefetch` line \
     (an entry asked for twice, with no gap over 1m, is refreshed in the background when 10% of \
     its TTL is left); \
     node-cache's CoreDNS prefetches only with one. `prefetch 0` turns it off";

/// What nodedns's default serve-stale does that CoreDNS's absent one does not.
const STALE_DIFFERENCE: &str = "cache: serve_stale is on without a `serve_stale` \
     line (an expired entry is answered with TTL 30 for up to 1h when the upstream cannot \
     answer: as `serve_stale 1h verify 0 30s 5s`); node-cache's CoreDNS answers nothing stale \
     without one. `serve_stale 0s` turns it off";

/// How a cache of `success` and `denial` entries (as CoreDNS rounds them) is sized here.
fn cache_size_difference(success: u64, denial: u64) -> String {
    let bytes = success
        .saturating_add(denial)
        .saturating_mul(BYTES_PER_ENTRY);
    format!(
        "cache: sized in bytes, not entries: {success} success + {denial} denial entries at \
         {BYTES_PER_ENTRY} B each make one budget of {bytes} bytes ({:.2} MiB) for both classes, \
         whatever the answers weigh; node-cache's CoreDNS keeps up to {success} and {denial} \
         entries of any size",
        bytes as f64 / f64::from(1 << 20)
    )
}
