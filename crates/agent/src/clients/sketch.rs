//! The bounded structures behind per-client figures, each of fixed size whatever the traffic:
//!
//! - [`Table`]: the clients, a space-saving sketch (Metwally et al., 2005) made set-associative:
//!   an address hashes to a set of [`WAYS`] slots; a new address takes the slot of its set with
//!   the fewest queries and inherits that count as its error, so a heavy client is never pushed
//!   out by a crowd of light ones. Finding a client costs a hash and at most [`WAYS`] compares.
//! - [`Watches`]: what the slow path keeps per client (per-minute counts, the busiest zone), the
//!   same sketch, one for the process, behind the board's lock.
//! - [`Names`]: the most asked (client, name) pairs, the same sketch keyed by both.
//! - [`Distinct`]: a HyperLogLog of 64 registers (Flajolet et al., 2007; linear counting below
//!   2.5 × 64), for distinct names: ±13 % at any count, in 64 bytes.

use std::sync::atomic::{AtomicU64, Ordering};

/// Slots per set.
pub const WAYS: usize = 8;

/// Longest wire-form name (RFC 1035 §2.3.4).
pub const NAME_MAX: usize = 255;

/// A client's counts, from when its slot was taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Figures {
    pub queries: u64,
    pub nxdomain: u64,
    /// NXDOMAIN answers for names under the cluster domain: search-path expansions.
    pub search_misses: u64,
    /// Answers from the cache, of `lookups` queries that went through one.
    pub hits: u64,
    pub lookups: u64,
    /// Queries with a label or a name over the limits.
    pub long: u64,
    /// Cache misses with a random-looking label.
    pub random: u64,
}

impl Figures {
    pub fn add(&mut self, other: &Figures) {
        self.queries += other.queries;
        self.nxdomain += other.nxdomain;
        self.search_misses += other.search_misses;
        self.hits += other.hits;
        self.lookups += other.lookups;
        self.long += other.long;
        self.random += other.random;
    }

    /// `self - other`, never below zero.
    pub fn minus(&self, other: &Figures) -> Figures {
        Figures {
            queries: self.queries.saturating_sub(other.queries),
            nxdomain: self.nxdomain.saturating_sub(other.nxdomain),
            search_misses: self.search_misses.saturating_sub(other.search_misses),
            hits: self.hits.saturating_sub(other.hits),
            lookups: self.lookups.saturating_sub(other.lookups),
            long: self.long.saturating_sub(other.long),
            random: self.random.saturating_sub(other.random),
        }
    }
}

/// A wire-form name stored inline (no allocation when a slot changes hands).
#[derive(Clone, Copy)]
pub struct Name {
    len: u8,
    bytes: [u8; NAME_MAX],
}

impl Default for Name {
    fn default() -> Self {
        Name {
            len: 0,
            bytes: [0; NAME_MAX],
        }
    }
}

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&super::name::text(self.get()))
    }
}

impl Name {
    pub fn set(&mut self, name: &[u8]) {
        let len = name.len().min(NAME_MAX);
        self.bytes[..len].copy_from_slice(&name[..len]);
        self.len = len as u8;
    }

    pub fn get(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// Distinct names under one zone, per minute.
#[derive(Debug, Clone, Copy, Default)]
pub struct Zone {
    /// Hash of the zone counted, and the zone itself (wire form).
    pub hash: u64,
    pub name: Name,
    /// Boyer–Moore majority vote: a miss under this zone adds one, under another takes one; at
    /// zero the next other zone takes over. A client that keeps asking under one zone keeps it.
    votes: u32,
    pub distinct: Distinct,
    /// `distinct.estimate()`, kept: it changes only when a register does, and a flood of unique
    /// names from one client asks for it on every miss.
    estimate: u32,
    /// Minute `distinct` counts.
    pub minute: u32,
    /// Estimate of the last complete minute (the zone's, 0 when the zone changed since).
    pub last: u32,
}

/// One client of a [`Table`], as a scrape reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Row {
    /// The address as IPv6 (IPv4 mapped, RFC 4291 §2.5.5.2).
    pub addr: u128,
    /// Queries the slot's previous holder had when this client took it: `figures.queries`
    /// counts them too (space-saving's overestimate, which ranks the clients), so the client's
    /// own count is `figures.queries - error`, and every other figure counts from when it took
    /// the slot.
    pub error: u64,
    pub figures: Figures,
}

/// What the slow path keeps of one client: its per-minute counts and its busiest zone.
#[derive(Debug, Clone, Copy, Default)]
pub struct Watch {
    /// The address as IPv6 (IPv4 mapped); meaningful when `used`.
    pub addr: u128,
    pub used: bool,
    /// Slow-path queries since the client took its place, plus what the previous holder had
    /// (space-saving: the watch of a busy client outlives a crowd of one-off ones).
    count: u64,
    /// Minute of the per-minute counts below.
    pub minute: u32,
    pub long_this_minute: u32,
    pub random_this_minute: u32,
    /// Signals already reported this minute (bit per signal).
    pub alerted: u8,
    pub zone: Zone,
}

impl Watch {
    /// Starts a new minute for the per-minute counts if `minute` is past the watch's.
    pub fn roll(&mut self, minute: u32) {
        if self.minute != minute {
            self.minute = minute;
            self.long_this_minute = 0;
            self.random_this_minute = 0;
            self.alerted = 0;
        }
    }

    /// Counts a miss under the zone hashed `zone_hash` (`zone` its wire name) for the name
    /// hashed `name_hash`; returns the zone's distinct estimate this minute.
    pub fn distinct(&mut self, zone_hash: u64, zone: &[u8], name_hash: u64, minute: u32) -> u32 {
        let z = &mut self.zone;
        // Boyer–Moore: another zone takes one vote, and the place once none is left; the zone
        // held keeps its count however its votes go (a client asking under it every other
        // miss is its client still). An unused watch holds no name.
        if z.hash != zone_hash || z.name.get().is_empty() {
            if z.votes > 0 {
                z.votes -= 1;
                return z.estimate;
            }
            *z = Zone {
                hash: zone_hash,
                minute,
                ..Zone::default()
            };
            z.name.set(zone);
        }
        z.votes = z.votes.saturating_add(1);
        if z.minute != minute {
            z.last = if z.minute + 1 == minute {
                z.estimate
            } else {
                0
            };
            z.minute = minute;
            z.distinct = Distinct::default();
            z.estimate = 0;
        }
        if z.distinct.insert(name_hash) {
            z.estimate = z.distinct.estimate();
        }
        z.estimate
    }

    /// The zone's distinct names per minute at `minute`: the larger of the last complete
    /// minute and this one so far.
    pub fn per_minute(&self, minute: u32) -> u32 {
        let z = &self.zone;
        if z.minute == minute {
            z.estimate.max(z.last)
        } else if z.minute + 1 == minute {
            z.estimate
        } else {
            0
        }
    }
}

/// The watched clients: a set-associative space-saving table of [`Watch`]es by address.
#[derive(Debug)]
pub struct Watches {
    watches: Box<[Watch]>,
    mask: usize,
    seed: u64,
}

impl Watches {
    pub fn new(slots: usize, seed: u64) -> Self {
        let sets = sets_for(slots);
        Watches {
            watches: vec![Watch::default(); sets * WAYS].into_boxed_slice(),
            mask: sets - 1,
            seed,
        }
    }

    fn set(&self, addr: u128) -> usize {
        (spread((addr >> 64) as u64 ^ addr as u64 ^ self.seed) as usize & self.mask) * WAYS
    }

    /// `addr`'s watch, counted once more; taken over from the least-counted client of its set
    /// (its state reset) when it has none.
    pub fn count(&mut self, addr: u128) -> &mut Watch {
        let set = self.set(addr);
        let ways = &mut self.watches[set..set + WAYS];
        let i = match ways.iter().position(|w| w.used && w.addr == addr) {
            Some(i) => i,
            None => {
                let i = ways
                    .iter()
                    .position(|w| !w.used)
                    .unwrap_or_else(|| (0..WAYS).min_by_key(|&i| ways[i].count).unwrap_or(0));
                let inherited = if ways[i].used { ways[i].count } else { 0 };
                ways[i] = Watch {
                    addr,
                    used: true,
                    count: inherited,
                    ..Watch::default()
                };
                i
            }
        };
        let watch = &mut ways[i];
        watch.count += 1;
        watch
    }

    /// `addr`'s watch, if it has one.
    pub fn get(&self, addr: u128) -> Option<&Watch> {
        let set = self.set(addr);
        self.watches[set..set + WAYS]
            .iter()
            .find(|w| w.used && w.addr == addr)
    }
}

fn spread(key: u64) -> u64 {
    let h = key.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^ (h >> 29)
}

/// Number of sets for at least `slots` slots: a power of two, at least one.
fn sets_for(slots: usize) -> usize {
    slots.div_ceil(WAYS).max(1).next_power_of_two()
}

/// A slot's counts. Queries are counted by how they were answered (hit, miss, neither), so a
/// cache hit, the common case, adds to one cell: queries and lookups are sums.
pub mod at {
    pub const HITS: usize = 0;
    pub const MISSES: usize = 1;
    /// Neither looked up in a cache nor a hit: blocks without cache, REFUSED.
    pub const OTHER: usize = 2;
    pub const NXDOMAIN: usize = 3;
    pub const SEARCH_MISSES: usize = 4;
    pub const LONG: usize = 5;
    pub const RANDOM: usize = 6;
    pub const COUNTS: usize = 7;
}

fn figures(counts: &[AtomicU64; at::COUNTS]) -> Figures {
    let get = |i: usize| counts[i].load(Ordering::Relaxed);
    let (hits, misses) = (get(at::HITS), get(at::MISSES));
    Figures {
        queries: hits + misses + get(at::OTHER),
        nxdomain: get(at::NXDOMAIN),
        search_misses: get(at::SEARCH_MISSES),
        hits,
        lookups: hits + misses,
        long: get(at::LONG),
        random: get(at::RANDOM),
    }
}

/// `figures` back into counts (for the evicted totals).
fn counts(f: &Figures) -> [u64; at::COUNTS] {
    let mut c = [0; at::COUNTS];
    c[at::HITS] = f.hits;
    c[at::MISSES] = f.lookups - f.hits;
    c[at::OTHER] = f.queries - f.lookups;
    c[at::NXDOMAIN] = f.nxdomain;
    c[at::SEARCH_MISSES] = f.search_misses;
    c[at::LONG] = f.long;
    c[at::RANDOM] = f.random;
    c
}

/// One slot's cells.
#[derive(Debug, Default)]
struct Cells {
    /// The address's high half, inverted: 0 marks a free slot. (The one address that inverts
    /// to 0 in the high half, `ffff:ffff:ffff:ffff::/64`, is multicast, never a client.) One
    /// compare says "free" and is half of "this address", so the hit path needs no flag.
    hi: AtomicU64,
    /// The low half.
    lo: AtomicU64,
    /// Queries the previous holder had counted: space-saving's overestimate of this client.
    error: AtomicU64,
    counts: [AtomicU64; at::COUNTS],
}

impl Cells {
    fn used(&self) -> bool {
        self.hi.load(Ordering::Relaxed) != 0
    }

    fn addr(&self) -> u128 {
        u128::from(!self.hi.load(Ordering::Relaxed)) << 64
            | u128::from(self.lo.load(Ordering::Relaxed))
    }
}

/// Adds `n` to a cell. A table with a single writer needs no locked instruction: its thread is
/// the only one that stores, a scrape only loads.
/// Returns the new count.
#[inline(always)]
fn bump<const SINGLE_WRITER: bool>(cell: &AtomicU64, n: u64) -> u64 {
    if SINGLE_WRITER {
        let v = cell.load(Ordering::Relaxed).wrapping_add(n);
        cell.store(v, Ordering::Relaxed);
        v
    } else {
        cell.fetch_add(n, Ordering::Relaxed).wrapping_add(n)
    }
}

/// A client's slot, found by [`Table::find`].
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    cell: &'a Cells,
    pub index: usize,
}

impl Entry<'_> {
    /// Adds `n` to count `count` (an [`at`] index); returns the new count.
    #[inline(always)]
    pub fn add<const SINGLE_WRITER: bool>(&self, count: usize, n: u64) -> u64 {
        self.cell
            .counts
            .get(count)
            .map_or(0, |c| bump::<SINGLE_WRITER>(c, n))
    }
}

/// The clients' space-saving table, in atomic cells so the hit path takes no lock: a UDP
/// worker's table has one writer (its thread: relaxed loads and stores), a shared block's has
/// several (atomic adds; two writers taking a slot at once can leave a client in two slots,
/// which the merge at scrape time adds up). A scrape reads the cells while they change: it may
/// see a slot half taken over, for one scrape.
#[derive(Debug)]
pub struct Table {
    /// [set][way]: one bounds check finds a set, none its ways.
    sets: Box<[[Cells; WAYS]]>,
    mask: usize,
    seed: u64,
    /// What the clients that lost their slot had counted: with the slots' own counts, the
    /// table's totals (so the hit path counts once, in the slot).
    evicted: [AtomicU64; at::COUNTS],
}

impl Table {
    /// A table of at least `slots` slots, its sets chosen by an address hash mixed with `seed`.
    pub fn new(slots: usize, seed: u64) -> Self {
        let sets = sets_for(slots);
        Table {
            sets: (0..sets).map(|_| Default::default()).collect(),
            mask: sets - 1,
            seed,
            evicted: Default::default(),
        }
    }

    /// `addr`'s slot, taken over from the least-counted client of its set when it has none.
    #[inline(always)]
    pub fn find<const SINGLE_WRITER: bool>(&self, addr: u128) -> Entry<'_> {
        let (hi, lo) = (!((addr >> 64) as u64), addr as u64);
        let set = spread(hi ^ lo ^ self.seed) as usize & self.mask;
        if let Some(ways) = self.sets.get(set) {
            for (i, cell) in ways.iter().enumerate() {
                let h = cell.hi.load(Ordering::Relaxed);
                if h == hi && cell.lo.load(Ordering::Relaxed) == lo {
                    return Entry {
                        cell,
                        index: set * WAYS + i,
                    };
                }
                // Used slots are a prefix of the set: a slot once taken is only taken over.
                if h == 0 {
                    break;
                }
            }
        }
        self.take::<SINGLE_WRITER>(set, hi, lo)
    }

    /// Gives the least-counted slot of set `set` (or its first free one) to the address whose
    /// halves are `hi` (inverted) and `lo`; the count it had becomes the newcomer's error.
    #[cold]
    #[inline(never)]
    fn take<const SINGLE_WRITER: bool>(&self, set: usize, hi: u64, lo: u64) -> Entry<'_> {
        let ways = &self.sets[set & self.mask];
        let queries = |c: &Cells| {
            c.error.load(Ordering::Relaxed)
                + (at::HITS..=at::OTHER)
                    .map(|i| c.counts[i].load(Ordering::Relaxed))
                    .sum::<u64>()
        };
        let i = ways
            .iter()
            .position(|c| !c.used())
            .unwrap_or_else(|| (0..WAYS).min_by_key(|&i| queries(&ways[i])).unwrap_or(0));
        let cell = &ways[i];
        let inherited = if cell.used() {
            let own = figures(&cell.counts);
            for (e, v) in self.evicted.iter().zip(counts(&own)) {
                bump::<SINGLE_WRITER>(e, v);
            }
            queries(cell)
        } else {
            0
        };
        cell.error.store(inherited, Ordering::Relaxed);
        for c in &cell.counts {
            c.store(0, Ordering::Relaxed);
        }
        cell.lo.store(lo, Ordering::Relaxed);
        cell.hi.store(hi, Ordering::Relaxed);
        Entry {
            cell,
            index: (set & self.mask) * WAYS + i,
        }
    }

    /// Adds `n` to count `count` (an [`at`] index) of slot `slot`.
    pub fn add<const SINGLE_WRITER: bool>(&self, slot: usize, count: usize, n: u64) {
        let cell = self
            .sets
            .get(slot / WAYS)
            .and_then(|ways| ways[slot % WAYS].counts.get(count));
        if let Some(cell) = cell {
            bump::<SINGLE_WRITER>(cell, n);
        }
    }

    /// The clients in the table now.
    pub fn rows(&self) -> Vec<Row> {
        self.sets
            .iter()
            .flatten()
            .filter(|c| c.used())
            .map(|c| {
                let addr = c.addr();
                let mut figures = figures(&c.counts);
                let error = c.error.load(Ordering::Relaxed);
                // Counted with what it inherited (space-saving's order); `error` says how much.
                figures.queries += error;
                Row {
                    addr,
                    error,
                    figures,
                }
            })
            .collect()
    }

    /// What the clients that left the table had counted.
    pub fn evicted(&self) -> Figures {
        figures(&self.evicted)
    }

    /// Everything counted: the clients in the table (less what they inherited) and those that
    /// left it.
    pub fn totals(&self) -> Figures {
        let mut totals = self.evicted();
        for row in self.rows() {
            totals.add(&row.own());
        }
        totals
    }
}

impl Row {
    /// The figures counted since the client took its slot (`queries` less the inherited).
    pub fn own(&self) -> Figures {
        let mut own = self.figures;
        own.queries -= self.error;
        own
    }
}

/// One (client, name) pair of [`Names`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Pair {
    pub addr: u128,
    pub hash: u64,
    pub used: bool,
    pub count: u64,
    pub error: u64,
    pub name: Name,
}

/// The most asked (client, name) pairs: the top names of the heaviest clients.
#[derive(Debug, Clone)]
pub struct Names {
    pairs: Box<[Pair]>,
    mask: usize,
}

impl Names {
    pub fn new(pairs: usize) -> Self {
        let sets = sets_for(pairs);
        Names {
            pairs: vec![Pair::default(); sets * WAYS].into_boxed_slice(),
            mask: sets - 1,
        }
    }

    /// Counts `weight` queries of `name` (hashed `hash`) from `addr`.
    pub fn count(&mut self, addr: u128, hash: u64, name: &[u8], weight: u64) {
        let key = hash ^ (addr as u64) ^ ((addr >> 64) as u64).rotate_left(17);
        let set = (spread(key) as usize & self.mask) * WAYS;
        let ways = &mut self.pairs[set..set + WAYS];
        let (mut least, mut found) = (0, None);
        for (i, pair) in ways.iter().enumerate() {
            if pair.used && pair.hash == hash && pair.addr == addr {
                found = Some(i);
                break;
            }
            if !pair.used {
                least = i;
                break;
            }
            if pair.count < ways[least].count {
                least = i;
            }
        }
        if let Some(i) = found {
            ways[i].count += weight;
            return;
        }
        let pair = &mut ways[least];
        let inherited = if pair.used { pair.count } else { 0 };
        pair.addr = addr;
        pair.hash = hash;
        pair.used = true;
        pair.count = inherited + weight;
        pair.error = inherited;
        pair.name.set(name);
    }

    pub fn used(&self) -> impl Iterator<Item = &Pair> {
        self.pairs.iter().filter(|p| p.used)
    }
}

/// HyperLogLog registers.
const REGISTERS: usize = 64;

/// A distinct count of 64-bit hashes in 64 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Distinct([u8; REGISTERS]);

impl Default for Distinct {
    fn default() -> Self {
        Distinct([0; REGISTERS])
    }
}

impl Distinct {
    /// Counts `hash`; true when a register changed (and with it the estimate).
    #[inline]
    pub fn insert(&mut self, hash: u64) -> bool {
        // MurmurHash3's finalizer: every input bit reaches the register index and the rank.
        let mut h = hash;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 33;
        let register = (h >> 58) as usize;
        // Rank of the first 1 bit in the other 58 bits (a sentinel bounds it).
        let rank = ((h << 6) | (1 << 5)).leading_zeros() as u8 + 1;
        if self.0[register] < rank {
            self.0[register] = rank;
            return true;
        }
        false
    }

    pub fn estimate(&self) -> u32 {
        let m = REGISTERS as f64;
        let zeros = self.0.iter().filter(|&&r| r == 0).count();
        // 2^-r built from its exponent bits (exact, as `exp2` of an integer is): the estimate
        // runs on every upstream query of a watched client, and 64 calls into libm's `exp2`
        // were a tenth of a miss's instructions. A rank is at most 59, far from subnormals.
        let sum: f64 = self
            .0
            .iter()
            .map(|&r| f64::from_bits((1023 - u64::from(r)) << 52))
            .sum();
        let raw = 0.709 * m * m / sum;
        let estimate = if raw <= 2.5 * m && zeros > 0 {
            m * (m / zeros as f64).ln()
        } else {
            raw
        };
        estimate.round() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(last: u8) -> u128 {
        u128::from(std::net::Ipv4Addr::new(127, 0, 0, last).to_ipv6_mapped())
    }

    fn count(table: &Table, addr: u128) {
        table.find::<true>(addr).add::<true>(at::HITS, 1);
    }

    fn slots(table: &Table) -> Vec<Row> {
        table.rows()
    }

    #[test]
    fn clients_that_fit_are_counted_exactly() {
        let table = Table::new(128, 1);
        for (client, n) in [(2u8, 50u64), (3, 30), (4, 20), (5, 10)] {
            for _ in 0..n {
                count(&table, v4(client));
            }
        }
        let mut got: Vec<(u128, u64, u64)> = slots(&table)
            .iter()
            .map(|s| (s.addr, s.figures.queries, s.error))
            .collect();
        got.sort_by_key(|&(_, q, _)| std::cmp::Reverse(q));
        assert_eq!(
            got,
            [
                (v4(2), 50, 0),
                (v4(3), 30, 0),
                (v4(4), 20, 0),
                (v4(5), 10, 0)
            ]
        );
        assert_eq!(table.totals().queries, 110);
    }

    #[test]
    fn a_crowd_of_one_query_clients_never_pushes_a_heavy_client_out() {
        let table = Table::new(16, 2);
        let heavy = v4(2);
        let mut crowd = 0u128;
        for round in 0..10_000u128 {
            // One heavy query for every nine one-off addresses.
            count(&table, heavy);
            for _ in 0..9 {
                crowd += 1;
                count(&table, 0x2001_0db8 << 96 | crowd);
            }
            assert!(
                slots(&table).iter().any(|s| s.addr == heavy),
                "pushed out in round {round}"
            );
        }
        let all = slots(&table);
        let slot = all.iter().find(|s| s.addr == heavy).unwrap();
        assert_eq!(slot.figures.queries - slot.error, 10_000);
        assert_eq!(all.len(), 16, "the table never grows");
        assert_eq!(
            table.totals().queries,
            100_000,
            "the evicted are in the totals"
        );
    }

    #[test]
    fn a_taken_over_slot_inherits_the_count_as_its_error() {
        let table = Table::new(1, 3);
        for i in 0..WAYS as u128 {
            for _ in 0..=i {
                count(&table, i + 1);
            }
        }
        count(&table, 100);
        let all = slots(&table);
        let newcomer = all.iter().find(|s| s.addr == 100).unwrap();
        assert_eq!((newcomer.figures.queries, newcomer.error), (2, 1));
        assert!(!all.iter().any(|s| s.addr == 1), "the least counted left");
    }

    #[test]
    fn the_distinct_count_is_near_the_truth_at_every_scale() {
        for n in [1u64, 10, 100, 1_000, 100_000] {
            let mut d = Distinct::default();
            for i in 0..n {
                d.insert(i);
                d.insert(i); // repeats do not count
            }
            let e = f64::from(d.estimate());
            let err = (e - n as f64).abs() / n as f64;
            assert!(err <= 0.3, "{n} distinct estimated {e}");
        }
        assert_eq!(Distinct::default().estimate(), 0);
    }

    #[test]
    fn the_estimate_sums_the_same_powers_of_two_as_exp2() {
        // Every rank a register can hold (0 to 59), in registers of one sketch.
        let mut d = Distinct::default();
        for (i, r) in d.0.iter_mut().enumerate() {
            *r = (i % 60) as u8;
        }
        for r in 0..=59u8 {
            let bits = f64::from_bits((1023 - u64::from(r)) << 52);
            assert_eq!(bits, (-f64::from(r)).exp2(), "rank {r}");
        }
        let m = REGISTERS as f64;
        let sum: f64 = d.0.iter().map(|&r| (-f64::from(r)).exp2()).sum();
        let raw = 0.709 * m * m / sum;
        let zeros = d.0.iter().filter(|&&r| r == 0).count() as f64;
        let expected = if raw <= 2.5 * m {
            m * (m / zeros).ln()
        } else {
            raw
        };
        assert_eq!(d.estimate(), expected.round() as u32);
    }

    #[test]
    fn a_zone_asked_every_other_miss_keeps_its_count() {
        // A flood of unique names: half under one zone, the rest under two others in turn.
        let mut slot = Watch::default();
        let zone = b"\x07example\x03com\x00";
        let others: [&[u8]; 2] = [b"\x04wild\x07example\x03org\x00", b"\x07example\x03net\x00"];
        for i in 0..400u64 {
            slot.distinct(1, zone, 2 * i, 3);
            slot.distinct(2 + i % 2, others[(i % 2) as usize], 2 * i + 1, 3);
        }
        assert_eq!((slot.zone.hash, slot.zone.name.get()), (1, zone.as_slice()));
        let e = slot.per_minute(3);
        assert!((280..=520).contains(&e), "400 distinct names estimated {e}");
    }

    #[test]
    fn the_kept_estimate_is_the_sketchs_after_every_miss() {
        let mut slot = Watch::default();
        let zone = b"\x07example\x03com\x00";
        for i in 0..5_000u64 {
            // Repeats, a second zone now and then, and a new minute every 1,000 misses.
            let (hash, name) = if i % 7 == 0 {
                (2, b"\x03com\x00".as_slice())
            } else {
                (1, zone.as_slice())
            };
            let got = slot.distinct(hash, name, i % 3_000, (i / 1_000) as u32);
            assert_eq!(got, slot.zone.distinct.estimate(), "miss {i}");
            assert_eq!(slot.per_minute((i / 1_000) as u32), got.max(slot.zone.last));
        }
    }

    #[test]
    fn a_zone_asked_mostly_keeps_its_count_through_other_misses() {
        let mut slot = Watch::default();
        let zone = b"\x01t\x07example\x03com\x00";
        for i in 0..200u64 {
            slot.distinct(1, zone, 1000 + i, 7);
            // Every fourth miss is under another zone.
            if i % 4 == 0 {
                slot.distinct(2, b"\x03com\x00", i, 7);
            }
        }
        assert_eq!(slot.zone.hash, 1);
        let e = slot.zone.distinct.estimate();
        assert!((160..=240).contains(&e), "{e}");
        // The next minute starts from zero and remembers the last.
        assert_eq!(slot.distinct(1, zone, 5, 8), 1);
        assert_eq!(slot.zone.last, e);
        // After a gap of minutes, the last complete minute had nothing.
        slot.distinct(1, zone, 6, 10);
        assert_eq!(slot.zone.last, 0);
    }

    #[test]
    fn a_crowd_of_one_off_clients_never_takes_a_busy_clients_watch() {
        let mut watches = Watches::new(16, 4);
        let busy = v4(2);
        watches.count(busy).long_this_minute = 7;
        for i in 0..10_000u128 {
            watches.count(busy);
            watches.count(0x2001_0db8 << 96 | i);
            assert_eq!(
                watches.get(busy).map(|w| w.long_this_minute),
                Some(7),
                "{i}"
            );
        }
        assert!(watches.get(0x2001_0db8 << 96).is_none(), "a one-off left");
    }

    #[test]
    fn names_keep_the_heaviest_pairs() {
        let mut names = Names::new(16);
        for _ in 0..100 {
            names.count(v4(2), 11, b"\x01a\x00", 1);
        }
        for i in 0..1000u64 {
            names.count(v4(3), 1000 + i, b"\x01b\x00", 1);
        }
        let heavy = names.used().find(|p| p.hash == 11).unwrap();
        assert_eq!((heavy.count, heavy.error), (100, 0));
        assert_eq!(heavy.name.get(), b"\x01a\x00");
    }
}
