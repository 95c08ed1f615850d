//! Single-flight: concurrent misses for one key make one upstream query.
//!
//! The table holds, per key, the waiters that joined while one fetch for the key is under way.
//! A fetch starts in one of two ways:
//! - a client's miss ([`Flights::join`]): the first one leads (its waiter is queued first and
//!   it fetches), later ones follow;
//! - a background refresh ([`Flights::refresh`]: a prefetch, or refreshing an entry served
//!   stale): at most one per key, and it queues no waiter, so it never takes a client's place
//!   under the per-key bound. Clients that miss while it runs join it like any fetch and get its
//!   answer.
//!
//! The table is generic over the waiter so the cache never learns what a client is; whoever
//! fetched takes the waiters when the answer is in (after storing it, so a query arriving in
//! between finds the cache filled) and answers each.
//!
//! The table is split into shards by key hash, each a `std::sync::Mutex` held only for one map
//! lookup and a push or a take: no lock is ever held across a fetch or an `.await`, so a plain
//! blocking mutex is cheaper than an async one and cannot deadlock the runtime.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Mutex, MutexGuard, PoisonError};

use foldhash::fast::SeedableRandomState;

use crate::store::key_hasher;

/// Shards in the table; a power of two so the shard is a mask of the hash. 16 shards keep two
/// workers on different keys from meeting on one lock almost always, at 16 small maps of memory.
const SHARDS: usize = 16;

/// Whether the caller leads the fetch or joined one already under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joined<W> {
    /// The caller must fetch, then call [`Flights::complete`].
    Leader,
    /// The caller's waiter was queued; whoever fetches (a leader, or a background refresh)
    /// will answer it.
    Follower,
    /// The key already has the maximum number of waiters; the waiter was not queued and is
    /// handed back, so the caller can still answer it (SERVFAIL) instead of leaving it unanswered.
    Full(W),
}

/// What [`Flights::sizes`] counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sizes {
    /// Keys with a fetch in progress, background refreshes included.
    pub fetches: usize,
    /// Clients waiting for those fetches (a refresh has none of its own).
    pub waiters: usize,
}

type Map<W> = HashMap<Box<[u8]>, Vec<W>, SeedableRandomState>;
type Shard<W> = Mutex<Map<W>>;

/// The table of fetches in progress.
#[derive(Debug)]
pub struct Flights<W> {
    shards: Box<[Shard<W>]>,
    /// Picks the shard; random per table so that no one can aim many keys at one shard.
    hasher: SeedableRandomState,
    max_waiters: usize,
}

impl<W> Flights<W> {
    /// `max_waiters` bounds the waiters queued behind one key, the leader's included (the
    /// leader's own waiter is always queued, even when the bound is 0 or 1).
    pub fn new(max_waiters: usize) -> Self {
        Flights {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(HashMap::with_hasher(key_hasher())))
                .collect(),
            hasher: key_hasher(),
            max_waiters,
        }
    }

    /// Joins the fetch for `key`: the first caller becomes the leader (its `waiter` is queued too),
    /// later callers followers, also of a background refresh under way.
    pub fn join(&self, key: &[u8], waiter: W) -> Joined<W> {
        let mut shard = self.shard(key);
        match shard.get_mut(key) {
            Some(waiters) if waiters.len() >= self.max_waiters => Joined::Full(waiter),
            Some(waiters) => {
                waiters.push(waiter);
                Joined::Follower
            }
            None => {
                shard.insert(key.into(), vec![waiter]);
                Joined::Leader
            }
        }
    }

    /// Starts a background refresh of `key` unless a fetch for it is under way: `true` when the
    /// caller must now fetch, then call [`Flights::complete`] and answer the waiters that joined
    /// meanwhile; `false` when a fetch (a client's, or another refresh) is already under way and
    /// will refresh the key anyway. Queues nothing and counts nothing otherwise.
    pub fn refresh(&self, key: &[u8]) -> bool {
        let mut shard = self.shard(key);
        if shard.contains_key(key) {
            return false;
        }
        // An empty list does not allocate: a refresh costs the key only.
        shard.insert(key.into(), Vec::new());
        true
    }

    /// Ends the fetch for `key` and returns every queued waiter (the leader's first). Empty if
    /// no fetch for `key` was in progress, or nobody joined a refresh.
    pub fn complete(&self, key: &[u8]) -> Vec<W> {
        self.shard(key).remove(key).unwrap_or_default()
    }

    /// Takes the waiters queued behind `key` so far, leaving its fetch under way: whoever joins
    /// later follows it and is returned by [`Flights::complete`]. For answering the clients of
    /// a slow fetch early (from a stale entry) while the fetch goes on.
    pub fn take(&self, key: &[u8]) -> Vec<W> {
        self.shard(key)
            .get_mut(key)
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Fetches in progress and the waiters queued behind them, over every key.
    pub fn sizes(&self) -> Sizes {
        self.shards.iter().fold(Sizes::default(), |sizes, shard| {
            let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            Sizes {
                fetches: sizes.fetches + shard.len(),
                waiters: sizes.waiters + shard.values().map(Vec::len).sum::<usize>(),
            }
        })
    }

    fn shard(&self, key: &[u8]) -> MutexGuard<'_, Map<W>> {
        // Truncating the hash is the point: the low bits pick the shard.
        let index = self.hasher.hash_one(key) as usize & (SHARDS - 1);
        // A panic while holding a shard lock cannot leave the map half-updated (every critical
        // section is a single map operation), so a poisoned lock is safe to keep using.
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes<W>(flights: &Flights<W>) -> (usize, usize) {
        let Sizes { fetches, waiters } = flights.sizes();
        (fetches, waiters)
    }

    #[test]
    fn fifty_joins_make_one_leader_and_forty_nine_followers() {
        let flights = Flights::new(64);
        let joined: Vec<Joined<i32>> = (0..50).map(|i| flights.join(b"key", i)).collect();
        assert_eq!(joined[0], Joined::Leader);
        assert!(joined[1..].iter().all(|j| *j == Joined::Follower));
        assert_eq!(sizes(&flights), (1, 50));
        let waiters = flights.complete(b"key");
        assert_eq!(
            waiters,
            (0..50).collect::<Vec<_>>(),
            "leader's waiter first, then in order"
        );
        assert_eq!(sizes(&flights), (0, 0));
    }

    #[test]
    fn keys_are_independent() {
        let flights = Flights::new(8);
        assert_eq!(flights.join(b"a", 1), Joined::Leader);
        assert_eq!(flights.join(b"b", 2), Joined::Leader);
        assert_eq!(flights.join(b"a", 3), Joined::Follower);
        assert_eq!(sizes(&flights), (2, 3));
        assert_eq!(flights.complete(b"a"), [1, 3]);
        assert_eq!(
            flights.join(b"b", 4),
            Joined::Follower,
            "b's fetch is still under way"
        );
        assert_eq!(flights.complete(b"b"), [2, 4]);
    }

    #[test]
    fn taken_waiters_leave_the_fetch_under_way_for_later_ones() {
        let flights = Flights::new(8);
        assert_eq!(flights.join(b"k", 1), Joined::Leader);
        assert_eq!(flights.join(b"k", 2), Joined::Follower);
        assert_eq!(flights.take(b"k"), [1, 2]);
        assert_eq!(sizes(&flights), (1, 0), "still under way");
        assert!(!flights.refresh(b"k"), "no second fetch");
        assert_eq!(flights.join(b"k", 3), Joined::Follower);
        assert_eq!(flights.complete(b"k"), [3]);
        assert!(flights.take(b"none").is_empty());
    }

    #[test]
    fn join_after_complete_leads_a_new_fetch() {
        let flights = Flights::new(8);
        assert_eq!(flights.join(b"k", 1), Joined::Leader);
        assert_eq!(flights.complete(b"k"), [1]);
        assert_eq!(flights.join(b"k", 2), Joined::Leader);
    }

    #[test]
    fn complete_without_fetch_returns_nothing() {
        let flights: Flights<u8> = Flights::new(8);
        assert!(flights.complete(b"none").is_empty());
    }

    #[test]
    fn full_at_the_bound() {
        let flights = Flights::new(3);
        assert_eq!(flights.join(b"k", 1), Joined::Leader);
        assert_eq!(flights.join(b"k", 2), Joined::Follower);
        assert_eq!(flights.join(b"k", 3), Joined::Follower);
        assert_eq!(
            flights.join(b"k", 4),
            Joined::Full(4),
            "the waiter comes back"
        );
        assert_eq!(
            flights.join(b"other", 5),
            Joined::Leader,
            "the bound is per key"
        );
        assert_eq!(flights.complete(b"k"), [1, 2, 3]);
    }

    #[test]
    fn leader_is_queued_even_with_no_room_for_followers() {
        let flights = Flights::new(0);
        assert_eq!(flights.join(b"k", 1), Joined::Leader);
        assert_eq!(flights.join(b"k", 2), Joined::Full(2));
        assert_eq!(flights.complete(b"k"), [1]);
    }

    #[test]
    fn concurrent_joins_elect_exactly_one_leader() {
        let flights = Flights::new(1000);
        let leaders = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..4 {
                let (flights, leaders) = (&flights, &leaders);
                s.spawn(move || {
                    for i in 0..100 {
                        if flights.join(b"shared", t * 100 + i) == Joined::Leader {
                            leaders.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(leaders.into_inner(), 1);
        let mut waiters = flights.complete(b"shared");
        waiters.sort_unstable();
        assert_eq!(waiters, (0..400).collect::<Vec<_>>());
    }

    #[test]
    fn a_refresh_is_one_fetch_per_key_with_no_waiter() {
        let flights: Flights<u32> = Flights::new(4);
        assert!(flights.refresh(b"k"), "the first refresh fetches");
        for _ in 0..6000 {
            assert!(!flights.refresh(b"k"), "later ones find it under way");
        }
        assert_eq!(sizes(&flights), (1, 0), "no waiter for a refresh");
        assert!(flights.complete(b"k").is_empty());
        assert!(flights.refresh(b"k"), "after it ended, a new one may start");
    }

    #[test]
    fn clients_that_miss_during_a_refresh_join_it_and_keep_every_place() {
        let flights = Flights::new(3);
        assert!(flights.refresh(b"k"));
        for _ in 0..100 {
            assert!(!flights.refresh(b"k"));
        }
        assert_eq!(
            flights.join(b"k", 1),
            Joined::Follower,
            "not a second fetch"
        );
        assert_eq!(flights.join(b"k", 2), Joined::Follower);
        assert_eq!(
            flights.join(b"k", 3),
            Joined::Follower,
            "every place is a client's"
        );
        assert_eq!(flights.join(b"k", 4), Joined::Full(4));
        assert_eq!(
            flights.complete(b"k"),
            [1, 2, 3],
            "the refresh answers them"
        );
    }

    #[test]
    fn a_refresh_does_not_start_beside_a_clients_fetch() {
        let flights = Flights::new(8);
        assert_eq!(flights.join(b"k", 1), Joined::Leader);
        assert!(!flights.refresh(b"k"), "the miss's fetch refreshes the key");
        assert_eq!(sizes(&flights), (1, 1));
        assert_eq!(flights.complete(b"k"), [1]);
    }
}
