//! Whether an upstream address answers: CoreDNS's down mark, and the silence nodedns tracks
//! beside it.
//!
//! - **Down** (CoreDNS `max_fails`): an exchange that fails (refused, reset, no reply within the
//!   read timeout) starts the health checker, which sends `. IN NS` at once and then every
//!   `health_check` until one is answered. Each check without a reply counts; more than
//!   `max_fails` of them in a row mark the address down (CoreDNS's `Down`: `fails > maxfails`).
//!   An answered check, or any reply to a query, resets the count and marks it up. So a single
//!   dead endpoint behind a ClusterIP, whose live endpoints keep answering, never marks the
//!   Service down, while an address that answers nothing is down after about `max_fails + 1`
//!   checks.
//! - **Silent**: consecutive exchanges that passed their hedge timeout without a reply, with no
//!   reply from the address in between. An address silent [`SILENT`] times in a row answers
//!   nothing at the moment: queries stop hedging towards it (another connection would not
//!   help), try it last, and the group no longer counts it as healthy (serve-stale answers at
//!   once), long before the checker can mark it down. Any reply clears it.
//!
//! Transitions of the down mark go through a `watch` channel so tests can await them instead
//! of polling.

use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::{Notify, watch};

/// Consecutive silent exchanges after which an address counts as silent.
pub(crate) const SILENT: u32 = 8;

#[derive(Debug)]
pub(crate) struct Health {
    /// 0 disables health tracking: the address is never marked down (nor checked).
    max_fails: u32,
    /// Consecutive failed health checks since the last reply (saturating: it must never wrap
    /// back to "up").
    fails: AtomicU32,
    down: watch::Sender<bool>,
    /// Wakes the checker: an exchange failed.
    failed: Notify,
    /// Consecutive silent exchanges since the last reply.
    silent: AtomicU32,
}

impl Health {
    pub(crate) fn new(max_fails: u32) -> Self {
        Health {
            max_fails,
            fails: AtomicU32::new(0),
            down: watch::Sender::new(false),
            failed: Notify::new(),
            silent: AtomicU32::new(0),
        }
    }

    pub(crate) fn is_down(&self) -> bool {
        *self.down.borrow()
    }

    /// Whether the last [`SILENT`] exchanges all went silent, with no reply since.
    pub(crate) fn is_silent(&self) -> bool {
        self.silent.load(Ordering::Relaxed) >= SILENT
    }

    /// An exchange failed: the checker (if health tracking is on) starts checking, unless it
    /// already is.
    pub(crate) fn exchange_failed(&self) {
        if self.max_fails > 0 {
            self.failed.notify_one();
        }
    }

    /// Resolves when an exchange has failed since the checker last looked.
    pub(crate) async fn exchange_failure(&self) {
        self.failed.notified().await;
    }

    /// An exchange passed its hedge timeout without a reply.
    pub(crate) fn went_silent(&self) {
        self.silent.fetch_add(1, Ordering::Relaxed);
    }

    /// A health check got no reply. Returns true if this one marked the address down.
    pub(crate) fn check_failed(&self) -> bool {
        if self.max_fails == 0 {
            return false;
        }
        let before = self
            .fails
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |f| {
                Some(f.saturating_add(1))
            })
            .unwrap_or(u32::MAX);
        if before.saturating_add(1) <= self.max_fails {
            return false;
        }
        self.down
            .send_if_modified(|down| !std::mem::replace(down, true))
    }

    /// A reply arrived (to a query or a check): the address answers. Returns true if it was
    /// down.
    pub(crate) fn replied(&self) -> bool {
        if self.silent.load(Ordering::Relaxed) != 0 {
            self.silent.store(0, Ordering::Relaxed);
        }
        if self.fails.load(Ordering::Acquire) != 0 {
            self.fails.store(0, Ordering::Release);
        }
        if !self.is_down() {
            return false;
        }
        self.down
            .send_if_modified(|down| std::mem::replace(down, false))
    }

    /// A receiver that sees every change of the down mark (tests).
    #[cfg(test)]
    pub(crate) fn subscribe(&self) -> watch::Receiver<bool> {
        self.down.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn more_than_max_fails_failed_checks_mark_down() {
        let h = Health::new(2);
        assert!(!h.check_failed());
        assert!(!h.check_failed());
        assert!(!h.is_down(), "max_fails failed checks are not yet down");
        assert!(
            h.check_failed(),
            "the third marks it down, as CoreDNS's fails > max_fails"
        );
        assert!(h.is_down());
        assert!(!h.check_failed(), "already down: no new transition");
    }

    #[test]
    fn a_reply_resets_the_count_and_marks_up() {
        let h = Health::new(1);
        h.check_failed();
        assert!(!h.replied(), "was not down");
        assert!(!h.check_failed(), "count restarted after the reply");
        assert!(h.check_failed());
        assert!(h.replied());
        assert!(!h.is_down());
    }

    #[test]
    fn zero_max_fails_never_marks_down() {
        let h = Health::new(0);
        for _ in 0..10 {
            assert!(!h.check_failed());
        }
        assert!(!h.is_down());
    }

    #[test]
    fn the_count_saturates_instead_of_wrapping() {
        let h = Health::new(1);
        h.fails.store(u32::MAX, Ordering::Relaxed);
        h.check_failed();
        assert_eq!(h.fails.load(Ordering::Relaxed), u32::MAX);
        assert!(h.is_down());
    }

    #[test]
    fn consecutive_silences_make_it_silent_until_a_reply() {
        let h = Health::new(2);
        for _ in 1..SILENT {
            h.went_silent();
        }
        assert!(!h.is_silent());
        h.went_silent();
        assert!(h.is_silent());
        assert!(!h.is_down(), "silence is not the down mark");
        h.replied();
        assert!(!h.is_silent());
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_exchange_wakes_the_checker_once_health_is_tracked() {
        let h = Health::new(2);
        h.exchange_failed();
        tokio::time::timeout(Duration::from_secs(1), h.exchange_failure())
            .await
            .expect("woken");
        let off = Health::new(0);
        off.exchange_failed();
        assert!(
            tokio::time::timeout(Duration::from_secs(1), off.exchange_failure())
                .await
                .is_err(),
            "no checker with max_fails 0"
        );
    }

    #[tokio::test]
    async fn subscribers_see_the_transitions() {
        let h = Health::new(1);
        let mut rx = h.subscribe();
        h.check_failed();
        h.check_failed();
        assert!(*rx.wait_for(|d| *d).await.expect("sender alive"));
        h.replied();
        assert!(!*rx.wait_for(|d| !*d).await.expect("sender alive"));
    }
}
