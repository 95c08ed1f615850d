//! The byte-bounded map from key bytes to entries: sharded, with S3-FIFO eviction.
//!
//! Why a store of our own (moka did this before): on the hit path moka cost ~1,000 instructions
//! per lookup (SipHash, its own clock, read-op recording, amortized maintenance), and it held its
//! size bound only once its lazy maintenance had run, with its own bookkeeping uncounted. This
//! store is small enough to read whole, costs a hash, one uncontended lock and a probe per
//! lookup, and enforces the byte bound on every insert.
//!
//! Layout: a power-of-two number of shards (see [`shard_count`]), chosen by bits of the key's
//! hash; each is a `Mutex<Shard>` locked only for the shard's own bookkeeping (a lookup: find,
//! count the hit, clone an `Arc`, or with [`Cache::lookup_with`] let the caller write its answer
//! from the entry in place). A shard keeps its entries in a slab of slots, indexed by a
//! `hashbrown::HashTable<u32>` of slot numbers (so the key bytes are stored once, in the slot),
//! and runs S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023)
//! over three FIFOs:
//!
//! - *small*, [`SMALL_PERCENT`] of the shard's bytes, where new keys enter. When it is over its
//!   share, its head leaves: to main if it was hit since it entered, otherwise dropped, its hash
//!   remembered in the ghost. A name asked once (a random-subdomain flood) passes through small
//!   and never displaces what is in main.
//! - *main*: its head, if hit since it last passed there, goes back to the tail with one hit less
//!   (hits count up to [`MAX_FREQ`]); otherwise it is dropped.
//! - *ghost*: hashes of entries recently dropped from small, at most as many as the shard holds
//!   entries (the paper: as many as main holds). A key found there was dropped too early: it is
//!   stored straight into main.
//!
//! Queues hold `(slot, generation)` cells. Removing an entry outside eviction (expired, found on
//! lookup) bumps its slot's generation instead of searching the queue; the stale cell is skipped
//! when it reaches the head, or dropped sooner once stale cells outnumber live ones.

use std::collections::VecDeque;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use foldhash::SharedSeed;
use foldhash::fast::SeedableRandomState;
use hashbrown::HashTable;
use nodedns_wire::{Reply, TtlRule, rcode};

use crate::{Class, Entry, Policy};

/// At most this many shards: enough that the agent's workers rarely meet on one lock.
const MAX_SHARDS: u64 = 16;

/// Each shard gets at least this much of the capacity, so that a small cache is not cut into
/// shards whose small FIFO holds only a few entries, and so that any DNS message (at most
/// 64 KiB) fits in one shard once the capacity is at least this.
const MIN_SHARD_BYTES: u64 = 256 * 1024;

/// The small FIFO's share of a shard's bytes, in percent (the paper's 10 %).
const SMALL_PERCENT: u64 = 10;

/// Hits a slot remembers (the paper's two bits).
const MAX_FREQ: u8 = 3;

/// Heap allocations each entry holds: its key, its `Arc<Entry>`, and its reply's bytes and TTL
/// index.
const ENTRY_ALLOCATIONS: usize = 4;

/// What the allocator spends on an allocation beyond the bytes asked for. glibc's malloc adds an
/// 8-byte header, rounds up to 16 bytes and hands out at least 32 (a one-record reply's TTL
/// index asks for 2), ≈ 19 bytes on average over an entry's four; with the fragmentation of a
/// cache that keeps turning over, the resident memory of a flood (`examples/lookup_cost.rs
/// flood`, 10⁶ names into 16 MiB) comes to ≈ 24 per allocation.
const MALLOC_SLACK: usize = 24;

/// What the store's own containers cost per entry: the slot in the slab (48 bytes), the index's
/// bucket (a `u32` and a control byte, at most 7/8 full), the queue cell (8), the ghost's hash
/// and its bucket, and the free list. Measured with a counting allocator (the
/// `entry_overhead_matches_real_heap_use` test; x86_64): 104–120 bytes for a full cache (ghost
/// in use; 10³–10⁵ entries, 1 to 16 shards), 80–100 while it is still filling. The containers
/// grow by doubling, so the figure moves a little as entry counts cross powers of two; the
/// full-cache figure is charged.
const STORE_BYTES_PER_ENTRY: usize = 120;

/// Bytes an entry is charged beyond its key and [`Reply::heap_size`]: the `Arc<Entry>` (two
/// reference counts and the [`Entry`]), the store's bookkeeping, and the allocator's share of
/// the entry's four allocations. 328 bytes on 64-bit.
pub const ENTRY_OVERHEAD: usize = 2 * size_of::<usize>()
    + size_of::<Entry>()
    + STORE_BYTES_PER_ENTRY
    + ENTRY_ALLOCATIONS * MALLOC_SLACK;

/// A byte-bounded cache of replies.
pub struct Cache {
    policy: Policy,
    /// Keyed with random seeds, per process and per cache: query names are chosen by clients,
    /// and a hash they could predict would let them pile names into one probe sequence.
    hasher: SeedableRandomState,
    shards: Box<[Mutex<Shard>]>,
    /// `shards.len() - 1`. A key's shard is `(hash >> 32) & shard_mask`: bits that hashbrown
    /// uses neither for the bucket (the low bits) nor for the tag (the top 7).
    shard_mask: usize,
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

/// What a lookup found, lent while the key's shard is locked ([`Cache::lookup_with`]).
#[derive(Debug)]
pub enum Found<'a> {
    /// As [`Lookup::Fresh`].
    Fresh {
        entry: &'a Arc<Entry>,
        ttl: TtlRule,
        prefetch: bool,
    },
    /// As [`Lookup::Stale`].
    Stale { entry: &'a Arc<Entry>, ttl: TtlRule },
    /// Nothing usable.
    Miss,
}

impl Found<'_> {
    /// What [`Cache::lookup`] returns for it: the entry shared, its reference count raised.
    fn to_lookup(&self) -> Lookup {
        match *self {
            Found::Fresh {
                entry,
                ttl,
                prefetch,
            } => Lookup::Fresh {
                entry: Arc::clone(entry),
                ttl,
                prefetch,
            },
            Found::Stale { entry, ttl } => Lookup::Stale {
                entry: Arc::clone(entry),
                ttl,
            },
            Found::Miss => Lookup::Miss,
        }
    }
}

/// The question name of a key's bytes ([`nodedns_wire::Key::as_bytes`]: the name, then qtype,
/// qclass and a flags byte).
fn qname(key: &[u8]) -> &[u8] {
    key.get(..key.len().saturating_sub(5)).unwrap_or_default()
}

/// What [`Cache::store`] did, with what to answer from.
#[derive(Debug)]
pub enum Stored {
    Entry(Arc<Entry>),
    /// Not cacheable: truncated, REFUSED/FORMERR/NOTIMP/other RCODEs, a denial without SOA
    /// (RFC 2308 §5), SERVFAIL with `servfail_ttl` 0, or a lifetime of 0 after clamping. The
    /// reply comes back to answer from.
    NotCacheable(Reply),
    /// Cacheable, but its class is disabled for its name (`disable`): not kept, and answered
    /// with `ttl`, the lifetime it would have had (CoreDNS's cache rewrites the TTLs of what it
    /// passes on, stored or not).
    Passed {
        reply: Reply,
        ttl: TtlRule,
    },
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
    /// Entries dropped to keep within capacity, replies too large to keep at all included
    /// (CoreDNS `coredns_cache_evictions_total`).
    pub evictions: u64,
}

/// How a found entry may be used at `now`.
pub(crate) enum Usable {
    Fresh { age: u32, remaining: u32 },
    Stale { ttl: u32 },
}

impl Cache {
    /// A cache for `policy`, which should have passed [`Policy::validate`].
    pub fn new(policy: Policy) -> Self {
        let shards = shard_count(policy.capacity_bytes);
        let budget = policy.capacity_bytes / shards;
        Cache {
            hasher: key_hasher(),
            shards: (0..shards)
                .map(|_| Mutex::new(Shard::new(budget)))
                .collect(),
            // At most MAX_SHARDS.
            shard_mask: (shards - 1) as usize,
            policy,
        }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Whether this cache handles `qname` (wire form, lowercase) at all: a name outside its
    /// zones (`cache ZONES`) is neither looked up nor stored, and its answers pass untouched.
    #[inline]
    pub fn covers(&self, qname: &[u8]) -> bool {
        let zones = &self.policy.scope.zones;
        zones.is_empty() || zones.iter().any(|z| nodedns_wire::is_subdomain(qname, z))
    }

    /// Looks `key` up at `now`. Allocates nothing; holds the key's shard lock for the probe, the
    /// hit counts, the prefetch claim and an `Arc` clone only.
    ///
    /// The age is whole seconds since the entry was stored (0 if `now` is earlier). An entry is
    /// fresh while its age is below its lifetime; then, with a stale policy and for success and
    /// denial entries only (a stale SERVFAIL is no better than a synthesized one), it is stale
    /// while less than `stale.window` has passed since it expired; after that it is a miss and
    /// is removed.
    pub fn lookup(&self, key: &[u8], now: Instant) -> Lookup {
        self.lookup_with(key, now, |found| found.to_lookup())
    }

    /// Looks `key` up at `now` as [`Cache::lookup`] does, and hands what it found to `use_it`
    /// while the key's shard is still locked: an answer written from the entry there takes no
    /// reference to it (no reference count to raise and drop again, two locked instructions a
    /// hit). `use_it` must not use this cache (the shard's lock is held) and should be short:
    /// the shard's other lookups wait for it. A miss is handed over after the lock is released.
    pub fn lookup_with<R>(
        &self,
        key: &[u8],
        now: Instant,
        use_it: impl FnOnce(Found<'_>) -> R,
    ) -> R {
        let hash = self.hash(key);
        let mut shard = self.shard(hash);
        let Some((slot, entry)) = shard.get(hash, key) else {
            drop(shard);
            return use_it(Found::Miss);
        };
        let Some(usable) = self.usable(entry, now) else {
            // Past all use: free the space now rather than when eviction reaches it. The reply
            // itself is freed after the lock is released.
            let removed = shard.remove(slot);
            drop(shard);
            drop(removed);
            return use_it(Found::Miss);
        };
        // Still under the lock, which orders the hits the entry counts (`Entry::hit`).
        let found = match usable {
            Usable::Fresh { age, remaining } => {
                let ttl = entry.ttl();
                // Counted with or without prefetch: `Entry::hits` says whether a client asked.
                let window = self.policy.prefetch.map_or(u32::MAX, |p| {
                    u32::try_from(p.window.as_secs()).unwrap_or(u32::MAX)
                });
                let hits = entry.hit(age, window);
                let prefetch = self.policy.prefetch.is_some_and(|p| {
                    hits >= p.amount && remaining <= p.threshold(ttl) && entry.claim_refresh(now)
                });
                // `keepttl`: the TTLs the entry was stored with, capped at its lifetime.
                let rule = if self.policy.keep_ttl {
                    TtlRule::fresh(0, ttl)
                } else {
                    TtlRule::fresh(age, remaining)
                };
                Found::Fresh {
                    entry,
                    ttl: rule,
                    prefetch,
                }
            }
            // RFC 8767 §4: every record of a stale answer gets the stale TTL, one stored with
            // TTL 0 included (a TTL of 0 would tell the client not to keep what it got).
            Usable::Stale { ttl } => Found::Stale {
                entry,
                ttl: TtlRule::stale(ttl),
            },
        };
        let result = use_it(found);
        shard.touch(slot);
        drop(shard);
        result
    }

    /// Whether `entry` is fresh or stale at `now`; `None` once it is past all use.
    pub(crate) fn usable(&self, entry: &Entry, now: Instant) -> Option<Usable> {
        let elapsed = now.saturating_duration_since(entry.stored());
        let age = u32::try_from(elapsed.as_secs()).unwrap_or(u32::MAX);
        let ttl = entry.ttl();
        if age < ttl {
            return Some(Usable::Fresh {
                age,
                remaining: ttl - age,
            });
        }
        let stale = self
            .policy
            .stale
            .filter(|_| entry.class() != Class::ServFail)?;
        // `None` (a window too long to add): every expired entry is within it.
        Duration::from_secs(ttl.into())
            .checked_add(stale.window)
            .is_none_or(|end| elapsed < end)
            .then_some(Usable::Stale { ttl: stale.ttl })
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
    /// A `Stored` entry may still leave at once: evicted by the same insert when its shard is
    /// full and it is the one S3-FIFO picks, or never kept when it weighs more than a shard's
    /// budget. Both show in [`Stats::evictions`].
    ///
    /// Returns what the caller needs to answer the clients that waited for this reply: the new
    /// entry (served with `TtlRule::fresh(0, entry.ttl())`), or the reply itself when it
    /// is not cacheable. Neither counts as a hit.
    pub fn store(&self, key: &[u8], reply: Reply, now: Instant) -> Stored {
        let Some((class, ttl)) = self.classify(&reply) else {
            return Stored::NotCacheable(reply);
        };
        if ttl == 0 {
            return Stored::NotCacheable(reply);
        }
        if self.policy.scope.disabled(class, qname(key)) {
            return Stored::Passed {
                reply,
                ttl: TtlRule::fresh(0, ttl),
            };
        }
        let entry = Arc::new(Entry::new(reply, class, ttl, now));
        let weight = weight(key, &entry);
        let hash = self.hash(key);
        self.shard(hash)
            .insert(hash, key, Arc::clone(&entry), weight, None);
        Stored::Entry(entry)
    }

    /// The class and clamped lifetime `reply` would be stored with, or `None` if it is not
    /// cacheable at all.
    pub(crate) fn classify(&self, reply: &Reply) -> Option<(Class, u32)> {
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

    /// The entry under `key`, whatever its state, without counting a hit.
    pub(crate) fn peek(&self, key: &[u8]) -> Option<Arc<Entry>> {
        let hash = self.hash(key);
        let shard = self.shard(hash);
        shard.get(hash, key).map(|(_, entry)| Arc::clone(entry))
    }

    /// Stores `entry` under `key` unless the key holds an entry stored later (false then);
    /// a new key goes into S3-FIFO's main queue if `main`, as an entry known to be asked often
    /// (a replaced entry keeps its place).
    pub(crate) fn store_unless_newer(&self, key: &[u8], entry: Arc<Entry>, main: bool) -> bool {
        let weight = weight(key, &entry);
        let hash = self.hash(key);
        let mut shard = self.shard(hash);
        if shard
            .get(hash, key)
            .is_some_and(|(_, held)| held.stored() >= entry.stored())
        {
            return false;
        }
        let queue = if main { Queue::Main } else { Queue::Small };
        shard.insert(hash, key, entry, weight, Some(queue));
        true
    }

    /// Shards, for [`crate::Export`]'s walk.
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Every entry of shard `index` in `main`'s queue (else small's), oldest first, with the
    /// key: a copy taken under the shard's lock, which is held for the copy only.
    pub(crate) fn shard_entries(&self, index: usize, main: bool) -> Vec<(Box<[u8]>, Arc<Entry>)> {
        let Some(shard) = self.shards.get(index) else {
            return Vec::new();
        };
        let shard = lock(shard);
        let (queue, fifo) = if main {
            (Queue::Main, &shard.main)
        } else {
            (Queue::Small, &shard.small)
        };
        fifo.cells
            .iter()
            .filter_map(|&cell| {
                let slot = occupied(&shard.slots, cell, queue)?;
                Some((slot.key.clone(), Arc::clone(slot.entry.as_ref()?)))
            })
            .collect()
    }

    /// Entry counts, bytes and evictions, summed over the shards (each locked in turn: meant for
    /// metrics scrapes, not for the query path).
    pub fn stats(&self) -> Stats {
        let mut stats = Stats::default();
        for shard in &self.shards {
            let shard = lock(shard);
            stats.success += shard.counts.success;
            stats.denial += shard.counts.denial;
            stats.servfail += shard.counts.servfail;
            stats.bytes += shard.bytes();
            stats.evictions += shard.evictions;
        }
        stats
    }

    /// The key's hash. The bytes alone, without the length prefix `Hash for [u8]` adds:
    /// foldhash mixes the length in itself, and the prefix would cost a round per lookup.
    fn hash(&self, key: &[u8]) -> u64 {
        let mut hasher = self.hasher.build_hasher();
        hasher.write(key);
        hasher.finish()
    }

    /// The locked shard for `hash`.
    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
        lock(&self.shards[(hash >> 32) as usize & self.shard_mask])
    }

    /// A cache that evicts in plain FIFO order: the baseline the flood test holds S3-FIFO against.
    #[cfg(test)]
    fn plain_fifo(policy: Policy) -> Self {
        let cache = Cache::new(policy);
        for shard in &cache.shards {
            lock(shard).plain_fifo = true;
        }
        cache
    }
}

impl fmt::Debug for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the entries: there may be a million.
        f.debug_struct("Cache")
            .field("policy", &self.policy)
            .field("shards", &self.shards.len())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Shards for a capacity: one per [`MIN_SHARD_BYTES`], rounded down to a power of two, between
/// 1 and [`MAX_SHARDS`] (16 from 4 MiB up; the default 16 MiB gives 1 MiB shards).
fn shard_count(capacity_bytes: u64) -> u64 {
    let shards = (capacity_bytes / MIN_SHARD_BYTES).clamp(1, MAX_SHARDS);
    1 << shards.ilog2()
}

/// A fast keyed hasher for query names, randomly seeded (names are chosen by clients, so a fixed
/// seed would let them aim many keys at one bucket). Shared by the store and the single-flight
/// table.
pub(crate) fn key_hasher() -> SeedableRandomState {
    SeedableRandomState::with_seed(rand::random(), shared_seed())
}

/// The foldhash seed shared by every cache of the process, drawn once from the OS-seeded RNG
/// (deriving it is the costly part; each cache adds its own random per-hasher seed).
fn shared_seed() -> &'static SharedSeed {
    static SEED: OnceLock<SharedSeed> = OnceLock::new();
    SEED.get_or_init(|| SharedSeed::from_u64(rand::random()))
}

/// Locks a shard. A panic while it was held (a bug) left its bookkeeping at worst inexact, never
/// unsafe; the cache keeps serving rather than failing every later query on the poison.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What an entry costs against `Policy::capacity_bytes`.
fn weight(key: &[u8], entry: &Entry) -> u32 {
    let bytes = key.len() + entry.reply().heap_size() + ENTRY_OVERHEAD;
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// One shard: its share of the capacity, its entries and its S3-FIFO queues.
///
/// Between calls: `index` holds exactly the live slots; each live slot has exactly one cell
/// with its generation, in the queue its `queue` names; each queue's `live` and `bytes` are the
/// count and weight of its live slots; and `bytes() <= budget` (checked by `tests::check`).
struct Shard {
    /// `Policy::capacity_bytes / shards`.
    budget: u64,
    /// The small FIFO's share of `budget`.
    small_target: u64,
    index: HashTable<u32>,
    slots: Vec<Slot>,
    /// Free slots, reused before the slab grows.
    free: Vec<u32>,
    small: Fifo,
    main: Fifo,
    ghost: Ghost,
    counts: Counts,
    evictions: u64,
    /// The test baseline: every key through small, its head dropped whatever its hits, no ghost.
    plain_fifo: bool,
}

/// One entry's place in a shard.
struct Slot {
    key: Box<[u8]>,
    /// `None` while the slot is free.
    entry: Option<Arc<Entry>>,
    /// The key's hash, so that eviction, the ghost and the index's growth never rehash the key.
    hash: u64,
    /// What the entry is charged ([`weight`]).
    weight: u32,
    /// Bumped when the slot is freed, which makes its occupant's queue cell stale.
    generation: u32,
    /// Hits since the entry entered its queue or last passed main's head, up to [`MAX_FREQ`].
    freq: u8,
    queue: Queue,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

/// A queue's reference to a slot, valid while the slot's generation is unchanged.
#[derive(Debug, Clone, Copy)]
struct Cell {
    slot: u32,
    generation: u32,
}

/// One of S3-FIFO's two queues of entries: head (oldest) at the front.
#[derive(Default)]
struct Fifo {
    cells: VecDeque<Cell>,
    /// Live slots in this queue; `cells.len() - live` cells are stale.
    live: usize,
    /// Their total weight.
    bytes: u64,
}

/// Hashes of entries dropped from small, oldest first, and the same as a set.
#[derive(Default)]
struct Ghost {
    order: VecDeque<u64>,
    members: HashTable<u64>,
}

/// Live entries per class.
#[derive(Default)]
struct Counts {
    success: u64,
    denial: u64,
    servfail: u64,
}

impl Counts {
    fn of(&mut self, class: Class) -> &mut u64 {
        match class {
            Class::Success => &mut self.success,
            Class::Denial => &mut self.denial,
            Class::ServFail => &mut self.servfail,
        }
    }
}

impl Shard {
    fn new(budget: u64) -> Self {
        Shard {
            budget,
            small_target: budget / 100 * SMALL_PERCENT,
            index: HashTable::new(),
            slots: Vec::new(),
            free: Vec::new(),
            small: Fifo::default(),
            main: Fifo::default(),
            ghost: Ghost::default(),
            counts: Counts::default(),
            evictions: 0,
            plain_fifo: false,
        }
    }

    fn bytes(&self) -> u64 {
        self.small.bytes + self.main.bytes
    }

    fn len(&self) -> usize {
        self.small.live + self.main.live
    }

    /// The slot holding `key`, and its entry.
    fn get(&self, hash: u64, key: &[u8]) -> Option<(u32, &Arc<Entry>)> {
        let &slot = self.index.find(hash, |&slot| self.holds(slot, key))?;
        let entry = self.slots.get(slot as usize)?.entry.as_ref()?;
        Some((slot, entry))
    }

    fn holds(&self, slot: u32, key: &[u8]) -> bool {
        self.slots
            .get(slot as usize)
            .is_some_and(|s| *s.key == *key)
    }

    /// Counts a hit for eviction.
    fn touch(&mut self, slot: u32) {
        if let Some(s) = self.slots.get_mut(slot as usize) {
            s.freq = s.freq.saturating_add(1).min(MAX_FREQ);
        }
    }

    /// Stores `entry` under `key`, then evicts until the shard is within its budget. A new key
    /// goes into `queue` if given (else where S3-FIFO puts it).
    fn insert(
        &mut self,
        hash: u64,
        key: &[u8],
        entry: Arc<Entry>,
        weight: u32,
        queue: Option<Queue>,
    ) {
        let existing = self
            .index
            .find(hash, |&slot| self.holds(slot, key))
            .copied();
        if u64::from(weight) > self.budget {
            // Never kept. What was under the key goes too: the caller stored this reply to
            // replace it, and must not be served the older one.
            if let Some(slot) = existing {
                self.remove(slot);
            }
            self.evictions += 1;
            return;
        }
        match existing {
            Some(slot) => self.replace(slot, entry, weight),
            None => {
                if !self.add(hash, key, entry, weight, queue) {
                    self.evictions += 1;
                    return;
                }
            }
        }
        while self.bytes() > self.budget && self.evict() {}
    }

    /// A new reply for a key already held: it takes the slot over, keeping its place in its
    /// queue and its hits (they are the name's, not the reply's).
    fn replace(&mut self, slot: u32, entry: Arc<Entry>, weight: u32) {
        let Some(s) = self.slots.get_mut(slot as usize) else {
            return;
        };
        *self.counts.of(entry.class()) += 1;
        if let Some(old) = s.entry.as_deref() {
            entry.inherit(old);
        }
        if let Some(old) = s.entry.replace(entry) {
            *self.counts.of(old.class()) -= 1;
        }
        let fifo = match s.queue {
            Queue::Small => &mut self.small,
            Queue::Main => &mut self.main,
        };
        fifo.bytes = fifo.bytes - u64::from(s.weight) + u64::from(weight);
        s.weight = weight;
    }

    /// A new key: into small, or into main if the ghost remembers it. False if the slab is full
    /// (2³² slots: only with a capacity of a terabyte or so).
    /// `queue`, if given, is where it goes instead (an entry carried over from another cache,
    /// with what it learnt there).
    fn add(
        &mut self,
        hash: u64,
        key: &[u8],
        entry: Arc<Entry>,
        weight: u32,
        queue: Option<Queue>,
    ) -> bool {
        let queue = match queue {
            Some(queue) => queue,
            None if !self.plain_fifo && self.ghost.contains(hash) => Queue::Main,
            None => Queue::Small,
        };
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let Ok(slot) = u32::try_from(self.slots.len()) else {
                    return false;
                };
                self.slots.push(Slot::vacant());
                slot
            }
        };
        *self.counts.of(entry.class()) += 1;
        let s = &mut self.slots[slot as usize];
        let generation = s.generation;
        *s = Slot {
            key: key.into(),
            entry: Some(entry),
            hash,
            weight,
            generation,
            freq: 0,
            queue,
        };
        let slots = &self.slots;
        self.index
            .insert_unique(hash, slot, |&s| slots[s as usize].hash);
        let fifo = match queue {
            Queue::Small => &mut self.small,
            Queue::Main => &mut self.main,
        };
        fifo.cells.push_back(Cell { slot, generation });
        fifo.live += 1;
        fifo.bytes += u64::from(weight);
        true
    }

    /// Frees `slot` (outside eviction's own pops, its queue cell turns stale) and hands back
    /// what it held, for the caller to drop where it likes.
    fn remove(&mut self, slot: u32) -> Option<(Box<[u8]>, Arc<Entry>)> {
        let s = self.slots.get_mut(slot as usize)?;
        let entry = s.entry.take()?;
        let key = std::mem::take(&mut s.key);
        s.generation = s.generation.wrapping_add(1);
        let (hash, weight, queue) = (s.hash, s.weight, s.queue);
        if let Ok(found) = self.index.find_entry(hash, |&i| i == slot) {
            found.remove();
        }
        self.free.push(slot);
        *self.counts.of(entry.class()) -= 1;
        let fifo = match queue {
            Queue::Small => &mut self.small,
            Queue::Main => &mut self.main,
        };
        fifo.live -= 1;
        fifo.bytes -= u64::from(weight);
        // Stale cells otherwise wait for the head; a shard that seldom evicts (entries expire
        // and are removed on lookup) would pile them up. Sweeping once they outnumber the live
        // cells costs O(1) amortized per removal.
        if fifo.cells.len() > 2 * fifo.live + 32 {
            let slots = &self.slots;
            fifo.cells
                .retain(|&cell| occupied(slots, cell, queue).is_some());
        }
        Some((key, entry))
    }

    /// Drops the entry S3-FIFO picks; false if the shard holds none.
    fn evict(&mut self) -> bool {
        let from_small =
            self.small.live > 0 && (self.small.bytes >= self.small_target || self.main.live == 0);
        (from_small && self.evict_small()) || self.evict_main()
    }

    /// Small's head leaves: to main if it was hit, else dropped and remembered in the ghost.
    /// Repeats until one is dropped; false if small ran out first.
    fn evict_small(&mut self) -> bool {
        while let Some(cell) = self.small.cells.pop_front() {
            let Some(s) = occupied_mut(&mut self.slots, cell, Queue::Small) else {
                continue;
            };
            if s.freq > 0 && !self.plain_fifo {
                s.freq = 0;
                s.queue = Queue::Main;
                let weight = u64::from(s.weight);
                self.small.live -= 1;
                self.small.bytes -= weight;
                self.main.live += 1;
                self.main.bytes += weight;
                self.main.cells.push_back(cell);
                continue;
            }
            let hash = s.hash;
            self.remove(cell.slot);
            self.evictions += 1;
            if !self.plain_fifo {
                let bound = self.len();
                self.ghost.remember(hash, bound);
            }
            return true;
        }
        false
    }

    /// Main's head goes back to the tail with a hit less if it has any, else it is dropped.
    /// Repeats until one is dropped (at most `MAX_FREQ + 1` rounds); false if main is empty.
    fn evict_main(&mut self) -> bool {
        while let Some(cell) = self.main.cells.pop_front() {
            let Some(s) = occupied_mut(&mut self.slots, cell, Queue::Main) else {
                continue;
            };
            if s.freq > 0 {
                s.freq -= 1;
                self.main.cells.push_back(cell);
                continue;
            }
            self.remove(cell.slot);
            self.evictions += 1;
            return true;
        }
        false
    }
}

impl Slot {
    fn vacant() -> Self {
        Slot {
            key: Box::default(),
            entry: None,
            hash: 0,
            weight: 0,
            generation: 0,
            freq: 0,
            queue: Queue::Small,
        }
    }
}

/// The slot `cell` refers to, if the cell is not stale: same generation, still in `queue`.
fn occupied(slots: &[Slot], cell: Cell, queue: Queue) -> Option<&Slot> {
    slots
        .get(cell.slot as usize)
        .filter(|s| s.generation == cell.generation && s.queue == queue && s.entry.is_some())
}

fn occupied_mut(slots: &mut [Slot], cell: Cell, queue: Queue) -> Option<&mut Slot> {
    slots
        .get_mut(cell.slot as usize)
        .filter(|s| s.generation == cell.generation && s.queue == queue && s.entry.is_some())
}

impl Ghost {
    fn contains(&self, hash: u64) -> bool {
        self.members.find(hash, |&h| h == hash).is_some()
    }

    /// Remembers `hash`, forgetting the oldest beyond `bound`.
    fn remember(&mut self, hash: u64, bound: usize) {
        if !self.contains(hash) {
            self.members.insert_unique(hash, hash, |&h| h);
            self.order.push_back(hash);
        }
        while self.order.len() > bound {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Ok(found) = self.members.find_entry(old, |&h| h == old) {
                found.remove();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
    use hickory_proto::rr::{Name, RecordType};

    use super::*;
    use crate::testutil::{insert, nxdomain, reply, secs, servfail, stale, success};
    use crate::{Clamp, PREFETCH_WINDOW, Prefetch, Scope};

    /// The lifetime `reply` is stored with, read back through a lookup at the store time.
    fn stored_ttl(cache: &Cache, reply: Reply) -> Option<u32> {
        let t0 = Instant::now();
        insert(cache, b"k", reply, t0);
        match cache.lookup(b"k", t0) {
            Lookup::Fresh { entry, ttl, .. } => {
                assert_eq!(ttl, TtlRule::fresh(0, entry.ttl()));
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
            insert(&cache, b"k", success(&[300, 60, 900]), t0),
            Some(Class::Success)
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
    fn lookup_with_lends_what_lookup_returns_without_a_reference() {
        let policy = Policy {
            stale: Some(stale(secs(60), 30)),
            ..Policy::default()
        };
        let cache = Cache::new(policy);
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[60]), t0);
        for (at, fresh) in [(t0 + secs(10), true), (t0 + secs(70), false)] {
            let lent = cache.lookup_with(b"k", at, |found| {
                let (entry, ttl) = match found {
                    Found::Fresh { entry, ttl, .. } => (entry, ttl),
                    Found::Stale { entry, ttl } => (entry, ttl),
                    Found::Miss => panic!("missed at {at:?}"),
                };
                // The cache's own reference only: nothing was cloned to lend it.
                assert_eq!(Arc::strong_count(entry), 1);
                (matches!(found, Found::Fresh { .. }), entry.ttl(), ttl)
            });
            let owned = match cache.lookup(b"k", at) {
                Lookup::Fresh { entry, ttl, .. } => (true, entry.ttl(), ttl),
                Lookup::Stale { entry, ttl } => (false, entry.ttl(), ttl),
                Lookup::Miss => panic!("missed at {at:?}"),
            };
            assert_eq!(lent, owned);
            assert_eq!(lent.0, fresh);
        }
        // Past the stale window: a miss, and the entry is gone.
        let after = t0 + secs(200);
        assert!(cache.lookup_with(b"k", after, |found| matches!(found, Found::Miss)));
        assert_eq!(cache.stats().success, 0);
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
            insert(&cache, b"nx", nxdomain(Some((3600, 30))), t0),
            Some(Class::Denial)
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
            insert(&cache, b"k", nodata, Instant::now()),
            Some(Class::Denial)
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
        assert_eq!(insert(&cache, b"nx", nxdomain(None), Instant::now()), None);
        let nodata = reply("www.example.", ResponseCode::NoError, &[], None, false);
        assert_eq!(insert(&cache, b"nd", nodata, Instant::now()), None);
        assert!(matches!(cache.lookup(b"nx", Instant::now()), Lookup::Miss));
        assert_eq!(cache.stats(), Stats::default());
    }

    #[test]
    fn servfail_kept_five_seconds() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        assert_eq!(insert(&cache, b"k", servfail(), t0), Some(Class::ServFail));
        assert!(matches!(
            cache.lookup(b"k", t0 + Duration::from_millis(4999)),
            Lookup::Fresh { ttl, .. } if ttl == TtlRule::fresh(4, 1)
        ));
        assert!(matches!(cache.lookup(b"k", t0 + secs(5)), Lookup::Miss));
    }

    #[test]
    fn servfail_not_cached_when_disabled() {
        let cache = Cache::new(Policy {
            servfail_ttl: 0,
            ..Policy::default()
        });
        assert_eq!(insert(&cache, b"k", servfail(), Instant::now()), None);
    }

    /// A cache with the defaults and serve-stale on: a 1 h window, TTL 30 s.
    fn serving_stale() -> Cache {
        Cache::new(Policy {
            stale: Some(stale(secs(3600), 30)),
            ..Policy::default()
        })
    }

    #[test]
    fn servfail_never_served_stale() {
        let cache = serving_stale();
        let t0 = Instant::now();
        insert(&cache, b"k", servfail(), t0);
        assert!(matches!(cache.lookup(b"k", t0 + secs(6)), Lookup::Miss));
    }

    #[test]
    fn truncated_reply_not_cached() {
        let cache = Cache::new(Policy::default());
        let tc = reply("www.example.", ResponseCode::NoError, &[300], None, true);
        assert_eq!(insert(&cache, b"k", tc, Instant::now()), None);
        let tc_nx = reply(
            "nx.example.",
            ResponseCode::NXDomain,
            &[],
            Some((60, 60)),
            true,
        );
        assert_eq!(insert(&cache, b"k", tc_nx, Instant::now()), None);
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
            assert_eq!(insert(&cache, b"k", r, Instant::now()), None, "{rcode:?}");
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
            insert(&cache, b"k", nxdomain(Some((60, 60))), Instant::now()),
            None
        );
    }

    #[test]
    fn fresh_ttl_counts_whole_seconds_of_age() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[60]), t0);
        let at = |d: Duration| match cache.lookup(b"k", t0 + d) {
            Lookup::Fresh { ttl, .. } => Some(ttl),
            _ => None,
        };
        assert_eq!(at(Duration::ZERO), Some(TtlRule::fresh(0, 60)));
        assert_eq!(at(Duration::from_millis(999)), Some(TtlRule::fresh(0, 60)));
        assert_eq!(at(secs(7)), Some(TtlRule::fresh(7, 53)));
        assert_eq!(
            at(Duration::from_millis(59_999)),
            Some(TtlRule::fresh(59, 1))
        );
        assert_eq!(at(secs(60)), None);
    }

    #[test]
    fn now_before_stored_is_age_zero() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now() + secs(100);
        insert(&cache, b"k", success(&[60]), t0);
        assert!(matches!(
            cache.lookup(b"k", t0 - secs(10)),
            Lookup::Fresh { ttl, .. } if ttl == TtlRule::fresh(0, 60)
        ));
    }

    #[test]
    fn expired_entry_misses_and_is_removed() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[30]), t0);
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
        let cache = serving_stale();
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[300]), t0);
        insert(&cache, b"nx", nxdomain(Some((60, 60))), t0);
        assert!(matches!(
            cache.lookup(b"k", t0 + secs(299)),
            Lookup::Fresh { .. }
        ));
        for at in [secs(300), secs(1000), secs(300 + 3599)] {
            let Lookup::Stale { entry, ttl } = cache.lookup(b"k", t0 + at) else {
                panic!("not stale at {at:?}")
            };
            assert_eq!(ttl, TtlRule::stale(30), "every TTL is the stale TTL");
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
    fn stale_answer_of_a_ttl_0_record_carries_the_stale_ttl() {
        let cache = serving_stale();
        let t0 = Instant::now();
        // Kept 5 s (the success minimum), records with TTL 0 and 300.
        insert(&cache, b"k", success(&[0, 300]), t0);
        let Lookup::Stale { entry, ttl } = cache.lookup(b"k", t0 + secs(5)) else {
            panic!("not stale after 5 s")
        };
        let mut query = Message::new(7, MessageType::Query, OpCode::Query);
        query.add_query(Query::query(
            Name::from_ascii("www.example.").unwrap(),
            RecordType::A,
        ));
        let question = query.to_vec().unwrap();
        let mut out = Vec::new();
        entry.reply().write_answer(
            &nodedns_wire::Query::parse(&question).unwrap(),
            ttl,
            512,
            &mut out,
        );
        let served = Message::from_vec(&out).unwrap();
        let ttls: Vec<u32> = served.answers.iter().map(|r| r.ttl).collect();
        assert_eq!(ttls, [30, 30], "RFC 8767 §4: 30 s for every stale record");
    }

    #[test]
    fn expired_entry_is_a_miss_without_stale_policy() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[300]), t0);
        assert!(matches!(cache.lookup(b"k", t0 + secs(301)), Lookup::Miss));
    }

    fn prefetching(amount: u32, percentage: u8) -> Cache {
        Cache::new(Policy {
            prefetch: Some(Prefetch {
                amount,
                window: PREFETCH_WINDOW,
                percentage,
            }),
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
        insert(&cache, b"k", success(&[100]), t0);
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
        insert(&cache, b"k", success(&[100]), t0 + secs(95));
        assert!(prefetch_flag(&cache, b"k", t0 + secs(185)));
    }

    #[test]
    fn prefetch_needs_amount_hits_without_a_gap_longer_than_the_window() {
        let cache = prefetching(3, 10);
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[100]), t0);
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(1)), "hit 1");
        assert!(
            !prefetch_flag(&cache, b"k", t0 + secs(95)),
            "94 s after hit 1, more than the 60 s window: the count starts again at 1"
        );
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(96)), "hit 2");
        assert!(
            prefetch_flag(&cache, b"k", t0 + secs(97)),
            "hit 3 within the window, and due"
        );
        assert!(
            !prefetch_flag(&cache, b"k", t0 + secs(98)),
            "one refresh per entry, however many hits follow"
        );
        // Gaps shorter than the window all count.
        let cache = prefetching(3, 10);
        insert(&cache, b"k", success(&[100]), t0);
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(40)));
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(80)));
        assert!(prefetch_flag(&cache, b"k", t0 + secs(91)));
    }

    #[test]
    fn a_prefetched_entry_keeps_the_hits_of_the_one_it_replaces() {
        let cache = prefetching(3, 10);
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[100]), t0);
        for s in [50, 80, 91] {
            prefetch_flag(&cache, b"k", t0 + secs(s));
        }
        // The refresh lands while the old entry is still fresh: the name is as popular as it was.
        insert(&cache, b"k", success(&[100]), t0 + secs(92));
        assert!(
            !prefetch_flag(&cache, b"k", t0 + secs(150)),
            "hit 4: not due"
        );
        assert!(prefetch_flag(&cache, b"k", t0 + secs(183)), "hit 5, due");
        // After expiry, a miss stores a new entry that starts counting from nothing.
        insert(&cache, b"k", success(&[100]), t0 + secs(300));
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(358)), "hit 1");
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(391)), "hit 2, due");
    }

    #[test]
    fn keepttl_serves_the_stored_ttl_until_expiry() {
        let cache = Cache::new(Policy {
            keep_ttl: true,
            ..Policy::default()
        });
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[100]), t0);
        match cache.lookup(b"k", t0 + secs(60)) {
            Lookup::Fresh { ttl, .. } => assert_eq!(ttl, TtlRule::fresh(0, 100)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(cache.lookup(b"k", t0 + secs(100)), Lookup::Miss));
    }

    /// A key for `name` (dotted, lowercase) A IN, as the agent builds it.
    fn key_of(name: &str) -> Vec<u8> {
        nodedns_wire::Key::new(&wire_name(name), 1, 1, false, false)
            .unwrap()
            .as_bytes()
            .to_vec()
    }

    fn wire_name(name: &str) -> Vec<u8> {
        let mut out = Vec::new();
        for label in name.split('.').filter(|l| !l.is_empty()) {
            out.push(label.len() as u8);
            out.extend_from_slice(label.as_bytes());
        }
        out.push(0);
        out
    }

    #[test]
    fn a_disabled_class_is_passed_with_its_clamped_ttl_and_not_kept() {
        let cache = Cache::new(Policy {
            scope: Scope {
                no_denial: vec![wire_name("sub.example.org").into()],
                ..Scope::default()
            },
            ..Policy::default()
        });
        let t0 = Instant::now();
        let (inside, outside) = (key_of("x.sub.example.org"), key_of("x.example.org"));
        match cache.store(&inside, nxdomain(Some((30, 30))), t0) {
            Stored::Passed { ttl, .. } => assert_eq!(ttl, TtlRule::fresh(0, 30)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(cache.lookup(&inside, t0), Lookup::Miss));
        assert_eq!(
            insert(&cache, &inside, success(&[60]), t0),
            Some(Class::Success)
        );
        assert_eq!(
            insert(&cache, &outside, nxdomain(Some((30, 30))), t0),
            Some(Class::Denial)
        );
    }

    #[test]
    fn covers_only_names_under_the_cache_zones() {
        let cache = Cache::new(Policy {
            scope: Scope {
                zones: vec![wire_name("example.com").into()],
                ..Scope::default()
            },
            ..Policy::default()
        });
        assert!(cache.covers(&wire_name("www.example.com")));
        assert!(cache.covers(&wire_name("example.com")));
        assert!(!cache.covers(&wire_name("www.example.org")));
        assert!(!cache.covers(&wire_name("badexample.com")));
        assert!(Cache::new(Policy::default()).covers(&wire_name("anything")));
    }

    #[test]
    fn prefetch_of_a_short_entry_fires_in_its_last_second() {
        let cache = prefetching(1, 10);
        let t0 = Instant::now();
        insert(&cache, b"k", servfail(), t0);
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
        insert(&cache, b"k", success(&[100]), t0);
        assert!(!prefetch_flag(&cache, b"k", t0 + secs(99)));
    }

    #[test]
    fn stale_lookups_leave_the_refresh_to_the_caller() {
        let cache = Cache::new(Policy {
            stale: Some(stale(secs(60), 30)),
            prefetch: Some(Prefetch {
                amount: 1,
                window: PREFETCH_WINDOW,
                percentage: 10,
            }),
            ..Policy::default()
        });
        let t0 = Instant::now();
        insert(&cache, b"k", success(&[100]), t0);
        for _ in 0..3 {
            assert!(matches!(
                cache.lookup(b"k", t0 + secs(100)),
                Lookup::Stale { .. }
            ));
        }
        let Lookup::Stale { entry, .. } = cache.lookup(b"k", t0 + secs(100)) else {
            panic!("not stale")
        };
        assert!(
            entry.claim_refresh(t0 + secs(100)),
            "the caller that serves it stale starts its refresh"
        );
        assert!(!entry.claim_refresh(t0 + secs(100)), "once");
    }

    #[test]
    fn insert_replaces_previous_entry() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        insert(&cache, b"k", nxdomain(Some((60, 60))), t0);
        assert_eq!(
            insert(&cache, b"k", success(&[300]), t0 + secs(10)),
            Some(Class::Success)
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
        insert(&cache, b"s1", success(&[300]), t0);
        insert(&cache, b"s2", success(&[300]), t0);
        insert(&cache, b"d1", nxdomain(Some((60, 60))), t0);
        insert(&cache, b"f1", servfail(), t0);
        insert(&cache, b"no", nxdomain(None), t0);
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
            stale: Some(stale(secs(60), 30)),
            prefetch: Some(Prefetch {
                amount: 1,
                window: PREFETCH_WINDOW,
                percentage: 10,
            }),
            ..Policy::default()
        });
        let t0 = Instant::now();
        let keys: Vec<Vec<u8>> = (0..100).map(|i| format!("name-{i}").into_bytes()).collect();
        for key in &keys[..50] {
            insert(&cache, key, success(&[100]), t0);
        }
        let lookups = 10_000;
        // Fresh (with the prefetch flag firing), stale, and absent keys alike.
        let info = allocation_counter::measure(|| {
            for i in 0..lookups {
                let now = t0 + secs([0, 95, 120][i % 3]);
                std::hint::black_box(cache.lookup(&keys[i % keys.len()], now));
            }
        });
        assert_eq!(info.count_total, 0, "allocations in {lookups} lookups");
    }

    /// Entries of `key_len`-byte keys and equal replies, inserted into a cache of `capacity`:
    /// the heap bytes each live entry really costs besides its reply, and what it is charged
    /// for that (allocator slack left out: a counting allocator sees requested bytes only).
    fn heap_per_entry(capacity: u64, n: usize) -> (f64, f64, Stats) {
        let cache = Cache::new(Policy {
            capacity_bytes: capacity,
            ..Policy::default()
        });
        let t0 = Instant::now();
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|i| format!("name-{i:07}").into_bytes())
            .collect();
        // Replies are built outside the measurement: their heap bytes are `heap_size`, which
        // the weight charges exactly. An evicted reply is freed inside it, so its bytes are
        // added back.
        let mut replies: Vec<Option<Reply>> = (0..n).map(|_| Some(success(&[300]))).collect();
        let reply_bytes = success(&[300]).heap_size();
        let info = allocation_counter::measure(|| {
            for (key, reply) in keys.iter().zip(&mut replies) {
                insert(&cache, key, reply.take().unwrap(), t0);
            }
        });
        let stats = cache.stats();
        let live = stats.success;
        assert_eq!(live + stats.evictions, n as u64);
        let measured = (info.bytes_current as f64
            + (stats.evictions as usize * reply_bytes) as f64)
            / live as f64;
        let charged = (keys[0].len() + ENTRY_OVERHEAD - ENTRY_ALLOCATIONS * MALLOC_SLACK) as f64;
        (measured, charged, stats)
    }

    #[test]
    fn entry_overhead_matches_real_heap_use() {
        // Growing (no eviction, 16 shards) at entry counts on both sides of the containers'
        // doublings, and full (evicting, the ghost in use), from one shard to sixteen.
        for (capacity, n) in [
            (1 << 30, 3_000),
            (1 << 30, 12_000),
            (1 << 30, 50_000),
            (300_000, 20_000),
            (1 << 20, 30_000),
            (16 << 20, 150_000),
        ] {
            let (measured, charged, stats) = heap_per_entry(capacity, n);
            assert!(
                (0.8..=1.2).contains(&(measured / charged)),
                "{n} entries into {capacity} bytes ({stats:?}): an entry costs {measured:.0} \
                 bytes besides its reply, the weight charges {charged}"
            );
        }
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
                stale: Some(stale(secs(window), 30)),
                ..Policy::default()
            });
            let t0 = Instant::now();
            let lifetime = clamp.apply(*ttls.iter().min().unwrap());
            let inserted = insert(&cache, b"k", success(&ttls), t0);
            if lifetime == 0 {
                proptest::prop_assert_eq!(inserted, None);
                return Ok(());
            }
            proptest::prop_assert_eq!(inserted, Some(Class::Success));
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
                    proptest::prop_assert_eq!(ttl, TtlRule::stale(30));
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
                insert(&cache, key.as_bytes(), success(&ttls), t0);
                let stats = cache.stats();
                assert!(
                    stats.bytes <= capacity,
                    "over capacity after an insert: {stats:?}"
                );
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
        insert(&cache, b"big", success(&[300; 100]), t0);
        let stats = cache.stats();
        assert_eq!((stats.success, stats.bytes, stats.evictions), (0, 0, 1));
        assert!(matches!(cache.lookup(b"big", t0), Lookup::Miss));
    }

    /// Hot names, then a flood of names each asked once, into a 256 KiB cache built by `build`:
    /// how many of the hot names are still fresh after the flood.
    fn hot_names_left_after_flood(build: fn(Policy) -> Cache) -> usize {
        let capacity = 256 * 1024;
        let cache = build(Policy {
            capacity_bytes: capacity,
            ..Policy::default()
        });
        let t0 = Instant::now();
        let hot: Vec<(Vec<u8>, Reply)> = (0..20).map(|i| named(1_000_000 + i)).collect();
        for (key, reply) in &hot {
            insert(&cache, key, reply.clone(), t0);
        }
        // Each hot name is asked 5 times per round (a pod's steady traffic).
        let query_hot = |cache: &Cache| {
            let mut fresh = 0;
            for _ in 0..5 {
                for (key, _) in &hot {
                    fresh += usize::from(matches!(cache.lookup(key, t0), Lookup::Fresh { .. }));
                }
            }
            fresh / 5
        };
        // A name seen once: it misses, then its answer is inserted, as the request path does.
        let query_new = |cache: &Cache, i: usize| {
            let (key, reply) = named(i);
            assert!(matches!(cache.lookup(&key, t0), Lookup::Miss));
            insert(cache, &key, reply, t0);
        };
        // Steady state first: the cache fills with ordinary names while the hot set is asked
        // for every 100 of them, so by the time it is full the hot names have been hit.
        let mut i = 0;
        for _ in 0..20 {
            for _ in 0..100 {
                query_new(&cache, i);
                i += 1;
            }
            query_hot(&cache);
        }
        // Then the flood: 1000 new names between two rounds of hot queries. 1000 is more than
        // the cache holds, so in plain FIFO (or LRU) order every hot name is evicted between
        // two rounds.
        let round = 1000;
        for _ in 0..20 {
            for _ in 0..round {
                query_new(&cache, i);
                i += 1;
            }
            query_hot(&cache);
        }
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
        query_hot(&cache)
    }

    #[test]
    fn hot_set_survives_unique_name_flood() {
        assert_eq!(
            hot_names_left_after_flood(Cache::new),
            20,
            "hot names were pushed out by the flood"
        );
    }

    /// The flood test's scenario is hard enough to matter: plain FIFO, same byte bound and
    /// same steps, loses every hot name.
    #[test]
    fn plain_fifo_loses_the_hot_set_to_the_flood() {
        assert_eq!(hot_names_left_after_flood(Cache::plain_fifo), 0);
    }

    /// Every invariant of every shard of `cache` (see [`Shard`]).
    fn check(cache: &Cache) {
        for (n, shard) in cache.shards.iter().enumerate() {
            let shard = lock(shard);
            let mut counts = Counts::default();
            let mut cells = vec![0usize; shard.slots.len()];
            for (queue, fifo) in [(Queue::Small, &shard.small), (Queue::Main, &shard.main)] {
                let (mut live, mut bytes) = (0, 0);
                for &cell in &fifo.cells {
                    if let Some(s) = occupied(&shard.slots, cell, queue) {
                        cells[cell.slot as usize] += 1;
                        live += 1;
                        bytes += u64::from(s.weight);
                    }
                }
                assert_eq!((live, bytes), (fifo.live, fifo.bytes), "{queue:?} totals");
            }
            let mut vacant: Vec<u32> = Vec::new();
            for (i, s) in shard.slots.iter().enumerate() {
                let Some(entry) = &s.entry else {
                    assert!(s.key.is_empty(), "a vacant slot holds its key");
                    vacant.push(i as u32);
                    continue;
                };
                *counts.of(entry.class()) += 1;
                assert_eq!(cells[i], 1, "slot {i} has {} live cells", cells[i]);
                assert_eq!(s.hash, cache.hash(&s.key));
                assert_eq!((s.hash >> 32) as usize & cache.shard_mask, n, "wrong shard");
                assert_eq!(s.weight, weight(&s.key, entry));
                assert!(s.freq <= MAX_FREQ);
                assert_eq!(
                    shard.get(s.hash, &s.key).map(|(slot, _)| slot),
                    Some(i as u32)
                );
            }
            let mut free = shard.free.clone();
            free.sort_unstable();
            assert_eq!(free, vacant, "free list");
            assert_eq!(shard.index.len(), shard.len(), "index size");
            assert_eq!(
                (counts.success, counts.denial, counts.servfail),
                (
                    shard.counts.success,
                    shard.counts.denial,
                    shard.counts.servfail
                )
            );
            assert!(shard.bytes() <= shard.budget, "over budget");
            assert_eq!(shard.ghost.order.len(), shard.ghost.members.len());
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert { key: u8, answers: usize, ttl: u32 },
        Lookup { key: u8, at: u64 },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0u8..40, 1usize..40, 1u32..300).prop_map(|(key, answers, ttl)| Op::Insert {
                key,
                answers,
                ttl
            }),
            (0u8..40, 0u64..400).prop_map(|(key, at)| Op::Lookup { key, at }),
        ]
    }

    proptest::proptest! {
        /// Whatever the inserts (sizes, replacements) and lookups (hits, expiry removals): after
        /// every call the store is consistent and within its bytes, and a key just stored
        /// answers with that reply or not at all, never with the one it replaced.
        #[test]
        fn store_stays_consistent_and_within_bytes(
            ops in proptest::collection::vec(op(), 1..300),
            capacity in 2_000u64..20_000,
        ) {
            let cache = Cache::new(Policy {
                capacity_bytes: capacity,
                stale: Some(stale(secs(60), 30)),
                ..Policy::default()
            });
            let t0 = Instant::now();
            for op in ops {
                match op {
                    Op::Insert { key, answers, ttl } => {
                        let key = [b'k', key];
                        let Stored::Entry(stored) =
                            cache.store(&key, success(&vec![ttl; answers]), t0)
                        else {
                            panic!("not cacheable")
                        };
                        if let Lookup::Fresh { entry, .. } | Lookup::Stale { entry, .. } =
                            cache.lookup(&key, t0)
                        {
                            proptest::prop_assert!(Arc::ptr_eq(&entry, &stored));
                        }
                    }
                    Op::Lookup { key, at } => {
                        cache.lookup(&[b'k', key], t0 + secs(at));
                    }
                }
                check(&cache);
            }
        }
    }

    /// A store-level entry of `weight` bytes for key `k`, with a hash of the test's choosing.
    fn put(shard: &mut Shard, k: u64, weight: u32) {
        let entry = Arc::new(Entry::new(
            success(&[300]),
            Class::Success,
            300,
            Instant::now(),
        ));
        shard.insert(test_hash(k), &k.to_be_bytes(), entry, weight, None);
    }

    fn test_hash(k: u64) -> u64 {
        k.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn queue_of(shard: &Shard, k: u64) -> Option<Queue> {
        let (slot, _) = shard.get(test_hash(k), &k.to_be_bytes())?;
        Some(shard.slots[slot as usize].queue)
    }

    fn hit(shard: &mut Shard, k: u64) {
        let (slot, _) = shard.get(test_hash(k), &k.to_be_bytes()).expect("held");
        shard.touch(slot);
    }

    #[test]
    fn new_keys_enter_small_and_unhit_ones_leave_first() {
        // Ten entries of 100 bytes fill the shard; small's share is one entry.
        let mut shard = Shard::new(1000);
        for k in 0..10 {
            put(&mut shard, k, 100);
            assert_eq!(queue_of(&shard, k), Some(Queue::Small));
        }
        hit(&mut shard, 3);
        for k in 10..14 {
            put(&mut shard, k, 100);
        }
        // 0, 1, 2 and 4 were never hit: dropped, remembered in the ghost. 3 was: now in main.
        for k in [0, 1, 2, 4] {
            assert_eq!(queue_of(&shard, k), None, "{k}");
            assert!(shard.ghost.contains(test_hash(k)), "{k}");
        }
        assert_eq!(queue_of(&shard, 3), Some(Queue::Main));
        assert_eq!(
            shard.slots[shard.get(test_hash(3), &3u64.to_be_bytes()).unwrap().0 as usize].freq,
            0,
            "hits start over in main"
        );
        assert_eq!((shard.bytes(), shard.evictions), (1000, 4));
        // A key the ghost remembers was dropped too early: it comes back straight into main.
        put(&mut shard, 0, 100);
        assert_eq!(queue_of(&shard, 0), Some(Queue::Main));
    }

    #[test]
    fn main_gives_hit_entries_another_round() {
        let mut shard = Shard::new(1000);
        for k in 0..20 {
            put(&mut shard, k, 100);
        }
        // 0..10 were dropped from small into the ghost; bring 0..=9 back: into main, each
        // pushing one more unhit key out of small.
        for k in 0..10 {
            put(&mut shard, k, 100);
            assert_eq!(queue_of(&shard, k), Some(Queue::Main), "{k}");
        }
        assert_eq!(shard.small.live, 0, "small emptied");
        hit(&mut shard, 2);
        hit(&mut shard, 5);
        // With small empty, room comes from main's head: unhit 0 and 1 go, hit 2 goes round
        // again (one hit less) and 3 goes in its place; later 5 survives its turn the same way.
        for k in 10..13 {
            put(&mut shard, k, 100);
        }
        assert_eq!(queue_of(&shard, 0), None);
        assert_eq!(queue_of(&shard, 1), None);
        assert_eq!(queue_of(&shard, 2), Some(Queue::Main));
        assert_eq!(queue_of(&shard, 3), None);
        for k in 13..16 {
            put(&mut shard, k, 100);
        }
        assert_eq!(queue_of(&shard, 4), None);
        assert_eq!(queue_of(&shard, 5), Some(Queue::Main));
        assert_eq!(queue_of(&shard, 6), None);
        assert_eq!(shard.bytes(), 1000);
    }

    #[test]
    fn ghost_remembers_at_most_as_many_keys_as_the_shard_holds() {
        let mut shard = Shard::new(1000);
        for k in 0..1000 {
            put(&mut shard, k, 100);
        }
        assert_eq!(shard.len(), 10);
        assert_eq!(shard.ghost.order.len(), 10);
        assert!(shard.ghost.contains(test_hash(989)));
        assert!(!shard.ghost.contains(test_hash(979)));
    }

    #[test]
    fn replacing_keeps_place_and_hits_and_recharges_bytes() {
        let mut shard = Shard::new(1000);
        put(&mut shard, 1, 100);
        put(&mut shard, 2, 100);
        hit(&mut shard, 1);
        put(&mut shard, 1, 300);
        assert_eq!(shard.bytes(), 400);
        assert_eq!(shard.small.cells.len(), 2, "no new cell");
        let (slot, _) = shard.get(test_hash(1), &1u64.to_be_bytes()).unwrap();
        assert_eq!(shard.slots[slot as usize].freq, 1);
        assert_eq!(shard.counts.success, 2);
    }

    #[test]
    fn removed_entries_do_not_pile_up_in_queues() {
        // Entries that expire and are removed on lookup, in a cache never full enough to
        // evict: their stale cells are swept, not kept until eviction reaches them.
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        for round in 0..200u64 {
            for i in 0..50 {
                let key = format!("name-{i}");
                let now = t0 + secs(round * 10);
                assert!(matches!(cache.lookup(key.as_bytes(), now), Lookup::Miss));
                insert(&cache, key.as_bytes(), success(&[5]), now);
            }
        }
        check(&cache);
        let cells: usize = cache
            .shards
            .iter()
            .map(|s| {
                let shard = lock(s);
                shard.small.cells.len() + shard.main.cells.len()
            })
            .sum();
        assert!(
            cells <= 2 * 50 + 32 * cache.shards.len(),
            "{cells} queue cells"
        );
        assert_eq!(cache.stats().evictions, 0);
    }

    #[test]
    fn shards_follow_capacity() {
        for (capacity, shards) in [
            (0, 1),
            (1024, 1),
            (256 * 1024, 1),
            (512 * 1024, 2),
            (3 << 20, 8),
            (4 << 20, 16),
            (16 << 20, 16),
            (1 << 40, 16),
        ] {
            let cache = Cache::new(Policy {
                capacity_bytes: capacity,
                ..Policy::default()
            });
            assert_eq!(cache.shards.len(), shards, "{capacity}");
            assert!(lock(&cache.shards[0]).budget * shards as u64 <= capacity);
        }
    }

    #[test]
    fn every_reply_fits_a_shard_from_the_minimum_shard_size() {
        let cache = Cache::new(Policy {
            capacity_bytes: MIN_SHARD_BYTES,
            ..Policy::default()
        });
        // A reply near the 64 KiB message limit: one NULL record of 65,000 bytes.
        let mut bytes = vec![0x12, 0x34, 0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0];
        bytes.extend_from_slice(b"\x03big\x00\x00\x01\x00\x01");
        bytes.extend_from_slice(&[0xc0, 12, 0, 10, 0, 1, 0, 0, 1, 44]);
        bytes.extend_from_slice(&65_000u16.to_be_bytes());
        bytes.resize(bytes.len() + 65_000, 0);
        let big = Reply::parse(&bytes).unwrap();
        assert_eq!(
            insert(&cache, b"big", big, Instant::now()),
            Some(Class::Success)
        );
        assert!(matches!(
            cache.lookup(b"big", Instant::now()),
            Lookup::Fresh { .. }
        ));
    }

    #[test]
    fn concurrent_inserts_and_lookups_keep_every_shard_consistent() {
        let capacity = 1 << 20;
        let cache = Cache::new(Policy {
            capacity_bytes: capacity,
            ..Policy::default()
        });
        assert_eq!(cache.shards.len(), 4);
        let t0 = Instant::now();
        std::thread::scope(|scope| {
            for thread in 0..4u64 {
                let cache = &cache;
                scope.spawn(move || {
                    let mut x = thread + 1;
                    for _ in 0..5_000 {
                        // xorshift: a cheap spread of keys, hot and cold.
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let key = format!("name-{}", x % 4_000);
                        if matches!(cache.lookup(key.as_bytes(), t0), Lookup::Miss) {
                            insert(cache, key.as_bytes(), success(&[300]), t0);
                        }
                    }
                });
            }
        });
        check(&cache);
        let stats = cache.stats();
        assert!(stats.bytes <= capacity, "{stats:?}");
        assert!(
            stats.evictions > 0,
            "the test must fill the cache: {stats:?}"
        );
    }
}
