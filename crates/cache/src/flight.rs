//! Single-flight: concurrent misses for one key make one upstream query.
//!
//! The table holds, per key, the waiters that joined while the first miss (the leader) is
//! fetching. It is generic over the waiter so the cache never learns what a client is; the leader
//! takes the waiters when the answer is in (after inserting it, so a query arriving in between
//! finds the cache filled) and answers each.

/// Whether the caller leads the fetch or joined one already under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Joined {
    /// The caller must fetch, then call [`Flights::complete`].
    Leader,
    /// The caller's waiter was queued; the leader will answer it.
    Follower,
    /// The key already has the maximum number of waiters; the waiter was not queued.
    Full,
}

/// The table of fetches in progress.
#[derive(Debug)]
pub struct Flights<W> {
    _w: std::marker::PhantomData<W>,
}

impl<W> Flights<W> {
    /// `max_waiters` bounds the waiters queued behind one key.
    pub fn new(max_waiters: usize) -> Self {
        let _ = max_waiters;
        todo!()
    }

    /// Joins the fetch for `key`: the first caller becomes the leader (its `waiter` is queued too),
    /// later callers followers.
    pub fn join(&self, key: &[u8], waiter: W) -> Joined {
        let _ = (key, waiter);
        todo!()
    }

    /// Ends the fetch for `key` and returns every queued waiter (the leader's first).
    pub fn complete(&self, key: &[u8]) -> Vec<W> {
        let _ = key;
        todo!()
    }

    /// Keys with a fetch in progress, and waiters queued in all.
    pub fn len(&self) -> (usize, usize) {
        todo!()
    }
}
