//! Per-client fairness over UDP: a rate limit per client address, as unbound's `ip-ratelimit`
//! and dnsdist's `MaxQPSIPRule` have, so that one pod's flood costs the others as little as it
//! can.
//!
//! Each client address hashes to one bucket of a fixed table ([`BUCKETS`]), whatever the number
//! of addresses: a flood from spoofed sources cannot grow memory, it only spreads over the
//! table. Clients that share a bucket share a limit; the default is far above what a pod asks,
//! so two pods sharing one are still well within it, and a pod shares a flooder's bucket with
//! a chance of one in [`BUCKETS`].
//!
//! Each bucket is the generic cell rate algorithm (GCRA: a token bucket kept as one number): the
//! time at which the client's next query would be on schedule at `rate` queries a second.
//! A query may come up to `burst` queries ahead of that schedule; beyond it, it is answered
//! with TC=1 and no records (a real resolver asks again over TCP, which this limit does not
//! touch: RFC 7766 §5), at most another `rate` a second with the same burst; beyond that too,
//! it is dropped. So a client at twice the rate gets `rate` answers and `rate` TC replies a
//! second, and a flood gets no more than that whatever its speed.
//!
//! The check is on every UDP query, hits included: one hashed load, a compare and a store. The
//! buckets are shared by every worker thread (a client's queries from several source ports may
//! reach several workers) and updated with plain relaxed loads and stores, not read-modify-write
//! atomics: two workers racing on one bucket may lose one of the two updates, letting one query
//! through uncounted; a limit need not be exact, the hit path must stay cheap.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Buckets in the table (a power of two). 8,192 of 16 bytes: 128 KiB.
pub const BUCKETS: usize = 8192;

/// The default rate, per client address, in queries a second; the burst is the same number.
///
/// A pod resolving names as glibc does (A and AAAA for each name of the search list, ndots:5:
/// the benchmark's pod mix averages 4.2 queries per lookup) at 10,000 queries a second makes
/// about 2,400 lookups a second with no cache of its own, which is more than the busiest
/// ordinary pods (ingress controllers, proxies) ask; hostNetwork pods all share the node's
/// address, so their total must stay below it too. One worker thread answers several hundred
/// thousand hits a second, so a client held to this costs the others little.
pub const DEFAULT_RATE: u32 = 10_000;

/// What the limit says about one query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the rate: answer it.
    Answer,
    /// Beyond the rate: answer with TC=1 and no records.
    Truncate,
    /// Beyond the rate of TC replies too: drop it.
    Drop,
}

/// The limit's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Queries a second per client address answered in full, and as many more answered TC=1;
    /// 0 turns the limit off.
    pub rate: u32,
    /// Whether loopback sources (127.0.0.0/8, ::1) are limited too. They are not by default:
    /// they are the node's own processes, which can take any of 2^24 loopback addresses (a
    /// per-address limit cannot hold them), and local tools and benchmarks.
    pub loopback: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            rate: DEFAULT_RATE,
            loopback: false,
        }
    }
}

/// One bucket: the theoretical arrival time of the client's next query, in nanoseconds since
/// the table's start, for the full answers and for the TC replies.
#[derive(Debug, Default)]
struct Bucket {
    answer: AtomicU64,
    truncate: AtomicU64,
}

/// The table of buckets, one per process, shared by every UDP worker of every listen address.
#[derive(Debug)]
pub struct Limiter {
    /// Empty when the limit is off.
    buckets: Box<[Bucket]>,
    /// Nanoseconds between two queries at the rate.
    interval: u64,
    /// How far ahead of its schedule a client may be: the burst, `rate` queries.
    tolerance: u64,
    loopback: bool,
    /// Mixed into the hash, per process: no client can pick addresses that collide with
    /// another's bucket on every node.
    seed: u64,
    start: Instant,
}

impl Limiter {
    pub fn new(settings: Settings) -> Limiter {
        let rate = u64::from(settings.rate);
        let buckets = if rate == 0 {
            Box::default()
        } else {
            (0..BUCKETS).map(|_| Bucket::default()).collect()
        };
        let interval = 1_000_000_000u64.checked_div(rate).unwrap_or(0).max(1);
        Limiter {
            buckets,
            interval,
            tolerance: interval.saturating_mul(rate),
            loopback: settings.loopback,
            seed: rand::random::<u64>() | 1,
            start: Instant::now(),
        }
    }

    /// No limit.
    pub fn off() -> Limiter {
        Limiter::new(Settings {
            rate: 0,
            loopback: false,
        })
    }

    /// A worker's clock for [`Limiter::check`], first read at its next [`Clock::read`].
    pub fn clock(&self) -> Clock {
        Clock {
            next: self.start,
            nanos: 0,
        }
    }

    /// What to do with a query from `client` at `now` ([`Limiter::clock`]).
    #[inline]
    pub fn check(&self, client: &SocketAddr, now: u64) -> Verdict {
        let Some(bucket) = self.bucket(client.ip()) else {
            return Verdict::Answer;
        };
        let next = bucket.answer.load(Ordering::Relaxed).max(now);
        if next - now <= self.tolerance {
            bucket.answer.store(next + self.interval, Ordering::Relaxed);
            return Verdict::Answer;
        }
        self.beyond(bucket, client, now)
    }

    /// A client ahead of its schedule by more than the burst: TC while the TC replies are
    /// within the rate, else drop. Loopback clients (unless limited too) are answered.
    #[cold]
    fn beyond(&self, bucket: &Bucket, client: &SocketAddr, now: u64) -> Verdict {
        if !self.loopback && client.ip().is_loopback() {
            return Verdict::Answer;
        }
        let next = bucket.truncate.load(Ordering::Relaxed).max(now);
        if next - now <= self.tolerance {
            bucket
                .truncate
                .store(next + self.interval, Ordering::Relaxed);
            return Verdict::Truncate;
        }
        Verdict::Drop
    }

    #[inline]
    fn bucket(&self, ip: IpAddr) -> Option<&Bucket> {
        if self.buckets.is_empty() {
            return None;
        }
        let bits = match ip {
            IpAddr::V4(v4) => u64::from(v4.to_bits()),
            IpAddr::V6(v6) => {
                let bits = v6.to_bits();
                (bits >> 64) as u64 ^ bits as u64
            }
        };
        // Multiplicative hashing: the top bits of the product depend on every bit of the input.
        let hash = (bits ^ self.seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let index = (hash >> (64 - BUCKETS.trailing_zeros())) as usize;
        self.buckets.get(index)
    }
}

/// What [`Limiter::check`] takes as `now`: nanoseconds since the table's start, read from the
/// instant each batch of datagrams was received. Turning an instant into nanoseconds costs tens
/// of instructions, comparing two a few: the reading is redone at most once per [`TICK`], which
/// is finer than any budget needs (a client at the default rate gains a query per 100 µs it
/// lags, and its burst is a second's worth).
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    /// When the reading is next redone.
    next: Instant,
    nanos: u64,
}

/// How stale a [`Clock`]'s reading may be.
pub const TICK: Duration = Duration::from_millis(1);

impl Clock {
    /// Nanoseconds since `limiter`'s start at `now` (to within [`TICK`]). `limiter` must be
    /// the one that made this clock.
    #[inline]
    pub fn read(&mut self, limiter: &Limiter, now: Instant) -> u64 {
        if now >= self.next {
            self.refresh(limiter, now);
        }
        self.nanos
    }

    #[cold]
    fn refresh(&mut self, limiter: &Limiter, now: Instant) {
        let since = now.saturating_duration_since(limiter.start);
        self.nanos = u64::try_from(since.as_nanos()).unwrap_or(u64::MAX);
        self.next = now + TICK;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;

    fn client(ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), 40000)
    }

    fn limiter(rate: u32) -> Limiter {
        Limiter::new(Settings {
            rate,
            loopback: false,
        })
    }

    /// A limiter in which `a` and `b` do not share a bucket (the seed is random: one in
    /// [`BUCKETS`] does).
    fn apart(rate: u32, a: &SocketAddr, b: &SocketAddr) -> Limiter {
        loop {
            let l = limiter(rate);
            if !std::ptr::eq(l.bucket(a.ip()).unwrap(), l.bucket(b.ip()).unwrap()) {
                return l;
            }
        }
    }

    /// `n` queries from `from`, evenly spread over `seconds` starting at `start` (all at `start`
    /// for 0): how many of each verdict.
    fn run(l: &Limiter, from: &SocketAddr, start: u64, n: u64, seconds: u64) -> [u64; 3] {
        let mut counts = [0; 3];
        for i in 0..n {
            let at = start + i * seconds * SECOND / n;
            counts[l.check(from, at) as usize] += 1;
        }
        counts
    }

    #[test]
    fn a_client_within_the_rate_is_always_answered() {
        let l = limiter(100);
        let pod = client("10.244.1.7");
        assert_eq!(run(&l, &pod, SECOND, 1000, 10), [1000, 0, 0]);
    }

    #[test]
    fn a_burst_of_the_rate_is_answered_at_once_and_then_truncated_then_dropped() {
        let l = limiter(100);
        let pod = client("10.244.1.7");
        let now = 5 * SECOND;
        // All at one instant: the burst (100, and the one on schedule), then as many TC, then
        // nothing.
        let verdicts: Vec<Verdict> = (0..400).map(|_| l.check(&pod, now)).collect();
        let count = |v| verdicts.iter().filter(|&&x| x == v).count();
        assert_eq!(count(Verdict::Answer), 101);
        assert_eq!(count(Verdict::Truncate), 101);
        assert_eq!(count(Verdict::Drop), 198);
        // Order: answers, then TC, then drops.
        assert!(verdicts[..101].iter().all(|&v| v == Verdict::Answer));
        assert!(verdicts[101..202].iter().all(|&v| v == Verdict::Truncate));
    }

    #[test]
    fn a_flood_gets_the_rate_in_answers_and_in_tc_and_the_rest_is_dropped() {
        let l = limiter(100);
        let flood = client("10.244.1.8");
        // 10,000 a second for 10 s: about 100 a second answered and 100 TC, after the bursts.
        let [answered, truncated, dropped] = run(&l, &flood, SECOND, 100_000, 10);
        assert!((1000..=1102).contains(&answered), "{answered}");
        assert!((1000..=1102).contains(&truncated), "{truncated}");
        assert_eq!(answered + truncated + dropped, 100_000);
        // It slows down: answered again once back on schedule.
        assert_eq!(l.check(&flood, 30 * SECOND), Verdict::Answer);
    }

    #[test]
    fn one_clients_flood_leaves_another_clients_budget_alone() {
        let flood = client("10.244.1.8");
        let pod = client("10.244.1.9");
        let l = apart(100, &flood, &pod);
        let mut pod_answered = 0;
        for i in 0..100_000u64 {
            let at = SECOND + i * 10 * SECOND / 100_000;
            l.check(&flood, at);
            if i % 1000 == 0 {
                pod_answered += u64::from(l.check(&pod, at) == Verdict::Answer);
            }
        }
        assert_eq!(pod_answered, 100);
    }

    #[test]
    fn loopback_is_limited_only_when_asked() {
        let local = client("127.0.0.2");
        let v6 = client("::1");
        let l = limiter(10);
        assert_eq!(run(&l, &local, SECOND, 1000, 1), [1000, 0, 0]);
        assert_eq!(run(&l, &v6, SECOND, 1000, 1), [1000, 0, 0]);
        let strict = Limiter::new(Settings {
            rate: 10,
            loopback: true,
        });
        assert_eq!(run(&strict, &local, SECOND, 1000, 0)[0], 11);
    }

    #[test]
    fn the_clock_is_read_again_once_a_tick_has_passed() {
        let l = limiter(100);
        let mut clock = l.clock();
        let t0 = l.start + Duration::from_secs(3);
        assert_eq!(clock.read(&l, t0), 3 * SECOND);
        assert_eq!(clock.read(&l, t0 + TICK / 2), 3 * SECOND, "within the tick");
        let later = t0 + TICK;
        assert_eq!(clock.read(&l, later), 3 * SECOND + 1_000_000);
    }

    #[test]
    fn rate_zero_is_off() {
        let l = limiter(0);
        assert!(l.buckets.is_empty(), "no table");
        assert_eq!(
            run(&l, &client("10.0.0.1"), SECOND, 10_000, 1),
            [10_000, 0, 0]
        );
    }

    #[test]
    fn ipv6_clients_have_buckets_of_their_own() {
        let a = client("fd00::1");
        let b = client("fd00::2");
        let l = apart(10, &a, &b);
        assert_eq!(run(&l, &a, SECOND, 100, 0)[0], 11);
        assert_eq!(run(&l, &b, SECOND, 5, 1), [5, 0, 0]);
    }
}
