//! How long each class of reply is kept. Defaults are CoreDNS's cache plugin's, which is what
//! node-local-dns users run today.

use std::time::Duration;

use crate::Class;

/// The largest TTL a record may carry: values with the top bit set are treated as 0
/// (RFC 2181 §8), so no lifetime bound above this can take effect.
pub const MAX_TTL: u32 = 0x7fff_ffff;

/// Lower and upper bound, in seconds, for the lifetime of one class of entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Clamp {
    pub min: u32,
    pub max: u32,
}

impl Clamp {
    /// `ttl` moved into `[min, max]`.
    pub fn apply(&self, ttl: u32) -> u32 {
        ttl.max(self.min).min(self.max)
    }
}

/// The shortest failure recheck: a fetch of one entry that failed is not retried in the
/// background sooner than this, whatever the policy says (CoreDNS retries on the next hit), so an
/// upstream that fails every query is not asked again for each hot name as fast as it answers.
pub const MIN_RECHECK: Duration = Duration::from_secs(1);

/// The longest failure recheck (RFC 8767 §5: "SHOULD NOT be greater than 5 minutes"; CoreDNS
/// refuses more).
pub const MAX_RECHECK: Duration = Duration::from_secs(300);

/// Serve-stale (RFC 8767): answer from an expired entry when upstream cannot answer.
///
/// What counts as "cannot answer" (RFC 8767 §4: any RCODE but NOERROR and NXDOMAIN is a failure
/// to refresh, which leaves the previous state intact): SERVFAIL, REFUSED and every other RCODE,
/// no reply in time, a connection error, a reply that does not parse. See [`crate::Cache::update`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stale {
    /// How long after expiry an entry may still be served (RFC 8767 §5 suggests 1–3 days;
    /// CoreDNS's default is 1 h).
    pub window: Duration,
    /// TTL put in stale answers (RFC 8767 §4: 30 s).
    pub ttl: u32,
    /// When an entry inside the window is answered: at once, or after the upstream failed.
    pub refresh: Refresh,
    /// After a fetch of the entry failed, how long it is answered at once without asking the
    /// upstream again (RFC 8767 §5's failure recheck timer, CoreDNS's FAILURE_RECHECK), at
    /// least [`MIN_RECHECK`].
    pub recheck: Duration,
    /// CoreDNS's `serve_stale_policy prefer_positive`: a positive entry (fresh, or stale inside
    /// the window) is kept and answered when the upstream suddenly denies the name (NXDOMAIN,
    /// NODATA), until it leaves its window or a positive answer replaces it.
    pub prefer_positive: bool,
}

/// When an expired entry inside the stale window is answered (CoreDNS's `serve_stale`
/// REFRESH_MODE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refresh {
    /// `immediate` (CoreDNS's default): answered at once, and refreshed in the background.
    Immediate,
    /// `verify`: the upstream is asked first; the stale entry answers only if that fails.
    /// `timeout` (CoreDNS's VERIFY_TIMEOUT): how long a client waits for the upstream before it
    /// gets the stale entry while the fetch goes on to refresh the cache; `None`, until the
    /// upstream's own deadline.
    Verify { timeout: Option<Duration> },
}

/// Prefetch (CoreDNS's `prefetch AMOUNT DURATION PERCENTAGE%`): refresh a popular entry before
/// it expires, so hot names never miss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefetch {
    /// Hits an entry needs to be worth refreshing...
    pub amount: u32,
    /// ...with no gap of more than this (in whole seconds) between one hit and the next (or the
    /// store and the first hit): a gap starts the count again (CoreDNS: DURATION, default 1 m).
    /// Hits carry over to the entry a prefetch stores.
    pub window: Duration,
    /// Refresh once the remaining lifetime is at most this percentage of the stored TTL
    /// (and in any case during the entry's last second, so short entries are refreshed too).
    pub percentage: u8,
}

/// CoreDNS's prefetch DURATION when none is given.
pub const PREFETCH_WINDOW: Duration = Duration::from_secs(60);

impl Prefetch {
    /// Remaining lifetime, in seconds, at or below which an entry of lifetime `ttl` is due:
    /// `percentage`% of `ttl`, rounded up as CoreDNS rounds it, and at least 1 s (a fresh entry
    /// always has ≥ 1 s left, so the last second is always due).
    pub fn threshold(&self, ttl: u32) -> u32 {
        let share = (u64::from(ttl) * u64::from(self.percentage)).div_ceil(100);
        // `share` ≤ `ttl` while percentage ≤ 100 (`validate`); saturate rather than trust that.
        u32::try_from(share).unwrap_or(u32::MAX).max(1)
    }
}

/// Which names a cache handles and keeps, each list in wire form, lowercase.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// `cache ZONES` narrower than its block: only names at or below one of these are looked up
    /// and stored ([`crate::Cache::covers`]). Empty: every name.
    pub zones: Vec<Box<[u8]>>,
    /// `disable success ZONES`: success answers for names at or below these are not kept.
    pub no_success: Vec<Box<[u8]>>,
    /// `disable denial ZONES`: denials and SERVFAILs for names at or below these are not kept
    /// (CoreDNS keeps both in its denial cache).
    pub no_denial: Vec<Box<[u8]>>,
}

impl Scope {
    /// Whether an answer of `class` for `qname` must not be kept.
    pub(crate) fn disabled(&self, class: Class, qname: &[u8]) -> bool {
        let zones = match class {
            Class::Success => &self.no_success,
            Class::Denial | Class::ServFail => &self.no_denial,
        };
        zones.iter().any(|z| nodedns_wire::is_subdomain(qname, z))
    }
}

/// Everything that decides what one cache keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Total bytes of entries (keys, replies, bookkeeping) the cache may hold.
    pub capacity_bytes: u64,
    /// Lifetime bounds for positive answers (NOERROR with records in the answer section).
    pub success: Clamp,
    /// Lifetime bounds for NXDOMAIN and NODATA.
    pub denial: Clamp,
    /// How long a SERVFAIL from upstream is kept (CoreDNS: 5 s; 0 disables).
    pub servfail_ttl: u32,
    /// `None`: an expired entry is never served.
    pub stale: Option<Stale>,
    /// `None`: entries are only refreshed by the miss after they expire.
    pub prefetch: Option<Prefetch>,
    /// `keepttl` (CoreDNS 1.11): a fresh hit carries the TTLs the entry was stored with, not
    /// what is left of them (the entry still expires on time).
    pub keep_ttl: bool,
    /// Which names the cache handles and keeps.
    pub scope: Scope,
}

/// A policy that cannot work, with every bad field named.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid cache policy: {}", .problems.join("; "))]
pub struct PolicyError {
    pub problems: Vec<String>,
}

impl Default for Policy {
    /// CoreDNS's `cache` defaults: success [5 s, 3600 s], denial [5 s, 1800 s], SERVFAIL 5 s,
    /// no serve-stale, no prefetch; 16 MiB.
    fn default() -> Self {
        Policy {
            capacity_bytes: 16 * 1024 * 1024,
            success: Clamp { min: 5, max: 3600 },
            denial: Clamp { min: 5, max: 1800 },
            servfail_ttl: 5,
            stale: None,
            prefetch: None,
            keep_ttl: false,
            scope: Scope::default(),
        }
    }
}

impl Policy {
    /// Checks every field at once (min ≤ max, percentage in 1..=100, capacity > 0, ...).
    pub fn validate(&self) -> Result<(), PolicyError> {
        let mut problems = Vec::new();
        if self.capacity_bytes == 0 {
            problems.push("capacity_bytes: must be above 0".to_owned());
        }
        for (name, clamp) in [("success", &self.success), ("denial", &self.denial)] {
            if clamp.min > clamp.max {
                problems.push(format!(
                    "{name}: minimum TTL {} is above maximum TTL {}",
                    clamp.min, clamp.max
                ));
            }
            if clamp.max > MAX_TTL {
                problems.push(format!(
                    "{name}: maximum TTL {} is above {MAX_TTL} (RFC 2181 §8)",
                    clamp.max
                ));
            }
        }
        if self.servfail_ttl > MAX_TTL {
            problems.push(format!(
                "servfail_ttl: {} is above {MAX_TTL} (RFC 2181 §8)",
                self.servfail_ttl
            ));
        }
        if let Some(stale) = &self.stale {
            if stale.window.is_zero() {
                problems.push("stale.window: must be above 0".to_owned());
            }
            if stale.ttl == 0 {
                problems.push("stale.ttl: must be above 0".to_owned());
            }
            if stale.ttl > MAX_TTL {
                problems.push(format!(
                    "stale.ttl: {} is above {MAX_TTL} (RFC 2181 §8)",
                    stale.ttl
                ));
            }
            if stale.recheck > MAX_RECHECK {
                problems.push(format!(
                    "stale.recheck: {:?} is above {MAX_RECHECK:?} (RFC 8767 §5)",
                    stale.recheck
                ));
            }
            if let Refresh::Verify {
                timeout: Some(timeout),
            } = stale.refresh
            {
                if timeout.is_zero() {
                    problems.push("stale.refresh: a verify timeout must be above 0".to_owned());
                }
            }
        }
        if let Some(prefetch) = &self.prefetch {
            if prefetch.amount == 0 {
                problems.push("prefetch.amount: must be at least 1".to_owned());
            }
            if !(1..=100).contains(&prefetch.percentage) {
                problems.push(format!(
                    "prefetch.percentage: {} is not in 1..=100",
                    prefetch.percentage
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(PolicyError { problems })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_coredns_cache_defaults() {
        let p = Policy::default();
        assert_eq!(p.capacity_bytes, 16 << 20);
        assert_eq!(p.success, Clamp { min: 5, max: 3600 });
        assert_eq!(p.denial, Clamp { min: 5, max: 1800 });
        assert_eq!(p.servfail_ttl, 5);
        assert_eq!(p.stale, None);
        assert_eq!(p.prefetch, None);
        assert_eq!(p.validate(), Ok(()));
    }

    #[test]
    fn validate_reports_every_bad_field_at_once() {
        let p = Policy {
            capacity_bytes: 0,
            success: Clamp { min: 30, max: 10 },
            denial: Clamp {
                min: 5,
                max: u32::MAX,
            },
            servfail_ttl: u32::MAX,
            stale: Some(Stale {
                window: Duration::ZERO,
                ttl: 0,
                refresh: Refresh::Verify {
                    timeout: Some(Duration::ZERO),
                },
                recheck: Duration::from_secs(301),
                prefer_positive: false,
            }),
            prefetch: Some(Prefetch {
                amount: 0,
                window: PREFETCH_WINDOW,
                percentage: 101,
            }),
            ..Policy::default()
        };
        let err = p.validate().unwrap_err();
        let fields: Vec<&str> = err
            .problems
            .iter()
            .map(|p| p.split(':').next().unwrap())
            .collect();
        assert_eq!(
            fields,
            [
                "capacity_bytes",
                "success",
                "denial",
                "servfail_ttl",
                "stale.window",
                "stale.ttl",
                "stale.recheck",
                "stale.refresh",
                "prefetch.amount",
                "prefetch.percentage",
            ]
        );
        let text = err.to_string();
        assert!(
            text.starts_with("invalid cache policy: capacity_bytes"),
            "{text}"
        );
        assert!(
            text.contains("minimum TTL 30 is above maximum TTL 10"),
            "{text}"
        );
    }

    #[test]
    fn zero_percentage_is_rejected() {
        let p = Policy {
            prefetch: Some(Prefetch {
                amount: 1,
                window: PREFETCH_WINDOW,
                percentage: 0,
            }),
            ..Policy::default()
        };
        assert_eq!(p.validate().unwrap_err().problems.len(), 1);
    }

    #[test]
    fn clamp_moves_ttl_into_bounds() {
        let c = Clamp { min: 5, max: 3600 };
        assert_eq!(c.apply(0), 5);
        assert_eq!(c.apply(300), 300);
        assert_eq!(c.apply(86_400), 3600);
    }

    #[test]
    fn prefetch_threshold_is_at_least_one_second() {
        let p = Prefetch {
            amount: 1,
            window: PREFETCH_WINDOW,
            percentage: 10,
        };
        assert_eq!(p.threshold(5), 1);
        assert_eq!(p.threshold(300), 30);
        assert_eq!(p.threshold(0), 1);
        let all = Prefetch {
            amount: 1,
            window: PREFETCH_WINDOW,
            percentage: 100,
        };
        assert_eq!(all.threshold(u32::MAX), u32::MAX);
    }
}
