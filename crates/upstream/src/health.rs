//! Whether an upstream address is considered down.
//!
//! `max_fails` consecutive failed exchanges (timeouts, refused connections, resets on fresh
//! connections) mark it down; any reply (to a query or a health check) marks it up. The down mark
//! lives in a `watch` channel so the health checker (and tests) can await the transitions instead
//! of polling.

use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::watch;

#[derive(Debug)]
pub(crate) struct Health {
    /// 0 disables health tracking: the address is never marked down.
    max_fails: u32,
    /// Consecutive failures since the last reply (saturating: it must never wrap back to "up").
    fails: AtomicU32,
    down: watch::Sender<bool>,
}

impl Health {
    pub(crate) fn new(max_fails: u32) -> Self {
        Health {
            max_fails,
            fails: AtomicU32::new(0),
            down: watch::Sender::new(false),
        }
    }

    pub(crate) fn is_down(&self) -> bool {
        *self.down.borrow()
    }

    /// A failed exchange. Returns true if this one marked the address down.
    pub(crate) fn failure(&self) -> bool {
        if self.max_fails == 0 {
            return false;
        }
        let before = self
            .fails
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
                Some(f.saturating_add(1))
            })
            .unwrap_or(u32::MAX);
        if before.saturating_add(1) < self.max_fails {
            return false;
        }
        self.down
            .send_if_modified(|down| !std::mem::replace(down, true))
    }

    /// A reply arrived: the address is up again. Returns true if it was down.
    pub(crate) fn success(&self) -> bool {
        self.fails.store(0, Ordering::Release);
        if !self.is_down() {
            return false;
        }
        self.down
            .send_if_modified(|down| std::mem::replace(down, false))
    }

    /// A receiver that sees every change of the down mark.
    pub(crate) fn subscribe(&self) -> watch::Receiver<bool> {
        self.down.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_fails_consecutive_failures_mark_down() {
        let h = Health::new(3);
        assert!(!h.failure());
        assert!(!h.failure());
        assert!(!h.is_down());
        assert!(h.failure(), "the third failure marks it down");
        assert!(h.is_down());
        assert!(!h.failure(), "already down: no new transition");
    }

    #[test]
    fn a_reply_resets_the_count_and_marks_up() {
        let h = Health::new(2);
        h.failure();
        assert!(!h.success(), "was not down");
        assert!(!h.failure(), "count restarted after the reply");
        assert!(h.failure());
        assert!(h.success());
        assert!(!h.is_down());
    }

    #[test]
    fn zero_max_fails_never_marks_down() {
        let h = Health::new(0);
        for _ in 0..10 {
            assert!(!h.failure());
        }
        assert!(!h.is_down());
    }

    #[test]
    fn the_count_saturates_instead_of_wrapping() {
        let h = Health::new(1);
        h.fails.store(u32::MAX, Ordering::Relaxed);
        h.failure();
        assert_eq!(h.fails.load(Ordering::Relaxed), u32::MAX);
        assert!(h.is_down());
    }

    #[tokio::test]
    async fn subscribers_see_the_transitions() {
        let h = Health::new(1);
        let mut rx = h.subscribe();
        h.failure();
        assert!(*rx.wait_for(|d| *d).await.expect("sender alive"));
        h.success();
        assert!(!*rx.wait_for(|d| !*d).await.expect("sender alive"));
    }
}
