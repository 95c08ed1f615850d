//! The byte-bounded map from key bytes to entries.
//!
//! A moka `sync::Cache` does the bounding: its weigher charges each entry its key, its reply's
//! heap bytes and [`ENTRY_OVERHEAD`], and its TinyLFU admission refuses a newcomer that is less
//! popular than the entries it would push out, so a flood of random names (each seen once)
//! cannot wash the hot set out. moka's time-to-live is not used: it reads its own clock, and this
//! crate takes `now` from the caller; lifetimes are checked on lookup instead.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moka::notification::RemovalCause;
use nodedns_wire::{Reply, TtlRule, rcode};

use crate::{Class, Entry, Policy};

/// What moka keeps per entry besides the key bytes and the value: the concurrent hash table's
/// bucket and key `Arc`, the entry's bookkeeping (timestamps, weight, generation), its node in
/// the LRU list and its share of the frequency sketch. Measured with a counting allocator on
/// moka 0.12.16 (x86_64, weigher and eviction listener set, 10⁴–10⁵ entries, table growth
/// amortized): ≈ 238 bytes.
const MOKA_ENTRY_BYTES: usize = 240;

/// Bytes an entry costs beyond its key and [`Reply::heap_size`]: moka's bookkeeping plus the
/// `Arc<Entry>` allocation (two reference counts and the [`Entry`] itself). Allocator rounding
/// is not counted, so the real footprint runs a few percent above the configured capacity.
pub const ENTRY_OVERHEAD: usize = MOKA_ENTRY_BYTES + 2 * size_of::<usize>() + size_of::<Entry>();

/// A byte-bounded cache of replies.
pub struct Cache {
    policy: Policy,
    map: moka::sync::Cache<Box<[u8]>, Arc<Entry>>,
    counters: Arc<Counters>,
}

/// Entries per class and size evictions. Kept by counting: +1 when `insert` hands an entry to
/// moka, −1 when moka's eviction listener reports it gone (replaced, invalidated, evicted, or
/// refused admission), so the numbers are exact once moka's pending tasks have run.
#[derive(Debug, Default)]
struct Counters {
    success: AtomicU64,
    denial: AtomicU64,
    servfail: AtomicU64,
    evictions: AtomicU64,
}

impl Counters {
    fn class(&self, class: Class) -> &AtomicU64 {
        match class {
            Class::Success => &self.success,
            Class::Denial => &self.denial,
            Class::ServFail => &self.servfail,
        }
    }
}

/// The result of a lookup.
#[derive(Debug)]
pub enum Lookup {
    /// Fresh: serve it with `ttl`. `prefetch` is true exactly once per entry, when it became due
    /// for a refresh under the prefetch policy: the caller should refresh it in the background.
    Fresh {
        entry: Arc<Entry>,
        ttl: TtlRule,
        prefetch: bool,
    },
    /// Expired but inside the stale window: serve it with `ttl` (TTLs capped at the stale TTL)
    /// only if upstream cannot answer.
    Stale { entry: Arc<Entry>, ttl: TtlRule },
    /// Nothing usable.
    Miss,
}

impl Lookup {
    /// The entry found, fresh or stale.
    pub fn entry(&self) -> Option<&Arc<Entry>> {
        match self {
            Lookup::Fresh { entry, .. } | Lookup::Stale { entry, .. } => Some(entry),
            Lookup::Miss => None,
        }
    }
}

/// What an insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    Stored(Class),
    /// Not cacheable: truncated, REFUSED/FORMERR/NOTIMP/other RCODEs, a denial without SOA
    /// (RFC 2308 §5), SERVFAIL with `servfail_ttl` 0, or a lifetime of 0 after clamping.
    NotCacheable,
}

/// What [`Cache::store`] did, with what to answer from.
#[derive(Debug)]
pub enum Stored {
    Entry(Arc<Entry>),
    NotCacheable(Reply),
}

/// Sizes for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Entries of each class (CoreDNS `coredns_cache_entries{type=...}`).
    pub success: u64,
    pub denial: u64,
    pub servfail: u64,
    /// Weighted size of all entries, in the unit of `Policy::capacity_bytes`.
    pub bytes: u64,
    /// Entries dropped to keep within capacity, newcomers that TinyLFU refused included
    /// (CoreDNS `coredns_cache_evictions_total`).
    pub evictions: u64,
}

impl Cache {
    /// A cache for `policy`, which should have passed [`Policy::validate`].
    pub fn new(policy: Policy) -> Self {
        let counters = Arc::new(Counters::default());
        let listener_counters = Arc::clone(&counters);
        let map = moka::sync::Cache::<Box<[u8]>, Arc<Entry>>::builder()
            .max_capacity(policy.capacity_bytes)
            .weigher(|key, entry| weight(key, entry))
            .eviction_listener(
                move |_key: Arc<Box<[u8]>>, entry: Arc<Entry>, cause: RemovalCause| {
                    listener_counters
                        .class(entry.class())
                        .fetch_sub(1, Ordering::Relaxed);
                    if cause == RemovalCause::Size {
                        listener_counters.evictions.fetch_add(1, Ordering::Relaxed);
                    }
                },
            )
            .build();
        Cache {
            policy,
            map,
            counters,
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Looks `key` up at `now`. Allocates nothing, except on the one lookup that finds an entry
    /// past all use and removes it (moka's removal allocates a few small objects).
    ///
    /// The age is whole seconds since the entry was stored (0 if `now` is earlier). An entry is
    /// fresh while its age is below its lifetime; then, with a stale policy and for success and
    /// denial entries only (a stale SERVFAIL is no better than a synthesized one), it is stale
    /// while less than `stale.window` has passed since it expired; after that it is a miss and
    /// is removed.
    pub fn lookup(&self, key: &[u8], now: Instant) -> Lookup {
        let Some(entry) = self.map.get(key) else {
            return Lookup::Miss;
        };
        let elapsed = now.saturating_duration_since(entry.stored());
        let age = u32::try_from(elapsed.as_secs()).unwrap_or(u32::MAX);
        let ttl = entry.ttl();
        if age < ttl {
            let remaining = ttl - age;
            let hits = entry.hit();
            let prefetch = self.policy.prefetch.is_some_and(|p| {
                hits >= p.amount && remaining <= p.threshold(ttl) && entry.claim_prefetch()
            });
            return Lookup::Fresh {
                entry,
                ttl: TtlRule {
                    age,
                    cap: remaining,
                },
                prefetch,
            };
        }
        if let Some(stale) = self
            .policy
            .stale
            .filter(|_| entry.class() != Class::ServFail)
        {
            // `None` (a window too long to add): every expired entry is within it.
            let within = Duration::from_secs(ttl.into())
                .checked_add(stale.window)
                .is_none_or(|end| elapsed < end);
            if within {
                return Lookup::Stale {
                    entry,
                    ttl: TtlRule {
                        age: 0,
                        cap: stale.ttl,
                    },
                };
            }
        }
        // Expired for good: free the space now rather than when moka gets round to evicting it.
        // If another task stored a fresh reply for this key since our `get`, that is removed too;
        // the cost is one more upstream query, not a wrong answer.
        self.map.invalidate(key);
        Lookup::Miss
    }

    /// Classifies `reply`, clamps its lifetime and stores it under `key` at `now`, replacing any
    /// entry there.
    ///
    /// - SERVFAIL: kept `servfail_ttl` seconds (CoreDNS: 5 s).
    /// - NOERROR with answers: success, lifetime the smallest TTL in the reply, clamped.
    /// - NXDOMAIN, or NOERROR without answers (NODATA): denial, lifetime min(SOA TTL, SOA
    ///   MINIMUM) (RFC 2308 §5), clamped; not kept without an SOA in the authority section.
    /// - Truncated replies and every other RCODE: not kept.
    ///
    /// A `Stored` reply may still be refused by moka's admission when the cache is full and the
    /// key is less popular than what it would displace; that shows in [`Stats::evictions`].
    pub fn insert(&self, key: &[u8], reply: Reply, now: Instant) -> Inserted {
        match self.store(key, reply, now) {
            Stored::Entry(entry) => Inserted::Stored(entry.class()),
            Stored::NotCacheable(_) => Inserted::NotCacheable,
        }
    }

    /// Like [`Cache::insert`], but hands back what the caller needs to answer the clients that
    /// waited for this reply: the new entry (served with `TtlRule { age: 0, cap: entry.ttl() }`),
    /// or the reply itself when it is not cacheable. Neither counts as a hit.
    pub fn store(&self, key: &[u8], reply: Reply, now: Instant) -> Stored {
        let Some((class, ttl)) = self.classify(&reply) else {
            return Stored::NotCacheable(reply);
        };
        if ttl == 0 {
            return Stored::NotCacheable(reply);
        }
        // Count before handing over: the listener's decrement for this entry (if it is refused
        // or replaced at once) can then never run ahead of the increment.
        self.counters.class(class).fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(Entry::new(reply, class, ttl, now));
        self.map.insert(key.into(), entry.clone());
        Stored::Entry(entry)
    }

    /// The class and clamped lifetime `reply` would be stored with, or `None` if it is not
    /// cacheable at all.
    fn classify(&self, reply: &Reply) -> Option<(Class, u32)> {
        let info = reply.info();
        if info.truncated {
            return None;
        }
        match info.rcode {
            r if r == u16::from(rcode::SERVFAIL) => {
                Some((Class::ServFail, self.policy.servfail_ttl))
            }
            r if r == u16::from(rcode::NOERROR) && info.answers > 0 => {
                Some((Class::Success, self.policy.success.apply(info.min_ttl?)))
            }
            r if r == u16::from(rcode::NOERROR) || r == u16::from(rcode::NXDOMAIN) => {
                Some((Class::Denial, self.policy.denial.apply(info.negative_ttl?)))
            }
            _ => None,
        }
    }

    /// Entry counts, bytes and evictions. Runs moka's pending maintenance first (bounded work:
    /// it drains moka's fixed-size operation logs), so the numbers reflect every insert and
    /// eviction so far; meant for metrics scrapes, not for the query path.
    pub fn stats(&self) -> Stats {
        self.map.run_pending_tasks();
        Stats {
            success: self.counters.success.load(Ordering::Relaxed),
            denial: self.counters.denial.load(Ordering::Relaxed),
            servfail: self.counters.servfail.load(Ordering::Relaxed),
            bytes: self.map.weighted_size(),
            evictions: self.counters.evictions.load(Ordering::Relaxed),
        }
    }
}

impl fmt::Debug for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not moka's Debug: that lists every entry.
        f.debug_struct("Cache")
            .field("policy", &self.policy)
            .field("entries", &self.map.entry_count())
            .field("bytes", &self.map.weighted_size())
            .finish_non_exhaustive()
    }
}

/// What an entry costs against `Policy::capacity_bytes`.
fn weight(key: &[u8], entry: &Entry) -> u32 {
    let bytes = key.len() + entry.reply().heap_size() + ENTRY_OVERHEAD;
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use hickory_proto::op::{Message, OpCode, Query, ResponseCode};
    use hickory_proto::rr::rdata::{A, SOA};
    use hickory_proto::rr::{Name, RData, Record, RecordType};

    use super::*;
    use crate::{Clamp, Prefetch, Stale};

    /// An upstream reply to `name` A: `rcode`, one A record per TTL in `answers`, and an SOA
    /// with (TTL, MINIMUM) in the authority section if `soa` is given.
    fn reply(
        name: &str,
        rcode: ResponseCode,
        answers: &[u32],
        soa: Option<(u32, u32)>,
        truncated: bool,
    ) -> Reply {
        let name = Name::from_ascii(name).unwrap();
        let mut msg = Message::response(0x1234, OpCode::Query);
        msg.metadata.response_code = rcode;
        msg.metadata.truncation = truncated;
        msg.metadata.recursion_desired = true;
        msg.metadata.recursion_available = true;
        msg.add_query(Query::query(name.clone(), RecordType::A));
        for (i, ttl) in answers.iter().enumerate() {
            let addr = Ipv4Addr::new(10, 0, (i >> 8) as u8, i as u8);
            msg.add_answer(Record::from_rdata(name.clone(), *ttl, RData::A(A(addr))));
        }
        if let Some((ttl, minimum)) = soa {
            let zone = Name::from_ascii("example.").unwrap();
            let soa = SOA::new(
                Name::from_ascii("ns.example.").unwrap(),
                Name::from_ascii("hostmaster.example.").unwrap(),
                1,
                3600,
                600,
                86_400,
                minimum,
            );
            msg.add_authority(Record::from_rdata(zone, ttl, RData::SOA(soa)));
        }
        Reply::parse(&msg.to_vec().unwrap()).unwrap()
    }

    fn success(ttls: &[u32]) -> Reply {
        reply("www.example.", ResponseCode::NoError, ttls, None, false)
    }

    fn nxdomain(soa: Option<(u32, u32)>) -> Reply {
        reply("nx.example.", ResponseCode::NXDomain, &[], soa, false)
    }

    fn servfail() -> Reply {
        reply("www.example.", ResponseCode::ServFail, &[], None, false)
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    /// The lifetime `reply` is stored with, read back through a lookup at the store time.
    fn stored_ttl(cache: &Cache, reply: Reply) -> Option<u32> {
        let t0 = Instant::now();
        cache.insert(b"k", reply, t0);
        match cache.lookup(b"k", t0) {
            Lookup::Fresh { entry, ttl, .. } => {
                assert_eq!(
                    ttl,
                    TtlRule {
                        age: 0,
                        cap: entry.ttl()
                    }
                );
                Some(entry.ttl())
            }
            _ => None,
        }
    }

    #[test]
    fn success_lives_its_smallest_ttl() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        assert_eq!(
            cache.insert(b"k", success(&[300, 60, 900]), t0),
            Inserted::Stored(Class::Success)
        );
        let Lookup::Fresh { entry, .. } = cache.lookup(b"k", t0) else {
            panic!("fresh entry missed")
        };
        assert_eq!(
            (entry.class(), entry.ttl(), entry.stored()),
            (Class::Success, 60, t0)
        );
    }

    #[test]
    fn success_ttl_clamped_to_max() {
        let cache = Cache::new(Policy::default());
        assert_eq!(stored_ttl(&cache, success(&[86_400])), Some(3600));
        let tight = Cache::new(Policy {
            success: Clamp { min: 30, max: 9984 },
            ..Policy::default()
        });
        assert_eq!(stored_ttl(&tight, success(&[20_000])), Some(9984));
    }

    #[test]
    fn success_ttl_raised_to_min() {
        let cache = Cache::new(Policy::default());
        assert_eq!(stored_ttl(&cache, success(&[1])), Some(5));
        assert_eq!(
            stored_ttl(&cache, success(&[0])),
            Some(5),
            "TTL 0 is still kept min s"
        );
    }

    #[test]
    fn negative_answer_lives_soa_minimum() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        assert_eq!(
            cache.insert(b"nx", nxdomain(Some((3600, 30))), t0),
            Inserted::Stored(Class::Denial)
        );
        assert!(matches!(
            cache.lookup(b"nx", t0 + secs(29)),
            Lookup::Fresh { .. }
        ));
        assert!(matches!(cache.lookup(b"nx", t0 + secs(30)), Lookup::Miss));
        // RFC 2308 §5: the SOA's own TTL bounds it too.
        assert_eq!(stored_ttl(&cache, nxdomain(Some((20, 600)))), Some(20));
    }

    #[test]
    fn nodata_is_a_denial() {
        let cache = Cache::new(Policy::default());
        let nodata = reply(
            "www.example.",
            ResponseCode::NoError,
            &[],
            Some((300, 60)),
            false,
        );
        assert_eq!(
            cache.insert(b"k", nodata, Instant::now()),
            Inserted::Stored(Class::Denial)
        );
        assert_eq!(cache.stats().denial, 1);
    }

    #[test]
    fn denial_ttl_clamped() {
        let cache = Cache::new(Policy::default());
        assert_eq!(
            stored_ttl(&cache, nxdomain(Some((86_400, 86_400)))),
            Some(1800)
        );
        assert_eq!(stored_ttl(&cache, nxdomain(Some((1, 1)))), Some(5));
        let node_local = Cache::new(Policy {
            denial: Clamp { min: 5, max: 5 },
            ..Policy::default()
        });
        assert_eq!(
            stored_ttl(&node_local, nxdomain(Some((3600, 3600)))),
            Some(5)
        );
    }

    #[test]
    fn denial_without_soa_not_cached() {
        let cache = Cache::new(Policy::default());
        assert_eq!(
            cache.insert(b"nx", nxdomain(None), Instant::now()),
            Inserted::NotCacheable
        );
        let nodata = reply("www.example.", ResponseCode::NoError, &[], None, false);
        assert_eq!(
            cache.insert(b"nd", nodata, Instant::now()),
            Inserted::NotCacheable
        );
        assert!(matches!(cache.lookup(b"nx", Instant::now()), Lookup::Miss));
        assert_eq!(cache.stats(), Stats::default());
    }

    #[test]
    fn servfail_kept_five_seconds() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        assert_eq!(
            cache.insert(b"k", servfail(), t0),
            Inserted::Stored(Class::ServFail)
        );
        assert!(matches!(
            cache.lookup(b"k", t0 + Duration::from_millis(4999)),
            Lookup::Fresh {
                ttl: TtlRule { age: 4, cap: 1 },
                ..
            }
        ));
        assert!(matches!(cache.lookup(b"k", t0 + secs(5)), Lookup::Miss));
    }

    #[test]
    fn servfail_not_cached_when_disabled() {
        let cache = Cache::new(Policy {
            servfail_ttl: 0,
            ..Policy::default()
        });
        assert_eq!(
            cache.insert(b"k", servfail(), Instant::now()),
            Inserted::NotCacheable
        );
    }

    #[test]
    fn servfail_never_served_stale() {
        let cache = Cache::new(Policy {
            stale: Some(Stale {
                window: secs(3600),
                ttl: 30,
            }),
            ..Policy::default()
        });
        let t0 = Instant::now();
        cache.insert(b"k", servfail(), t0);
        assert!(matches!(cache.lookup(b"k", t0 + secs(6)), Lookup::Miss));
    }

    #[test]
    fn truncated_reply_not_cached() {
        let cache = Cache::new(Policy::default());
        let tc = reply("www.example.", ResponseCode::NoError, &[300], None, true);
        assert_eq!(
            cache.insert(b"k", tc, Instant::now()),
            Inserted::NotCacheable
        );
        let tc_nx = reply(
            "nx.example.",
            ResponseCode::NXDomain,
            &[],
            Some((60, 60)),
            true,
        );
        assert_eq!(
            cache.insert(b"k", tc_nx, Instant::now()),
            Inserted::NotCacheable
        );
        assert!(matches!(cache.lookup(b"k", Instant::now()), Lookup::Miss));
    }

    #[test]
    fn other_rcodes_not_cached() {
        let cache = Cache::new(Policy::default());
        for rcode in [
            ResponseCode::Refused,
            ResponseCode::FormErr,
            ResponseCode::NotImp,
            ResponseCode::YXDomain,
            ResponseCode::NotAuth,
        ] {
            let r = reply("www.example.", rcode, &[300], Some((60, 60)), false);
            assert_eq!(
                cache.insert(b"k", r, Instant::now()),
                Inserted::NotCacheable,
                "{rcode:?}"
            );
        }
        assert_eq!(cache.stats(), Stats::default());
    }

    #[test]
    fn zero_lifetime_after_clamp_not_cached() {
        let cache = Cache::new(Policy {
            denial: Clamp { min: 0, max: 0 },
            ..Policy::default()
        });
        assert_eq!(
            cache.insert(b"k", nxdomain(Some((60, 60))), Instant::now()),
            Inserted::NotCacheable
        );
    }

    #[test]
    fn fresh_ttl_counts_whole_seconds_of_age() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        cache.insert(b"k", success(&[60]), t0);
        let at = |d: Duration| match cache.lookup(b"k", t0 + d) {
            Lookup::Fresh { ttl, .. } => Some(ttl),
            _ => None,
        };
        assert_eq!(at(Duration::ZERO), Some(TtlRule { age: 0, cap: 60 }));
        assert_eq!(
            at(Duration::from_millis(999)),
            Some(TtlRule { age: 0, cap: 60 })
        );
        assert_eq!(at(secs(7)), Some(TtlRule { age: 7, cap: 53 }));
        assert_eq!(
            at(Duration::from_millis(59_999)),
            Some(TtlRule { age: 59, cap: 1 })
        );
        assert_eq!(at(secs(60)), None);
    }

    #[test]
    fn now_before_stored_is_age_zero() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now() + secs(100);
        cache.insert(b"k", success(&[60]), t0);
        assert!(matches!(
            cache.lookup(b"k", t0 - secs(10)),
            Lookup::Fresh {
                ttl: TtlRule { age: 0, cap: 60 },
                ..
            }
        ));
    }

    #[test]
    fn expired_entry_misses_and_is_removed() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        cache.insert(b"k", success(&[30]), t0);
        assert_eq!(cache.stats().success, 1);
        assert!(matches!(cache.lookup(b"k", t0 + secs(30)), Lookup::Miss));
        assert_eq!(
            cache.stats().success,
            0,
            "an expired entry is dropped, not kept"
        );
        assert!(
            matches!(cache.lookup(b"k", t0), Lookup::Miss),
            "gone even for an earlier now"
        );
    }

    #[test]
    fn stale_served_within_window_only() {
        let cache = Cache::new(Policy {
            stale: Some(Stale {
                window: secs(3600),
                ttl: 30,
            }),
            ..Policy::default()
        });
        let t0 = Instant::now();
        cache.insert(b"k", success(&[300]), t0);
        cache.insert(b"nx", nxdomain(Some((60, 60))), t0);
        assert!(matches!(
            cache.lookup(b"k", t0 + secs(299)),
            Lookup::Fresh { .. }
        ));
        for at in [secs(300), secs(1000), secs(300 + 3599)] {
            let Lookup::Stale { entry, ttl } = cache.lookup(b"k", t0 + at) else {
                panic!("not stale at {at:?}")
            };
            assert_eq!(
                ttl,
                TtlRule { age: 0, cap: 30 },
                "TTLs capped at the stale TTL"
            );
            assert_eq!(entry.class(), Class::Success);
        }
        assert!(matches!(
            cache.lookup(b"nx", t0 + secs(61)),
            Lookup::Stale { .. }
        ));
        assert!(matches!(
            cache.lookup(b"k", t0 + secs(300 + 3600)),
            Lookup::Miss
        ));
        assert!(
            matches!(cache.lookup(b"k", t0 + secs(301)), Lookup::Miss),
            "removed once past the window"
        );
    }

    #[test]
    fn expired_entry_is_a_miss_without_stale_policy() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        cache.insert(b"k", success(&[300]), t0);
        assert!(matches!(cache.lookup(b"k", t0 + secs(301)), Lookup::Miss));
    }

    fn prefetching(amount: u32, percentage: u8) -> Cache {
        Cache::new(Policy {
            prefetch: Some(Prefetch { amount, percentage }),
            ..Policy::default()
        })
    }

    fn prefetch_flag(cache: &Cache, key: &[u8], now: Instant) -> bool {
        match cache.lookup(key, now) {
            Lookup::Fresh { prefetch, .. } => prefetch,
            other => panic!("expected fresh, got {other:?}"),
        }
    }

    #[test]
    fn prefetch_flag_fires_once() {
        let cache = prefetching(1, 10);
        let t0 = Instant::now();
        cache.insert(b"k", success(&[100]), t0);
        assert!(
            !prefetch_flag(&cache, b"k", t0 + secs(89)),
            "11 s left of 100: not due"
        );
        assert!(prefetch_flag(&cache, b"k", t0 + secs(90)), "10 s left: due");
        for s in 90..100 {
            assert!(
                !prefetch_flag(&cache, b"k", t0 + secs(s)),
                "fired again at {s} s"
            );
        }
        // A refreshed entry is a new entry: it may fire again.
        cache.insert(b"k", success(&[100]), t0 + secs(95));
        assert!(prefetch_flag(&cache, b"k", t0 + secs(185)));
    }

    #[test]
    fn prefetch_needs_amount_hits() {
        let cache = prefetching(3, 10);
        let t0 = Instant::now();
        cache.insert(b"k", success(&[100]), t0);
        assert!(
            !prefetch_flag(&cache, b"k", t0 + secs(1)),
            "hit 1 (too early anyway)"
        );
        assert!(
            !prefetch_flag(&cache, b"k", t0 + secs(95)),
            "hit 2: not popular enough"
        );
        assert!(
            prefetch_flag(&cache, b"k", t0 + secs(96)),
            "hit 3: due and popular"
        );
        assert_eq!(
            cache.lookup(b"k", t0).entry().map(|e| e.hits()),
            Some(4),
            "every fresh lookup counts"
        );
    }

    #[test]
    fn prefetch_of_a_short_entry_fires_in_its_last_second() {
        let cache = prefetching(1, 10);
        let t0 = Instant::now();
        cache.insert(b"k", servfail(), t0);
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(3)));
        assert!(prefetch_flag(
            &cache,
            b"k",
            t0 + Duration::from_millis(4500)
        ));
    }

    #[test]
    fn no_prefetch_without_policy() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        cache.insert(b"k", success(&[100]), t0);
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(99)));
    }

    #[test]
    fn stale_lookups_never_prefetch_or_count_hits() {
        let cache = Cache::new(Policy {
            stale: Some(Stale {
                window: secs(60),
                ttl: 30,
            }),
            prefetch: Some(Prefetch {
                amount: 1,
                percentage: 10,
            }),
            ..Policy::default()
        });
        let t0 = Instant::now();
        cache.insert(b"k", success(&[100]), t0);
        let Lookup::Stale { entry, .. } = cache.lookup(b"k", t0 + secs(100)) else {
            panic!("not stale")
        };
        assert_eq!(entry.hits(), 0);
    }

    #[test]
    fn insert_replaces_previous_entry() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        cache.insert(b"k", nxdomain(Some((60, 60))), t0);
        assert_eq!(
            cache.insert(b"k", success(&[300]), t0 + secs(10)),
            Inserted::Stored(Class::Success)
        );
        let Lookup::Fresh { entry, ttl, .. } = cache.lookup(b"k", t0 + secs(10)) else {
            panic!("missed")
        };
        assert_eq!(
            (entry.class(), entry.ttl(), ttl.age),
            (Class::Success, 300, 0)
        );
        let stats = cache.stats();
        assert_eq!((stats.success, stats.denial, stats.evictions), (1, 0, 0));
    }

    #[test]
    fn stats_count_entries_per_class_and_bytes() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        cache.insert(b"s1", success(&[300]), t0);
        cache.insert(b"s2", success(&[300]), t0);
        cache.insert(b"d1", nxdomain(Some((60, 60))), t0);
        cache.insert(b"f1", servfail(), t0);
        cache.insert(b"no", nxdomain(None), t0);
        let stats = cache.stats();
        assert_eq!((stats.success, stats.denial, stats.servfail), (2, 1, 1));
        let expected: usize = [
            (2, success(&[300])),
            (2, success(&[300])),
            (2, nxdomain(Some((60, 60)))),
            (2, servfail()),
        ]
        .iter()
        .map(|(key_len, r)| key_len + r.heap_size() + ENTRY_OVERHEAD)
        .sum();
        assert_eq!(stats.bytes, expected as u64);
        cache.lookup(b"f1", t0 + secs(5));
        assert_eq!(cache.stats().servfail, 0);
    }

    #[test]
    fn lookup_allocates_nothing_per_call() {
        let cache = Cache::new(Policy {
            stale: Some(Stale {
                window: secs(60),
                ttl: 30,
            }),
            prefetch: Some(Prefetch {
                amount: 1,
                percentage: 10,
            }),
            ..Policy::default()
        });
        let t0 = Instant::now();
        let keys: Vec<Vec<u8>> = (0..100).map(|i| format!("name-{i}").into_bytes()).collect();
        for key in &keys[..50] {
            cache.insert(key, success(&[100]), t0);
        }
        cache.map.run_pending_tasks();
        let lookups = 10_000;
        // Fresh (with the prefetch flag firing), stale, and absent keys alike.
        let info = allocation_counter::measure(|| {
            for i in 0..lookups {
                let now = t0 + secs([0, 95, 120][i % 3]);
                std::hint::black_box(cache.lookup(&keys[i % keys.len()], now));
            }
        });
        // moka's amortized housekeeping (run every 64 recorded reads) and crossbeam-epoch's
        // collection (every 128 pins) allocate now and then; anything per call would show as
        // ≥ one allocation per lookup.
        assert!(
            info.count_total < lookups as u64 / 32,
            "{} allocations in {lookups} lookups",
            info.count_total
        );
    }

    #[test]
    fn entry_overhead_matches_real_heap_use() {
        // Allocations are counted per thread, but crossbeam-epoch (under moka) frees garbage on
        // whichever thread collects it, other tests' included: measure in a process that runs
        // this test alone.
        const ALONE: &str = "NODEDNS_CACHE_MEASURE_ALONE";
        if std::env::var_os(ALONE).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "store::tests::entry_overhead_matches_real_heap_use",
                ])
                .args(["--test-threads=1", "--nocapture"])
                .env(ALONE, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{text}");
            assert!(
                text.contains("1 passed"),
                "the measurement did not run: {text}"
            );
            return;
        }
        let cache = Cache::new(Policy {
            capacity_bytes: 1 << 30,
            ..Policy::default()
        });
        let t0 = Instant::now();
        let n = 5000;
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|i| format!("name-{i:05}").into_bytes())
            .collect();
        // Replies are built outside the measurement: their heap bytes are `heap_size`, which the
        // weigher charges exactly; what is measured is everything else an entry costs.
        let mut replies: Vec<Option<Reply>> = (0..n).map(|_| Some(success(&[300]))).collect();
        let info = allocation_counter::measure(|| {
            for (key, reply) in keys.iter().zip(&mut replies) {
                cache.insert(key, reply.take().unwrap(), t0);
            }
            cache.map.run_pending_tasks();
        });
        let measured = info.bytes_current as f64 / n as f64;
        let charged = (keys[0].len() + ENTRY_OVERHEAD) as f64;
        assert!(
            (0.75..=1.25).contains(&(measured / charged)),
            "an entry costs {measured:.0} bytes besides its reply, the weigher charges {charged}"
        );
    }

    proptest::proptest! {
        /// Whatever the record TTLs, bounds and moment: a fresh answer's TTL rule adds up to the
        /// clamped lifetime and never exceeds it; stale exactly in the window after it; then miss.
        #[test]
        fn lookup_agrees_with_the_clamped_lifetime(
            ttls in proptest::collection::vec(0u32..100_000, 1..4),
            min in 0u32..100,
            span in 0u32..5000,
            window in 1u64..5000,
            elapsed_ms in 0u64..20_000_000,
        ) {
            let clamp = Clamp { min, max: min + span };
            let cache = Cache::new(Policy {
                success: clamp,
                stale: Some(Stale { window: secs(window), ttl: 30 }),
                ..Policy::default()
            });
            let t0 = Instant::now();
            let lifetime = clamp.apply(*ttls.iter().min().unwrap());
            let inserted = cache.insert(b"k", success(&ttls), t0);
            if lifetime == 0 {
                proptest::prop_assert_eq!(inserted, Inserted::NotCacheable);
                return Ok(());
            }
            proptest::prop_assert_eq!(inserted, Inserted::Stored(Class::Success));
            let elapsed = Duration::from_millis(elapsed_ms);
            match cache.lookup(b"k", t0 + elapsed) {
                Lookup::Fresh { ttl, .. } => {
                    proptest::prop_assert!(elapsed < secs(lifetime.into()));
                    proptest::prop_assert_eq!(u64::from(ttl.age), elapsed.as_secs());
                    proptest::prop_assert_eq!(ttl.age + ttl.cap, lifetime);
                    proptest::prop_assert!(ttl.cap >= 1 && ttl.cap <= clamp.max);
                }
                Lookup::Stale { ttl, .. } => {
                    proptest::prop_assert!(elapsed >= secs(lifetime.into()));
                    proptest::prop_assert!(elapsed < secs(u64::from(lifetime) + window));
                    proptest::prop_assert_eq!(ttl, TtlRule { age: 0, cap: 30 });
                }
                Lookup::Miss => {
                    proptest::prop_assert!(elapsed >= secs(u64::from(lifetime) + window));
                }
            }
        }
    }

    #[test]
    fn lookup_of_unknown_key_misses() {
        let cache = Cache::new(Policy::default());
        assert!(matches!(cache.lookup(b"", Instant::now()), Lookup::Miss));
        assert!(matches!(
            cache.lookup(&[0xff; 300], Instant::now()),
            Lookup::Miss
        ));
    }

    /// Distinct reply bytes per name, so flood entries are real entries of realistic size.
    fn named(i: usize) -> (Vec<u8>, Reply) {
        let name = format!("flood-{i}.example.");
        let key = name.as_bytes().to_vec();
        (
            key,
            reply(&name, ResponseCode::NoError, &[300], None, false),
        )
    }

    #[test]
    fn capacity_is_bytes_not_entries() {
        let capacity = 64 * 1024;
        let t0 = Instant::now();
        let fill = |answers: usize| {
            let cache = Cache::new(Policy {
                capacity_bytes: capacity,
                ..Policy::default()
            });
            let ttls = vec![300; answers];
            for i in 0..500 {
                let key = format!("name-{i}");
                cache.insert(key.as_bytes(), success(&ttls), t0);
                cache.map.run_pending_tasks();
            }
            cache.stats()
        };
        let small = fill(1);
        let large = fill(60);
        for stats in [small, large] {
            assert!(stats.bytes <= capacity, "{stats:?} over {capacity} bytes");
            assert!(
                stats.bytes > capacity * 3 / 4,
                "{stats:?}: capacity left unused"
            );
            assert_eq!(stats.evictions, 500 - stats.success, "{stats:?}");
        }
        let small_weight = small.bytes / small.success;
        let large_weight = large.bytes / large.success;
        assert!(large_weight > 2 * small_weight, "{small:?} {large:?}");
        assert!(
            large.success * 2 < small.success,
            "entries held depend on their size"
        );
    }

    #[test]
    fn reply_larger_than_capacity_is_not_kept() {
        let cache = Cache::new(Policy {
            capacity_bytes: 1024,
            ..Policy::default()
        });
        let t0 = Instant::now();
        cache.insert(b"big", success(&[300; 100]), t0);
        let stats = cache.stats();
        assert_eq!((stats.success, stats.bytes, stats.evictions), (0, 0, 1));
        assert!(matches!(cache.lookup(b"big", t0), Lookup::Miss));
    }

    #[test]
    fn hot_set_survives_unique_name_flood() {
        let capacity = 256 * 1024;
        let cache = Cache::new(Policy {
            capacity_bytes: capacity,
            ..Policy::default()
        });
        let t0 = Instant::now();
        let hot: Vec<(Vec<u8>, Reply)> = (0..20).map(|i| named(1_000_000 + i)).collect();
        for (key, reply) in &hot {
            cache.insert(key, reply.clone(), t0);
        }
        // Each hot name is asked 5 times per round (a pod's steady traffic).
        let query_hot = |cache: &Cache| {
            let mut fresh = 0;
            for _ in 0..5 {
                for (key, _) in &hot {
                    fresh += usize::from(matches!(cache.lookup(key, t0), Lookup::Fresh { .. }));
                }
            }
            cache.map.run_pending_tasks();
            fresh / 5
        };
        // A name seen once: it misses, then its answer is inserted, as the request path does.
        let query_new = |cache: &Cache, i: usize| {
            let (key, reply) = named(i);
            assert!(matches!(cache.lookup(&key, t0), Lookup::Miss));
            cache.insert(&key, reply, t0);
        };
        // Steady state first: the cache fills with ordinary names while the hot set is asked
        // for every 100 of them, so by the time it is full the hot names are known as hot.
        let mut i = 0;
        for _ in 0..20 {
            for _ in 0..100 {
                query_new(&cache, i);
                i += 1;
            }
            assert_eq!(query_hot(&cache), hot.len(), "lost before the flood");
        }
        // Then the flood: 1000 new names between two rounds of hot queries. 1000 is more than
        // the cache holds, so under plain LRU every hot name would be evicted between rounds.
        let round = 1000;
        for _ in 0..20 {
            for _ in 0..round {
                query_new(&cache, i);
                i += 1;
            }
            query_hot(&cache);
        }
        cache.map.run_pending_tasks();
        let stats = cache.stats();
        assert!(stats.bytes <= capacity, "{stats:?}");
        assert!(
            stats.success < round as u64,
            "the test needs a round to outnumber the cache's entries: {stats:?}"
        );
        assert!(
            stats.success > hot.len() as u64,
            "the flood must fill the cache: {stats:?}"
        );
        assert_eq!(
            query_hot(&cache),
            hot.len(),
            "hot names were pushed out by the flood"
        );
    }
}
