//! What an upstream exchange does to the entry already held (RFC 8767, CoreDNS's
//! `serve_stale_policy`): [`Cache::update`], and when a stale entry is answered without asking
//! the upstream first, [`Cache::stale_at_once`].
//!
//! The rules, in the order [`Cache::update`] applies them:
//!
//! 1. A failure (no usable reply in time, or any RCODE but NOERROR and NXDOMAIN: SERVFAIL,
//!    REFUSED, NOTIMP, ...) never replaces a usable entry (fresh, or stale inside the window):
//!    the entry stays and answers, its recheck period starts (RFC 8767 §4: such an answer is "a
//!    failure to refresh the data and therefore leave[s] any previous state intact"). So a
//!    prefetch that gets SERVFAIL leaves the fresh entry fresh, and a stale entry outlives every
//!    SERVFAIL CoreDNS sends while its own upstream is down.
//! 2. With `prefer_positive`, a denial (NXDOMAIN, or NOERROR without an answer) never replaces a
//!    usable positive entry either: the last good answer stays until it leaves its window or a
//!    positive answer replaces it (CoreDNS 1.14's policy).
//! 3. Anything else is stored as [`Cache::store`] stores it (SERVFAIL for `servfail_ttl` when
//!    nothing usable was held; REFUSED and other RCODEs relayed, not kept).

use std::sync::Arc;
use std::time::{Duration, Instant};

use nodedns_wire::{Reply, TtlRule, rcode};

use crate::store::Usable;
use crate::{Cache, Class, Entry, MIN_RECHECK, Refresh, Stored};

/// What one upstream exchange for a key brought, for [`Cache::update`].
#[derive(Debug)]
pub enum Fetched {
    /// A reply that parsed, whatever its RCODE.
    Reply(Reply),
    /// No usable reply: no answer in time, a connection error, a reply that did not parse.
    Failed,
}

/// What [`Cache::update`] did with an exchange, with what the clients that waited get.
#[derive(Debug)]
pub enum Updated {
    /// The reply was stored: answer from the entry with `TtlRule::fresh(0, entry.ttl())`.
    Stored(Arc<Entry>),
    /// The entry held already stays (the exchange failed, or `prefer_positive` kept it): answer
    /// from it with `ttl`, a stale rule if `stale`.
    Kept {
        entry: Arc<Entry>,
        ttl: TtlRule,
        stale: bool,
    },
    /// Not kept, and nothing held to answer instead: relay the reply, its TTLs by the rule
    /// (`TtlRule::STORED` for what is not cacheable; the lifetime it would have had for a class
    /// `disable` keeps out, as CoreDNS rewrites the TTLs of what it passes on).
    NotCacheable(Reply, TtlRule),
    /// No reply, nothing held: SERVFAIL.
    Failed,
}

impl Cache {
    /// Applies the upstream exchange for `key` at `now` by the rules in this module's head, and
    /// ends a background refresh of the entry held (a failure starts its recheck period).
    pub fn update(&self, key: &[u8], fetched: Fetched, now: Instant) -> Updated {
        let held = self.peek(key).and_then(|entry| {
            let usable = self.usable(&entry, now)?;
            (entry.class() != Class::ServFail).then_some((entry, usable))
        });
        let keep = match (&fetched, &held) {
            (_, None) => false,
            (Fetched::Failed, Some(_)) => true,
            (Fetched::Reply(reply), Some((entry, _))) => {
                fails(reply)
                    || (self.prefers_positive() && denies(reply) && entry.class() == Class::Success)
            }
        };
        match (fetched, held) {
            (_, Some((entry, usable))) if keep => {
                entry.refresh_failed(now, self.recheck());
                let (ttl, stale) = match usable {
                    Usable::Fresh { age, remaining } => (TtlRule::fresh(age, remaining), false),
                    Usable::Stale { ttl } => (TtlRule::stale(ttl), true),
                };
                Updated::Kept { entry, ttl, stale }
            }
            (Fetched::Failed, _) => Updated::Failed,
            (Fetched::Reply(reply), held) => match self.store(key, reply, now) {
                Stored::Entry(entry) => Updated::Stored(entry),
                Stored::NotCacheable(reply) => {
                    // The entry stays in place (a truncated reply, a denial without SOA, a TTL
                    // clamped to 0): it may be refreshed again at once.
                    if let Some((entry, _)) = held {
                        entry.release_refresh();
                    }
                    Updated::NotCacheable(reply, TtlRule::STORED)
                }
                Stored::Passed { reply, ttl } => {
                    if let Some((entry, _)) = held {
                        entry.release_refresh();
                    }
                    Updated::NotCacheable(reply, ttl)
                }
            },
        }
    }

    /// Whether a stale entry found at `now` is answered at once (and refreshed in the
    /// background) rather than after asking the upstream: in `immediate` mode; while the
    /// upstream is known to be down (`upstream_down`: RFC 8767 §5, no client waits for a fetch
    /// that will fail); and while a failed fetch's recheck period runs.
    pub fn stale_at_once(&self, entry: &Entry, upstream_down: bool, now: Instant) -> bool {
        let Some(stale) = self.policy().stale else {
            return false;
        };
        upstream_down || stale.refresh == Refresh::Immediate || entry.rechecking(now)
    }

    /// How long a client waits for the upstream's verdict on a stale entry before it is
    /// answered from it (the fetch goes on): `verify`'s timeout, if any.
    pub fn verify_timeout(&self) -> Option<Duration> {
        match self.policy().stale?.refresh {
            Refresh::Verify { timeout } => timeout,
            Refresh::Immediate => None,
        }
    }

    fn prefers_positive(&self) -> bool {
        self.policy().stale.is_some_and(|s| s.prefer_positive)
    }

    /// How long after a failure the entry is not fetched again in the background.
    fn recheck(&self) -> Duration {
        self.policy()
            .stale
            .map_or(MIN_RECHECK, |s| s.recheck.max(MIN_RECHECK))
    }
}

/// A reply that does not refresh the data (RFC 8767 §4): any RCODE but NOERROR and NXDOMAIN.
fn fails(reply: &Reply) -> bool {
    let rcode = reply.info().rcode;
    rcode != u16::from(rcode::NOERROR) && rcode != u16::from(rcode::NXDOMAIN)
}

/// A reply that says the name has no data of the type: NXDOMAIN, or NOERROR without an answer.
fn denies(reply: &Reply) -> bool {
    let info = reply.info();
    info.rcode == u16::from(rcode::NXDOMAIN)
        || (info.rcode == u16::from(rcode::NOERROR) && info.answers == 0)
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::ResponseCode;

    use super::*;
    use crate::testutil::{insert, nxdomain, reply, secs, servfail, stale, success};
    use crate::{Lookup, Policy, Stale};

    /// A cache with serve-stale for an hour (TTL 30 s) and `tune` applied to its stale policy.
    fn cache(tune: impl FnOnce(&mut Stale)) -> Cache {
        let mut stale = stale(secs(3600), 30);
        tune(&mut stale);
        Cache::new(Policy {
            stale: Some(stale),
            ..Policy::default()
        })
    }

    fn rcode(code: ResponseCode) -> Reply {
        reply("www.example.", code, &[], None, false)
    }

    /// A NOERROR reply without an answer, with an SOA: NODATA.
    fn nodata() -> Reply {
        reply(
            "www.example.",
            ResponseCode::NoError,
            &[],
            Some((60, 60)),
            false,
        )
    }

    /// `www.example.` cached at `t0` with TTL 60; returns the entry.
    fn cached(cache: &Cache, t0: Instant) -> Arc<Entry> {
        match cache.store(b"k", success(&[60]), t0) {
            Stored::Entry(entry) => entry,
            Stored::NotCacheable(_) | Stored::Passed { .. } => panic!("not cached"),
        }
    }

    fn kept(updated: Updated) -> (Arc<Entry>, TtlRule, bool) {
        match updated {
            Updated::Kept { entry, ttl, stale } => (entry, ttl, stale),
            other => panic!("the entry was not kept: {other:?}"),
        }
    }

    /// Every failure the upstream can answer with, and no answer at all.
    fn failures() -> Vec<(&'static str, Fetched)> {
        vec![
            ("SERVFAIL", Fetched::Reply(servfail())),
            ("REFUSED", Fetched::Reply(rcode(ResponseCode::Refused))),
            ("NOTIMP", Fetched::Reply(rcode(ResponseCode::NotImp))),
            ("FORMERR", Fetched::Reply(rcode(ResponseCode::FormErr))),
            ("no reply", Fetched::Failed),
        ]
    }

    #[test]
    fn a_failure_keeps_a_stale_entry_and_answers_from_it() {
        for (what, fetched) in failures() {
            let cache = cache(|_| {});
            let t0 = Instant::now();
            let held = cached(&cache, t0);
            let at = t0 + secs(600);
            let (entry, ttl, stale) = kept(cache.update(b"k", fetched, at));
            assert!(Arc::ptr_eq(&entry, &held), "{what}");
            assert_eq!((ttl, stale), (TtlRule::stale(30), true), "{what}");
            // Still there for the next query, still stale, not the failure.
            let Lookup::Stale { entry, .. } = cache.lookup(b"k", at + secs(1)) else {
                panic!("{what}: the stale entry is gone");
            };
            assert!(Arc::ptr_eq(&entry, &held), "{what}");
            assert_eq!(cache.stats().servfail, 0, "{what}: no SERVFAIL stored");
        }
    }

    #[test]
    fn a_failed_prefetch_leaves_the_fresh_entry_fresh() {
        for (what, fetched) in failures() {
            let cache = cache(|_| {});
            let t0 = Instant::now();
            let held = cached(&cache, t0);
            let (entry, ttl, stale) = kept(cache.update(b"k", fetched, t0 + secs(55)));
            assert!(Arc::ptr_eq(&entry, &held), "{what}");
            assert_eq!((ttl, stale), (TtlRule::fresh(55, 5), false), "{what}");
            assert!(
                matches!(cache.lookup(b"k", t0 + secs(56)), Lookup::Fresh { entry, .. } if Arc::ptr_eq(&entry, &held)),
                "{what}: not turned into the failure"
            );
        }
    }

    #[test]
    fn without_serve_stale_a_failure_still_keeps_a_fresh_entry() {
        let cache = Cache::new(Policy::default());
        let t0 = Instant::now();
        let held = cached(&cache, t0);
        let (entry, ..) = kept(cache.update(b"k", Fetched::Reply(servfail()), t0 + secs(50)));
        assert!(Arc::ptr_eq(&entry, &held));
        // Expired, nothing stale to give: the SERVFAIL is what there is, kept 5 s.
        assert!(matches!(
            cache.update(b"k", Fetched::Reply(servfail()), t0 + secs(61)),
            Updated::Stored(entry) if entry.class() == Class::ServFail
        ));
    }

    #[test]
    fn with_nothing_usable_held_failures_answer_as_they_came() {
        let cache = cache(|_| {});
        let t0 = Instant::now();
        assert!(matches!(
            cache.update(b"k", Fetched::Reply(servfail()), t0),
            Updated::Stored(entry) if entry.class() == Class::ServFail
        ));
        assert!(matches!(
            cache.update(b"r", Fetched::Reply(rcode(ResponseCode::Refused)), t0),
            Updated::NotCacheable(reply, _) if reply.info().rcode == 5
        ));
        assert!(matches!(
            cache.update(b"n", Fetched::Failed, t0),
            Updated::Failed
        ));
        // Past the window the stale entry is no more use than none.
        let cached = cached(&cache, t0);
        drop(cached);
        assert!(matches!(
            cache.update(b"k", Fetched::Failed, t0 + secs(60 + 3600)),
            Updated::Failed
        ));
    }

    #[test]
    fn a_held_servfail_is_replaced_by_the_next() {
        let cache = cache(|_| {});
        let t0 = Instant::now();
        insert(&cache, b"k", servfail(), t0);
        assert!(matches!(
            cache.update(b"k", Fetched::Reply(servfail()), t0 + secs(1)),
            Updated::Stored(entry) if entry.stored() == t0 + secs(1)
        ));
    }

    #[test]
    fn an_answer_refreshes_the_entry_denials_included() {
        for (what, fetched, class) in [
            ("NOERROR", success(&[300]), Class::Success),
            ("NXDOMAIN", nxdomain(Some((60, 60))), Class::Denial),
            ("NODATA", nodata(), Class::Denial),
        ] {
            let cache = cache(|_| {});
            let t0 = Instant::now();
            cached(&cache, t0);
            let Updated::Stored(entry) =
                cache.update(b"k", Fetched::Reply(fetched), t0 + secs(600))
            else {
                panic!("{what} not stored");
            };
            assert_eq!(entry.class(), class, "{what}");
        }
    }

    #[test]
    fn prefer_positive_keeps_the_last_good_answer_against_a_denial_inside_its_window() {
        let cache = cache(|s| s.prefer_positive = true);
        let t0 = Instant::now();
        let held = cached(&cache, t0);
        // Fresh: a prefetch that comes back NXDOMAIN leaves it fresh.
        let (entry, ttl, stale) = kept(cache.update(
            b"k",
            Fetched::Reply(nxdomain(Some((60, 60)))),
            t0 + secs(55),
        ));
        assert!(Arc::ptr_eq(&entry, &held));
        assert_eq!((ttl, stale), (TtlRule::fresh(55, 5), false));
        // Stale: NODATA is set aside as well.
        let (entry, ttl, stale) =
            kept(cache.update(b"k", Fetched::Reply(nodata()), t0 + secs(900)));
        assert!(Arc::ptr_eq(&entry, &held));
        assert_eq!((ttl, stale), (TtlRule::stale(30), true));
        // A positive answer replaces it.
        let newer = success(&[120]);
        assert!(matches!(
            cache.update(b"k", Fetched::Reply(newer), t0 + secs(1000)),
            Updated::Stored(entry) if entry.ttl() == 120
        ));
    }

    #[test]
    fn prefer_positive_gives_way_once_the_positive_entry_leaves_its_window() {
        let cache = cache(|s| s.prefer_positive = true);
        let t0 = Instant::now();
        cached(&cache, t0);
        assert!(matches!(
            cache.update(b"k", Fetched::Reply(nxdomain(Some((60, 60)))), t0 + secs(60 + 3600)),
            Updated::Stored(entry) if entry.class() == Class::Denial
        ));
    }

    #[test]
    fn prefer_positive_keeps_no_denial_against_a_denial() {
        let cache = cache(|s| s.prefer_positive = true);
        let t0 = Instant::now();
        insert(&cache, b"k", nxdomain(Some((60, 60))), t0);
        assert!(matches!(
            cache.update(b"k", Fetched::Reply(nodata()), t0 + secs(90)),
            Updated::Stored(entry) if entry.stored() == t0 + secs(90)
        ));
    }

    #[test]
    fn without_prefer_positive_a_denial_replaces_a_positive_entry() {
        let cache = cache(|_| {});
        let t0 = Instant::now();
        cached(&cache, t0);
        assert!(matches!(
            cache.update(b"k", Fetched::Reply(nxdomain(Some((60, 60)))), t0 + secs(30)),
            Updated::Stored(entry) if entry.class() == Class::Denial
        ));
    }

    #[test]
    fn a_failure_starts_the_recheck_period_during_which_the_entry_is_answered_at_once() {
        let cache = cache(|s| s.recheck = secs(30));
        let t0 = Instant::now();
        let held = cached(&cache, t0);
        let failed = t0 + secs(600);
        assert!(
            !cache.stale_at_once(&held, false, failed),
            "verify: ask first"
        );
        assert!(held.claim_refresh(failed));
        kept(cache.update(b"k", Fetched::Reply(servfail()), failed));
        for at in [failed, failed + secs(29)] {
            assert!(held.rechecking(at));
            assert!(cache.stale_at_once(&held, false, at), "recheck runs");
            assert!(!held.claim_refresh(at), "no refresh before the recheck");
        }
        let after = failed + secs(30);
        assert!(!held.rechecking(after));
        assert!(!cache.stale_at_once(&held, false, after));
        assert!(
            held.claim_refresh(after),
            "refreshed again after the recheck"
        );
    }

    #[test]
    fn with_no_recheck_a_failed_refresh_is_tried_again_a_second_later() {
        let cache = cache(|_| {});
        let t0 = Instant::now();
        let held = cached(&cache, t0);
        let at = t0 + secs(600);
        assert!(held.claim_refresh(at));
        assert!(!held.claim_refresh(at), "one under way at a time");
        kept(cache.update(b"k", Fetched::Failed, at));
        assert!(held.rechecking(at + Duration::from_millis(999)));
        assert!(!held.claim_refresh(at + Duration::from_millis(999)));
        assert!(held.claim_refresh(at + MIN_RECHECK));
        held.release_refresh();
        assert!(held.claim_refresh(at + MIN_RECHECK), "released: claimable");
        // Without serve-stale, a failed prefetch waits as long.
        let plain = Cache::new(Policy::default());
        let fresh = cached(&plain, t0);
        assert!(fresh.claim_refresh(t0 + secs(55)));
        kept(plain.update(b"k", Fetched::Failed, t0 + secs(55)));
        assert!(!fresh.claim_refresh(t0 + secs(55)));
        assert!(fresh.claim_refresh(t0 + secs(56)));
    }

    #[test]
    fn a_reply_that_is_not_kept_ends_the_refresh_of_the_entry_held() {
        let cache = cache(|_| {});
        let t0 = Instant::now();
        let held = cached(&cache, t0);
        let at = t0 + secs(600);
        assert!(held.claim_refresh(at));
        let truncated = reply("www.example.", ResponseCode::NoError, &[300], None, true);
        assert!(matches!(
            cache.update(b"k", Fetched::Reply(truncated), at),
            Updated::NotCacheable(..)
        ));
        assert!(held.claim_refresh(at));
    }

    #[test]
    fn stale_entries_are_answered_at_once_in_immediate_mode_or_while_the_upstream_is_down() {
        let t0 = Instant::now();
        let immediate = cache(|s| s.refresh = Refresh::Immediate);
        let entry = cached(&immediate, t0);
        assert!(immediate.stale_at_once(&entry, false, t0 + secs(600)));
        let verify = cache(|_| {});
        let entry = cached(&verify, t0);
        assert!(!verify.stale_at_once(&entry, false, t0 + secs(600)));
        assert!(verify.stale_at_once(&entry, true, t0 + secs(600)));
        let none = Cache::new(Policy::default());
        let entry = cached(&none, t0);
        assert!(!none.stale_at_once(&entry, true, t0 + secs(600)));
    }

    #[test]
    fn the_verify_timeout_is_the_policys() {
        let timeout = Some(Duration::from_millis(100));
        assert_eq!(
            cache(|s| s.refresh = Refresh::Verify { timeout }).verify_timeout(),
            timeout
        );
        assert_eq!(
            cache(|s| s.refresh = Refresh::Immediate).verify_timeout(),
            None
        );
        assert_eq!(Cache::new(Policy::default()).verify_timeout(), None);
    }
}
