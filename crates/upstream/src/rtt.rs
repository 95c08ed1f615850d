//! How long an upstream usually takes to answer, and so how long an exchange may stay silent
//! before the query is sent again elsewhere (a hedge).
//!
//! The estimator is TCP's retransmission timer (RFC 6298 §2): a smoothed round-trip time and its
//! mean deviation, updated with every accepted reply, and a timeout of SRTT + 4·RTTVAR. It lives
//! in one atomic word per address (no lock on the query path); two replies updating it at the
//! same moment may lose one sample, which an estimator can afford.
//!
//! The timeout never goes below [`MIN_HEDGE`]. CoreDNS once had an adaptive read timeout with a
//! 10 ms and then a 200 ms floor and removed it (coredns#1889, #2319): with cached and uncached
//! answers mixed, a timeout from the average closed connections to a server that was merely
//! slow for one query. A hedge closes nothing: the silent exchange keeps waiting beside the new
//! one and the first reply wins, so a floor well under what a client notices is affordable.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The shortest silence after which a query is sent again elsewhere. Far above a round trip
/// inside a cluster (well under a millisecond), far below a stub resolver's patience; what a
/// slow answer costs at worst is one duplicate query.
pub(crate) const MIN_HEDGE: Duration = Duration::from_millis(50);

/// The shortest [`Rtt::hedge_after`] under `cap`, whatever has been measured.
pub(crate) fn shortest_hedge(cap: Duration) -> Duration {
    MIN_HEDGE.min(cap)
}

/// The timeout before the first reply has been measured (RFC 6298 says 1 s for TCP; a DNS
/// server that takes longer than this to answer a new connection's first query is rare).
pub(crate) const INITIAL_HEDGE: Duration = Duration::from_millis(200);

/// SRTT (high 32 bits) and RTTVAR (low 32 bits), in microseconds; 0: no sample yet.
#[derive(Debug, Default)]
pub(crate) struct Rtt(AtomicU64);

impl Rtt {
    /// One accepted reply, `took` after its exchange began.
    pub(crate) fn sample(&self, took: Duration) {
        // At least 1 µs, so that a first sample is never mistaken for "no sample".
        let r = u64::try_from(took.as_micros())
            .unwrap_or(u64::MAX)
            .clamp(1, u64::from(u32::MAX));
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                let (srtt, rttvar) = (word >> 32, word & u64::from(u32::MAX));
                let (srtt, rttvar) = if word == 0 {
                    // RFC 6298 §2.2.
                    (r, r / 2)
                } else {
                    // RFC 6298 §2.3, with alpha = 1/8 and beta = 1/4.
                    let rttvar = (3 * rttvar + srtt.abs_diff(r)) / 4;
                    let srtt = (7 * srtt + r) / 8;
                    (srtt.max(1), rttvar)
                };
                Some(srtt << 32 | rttvar)
            });
    }

    /// How long an exchange may stay silent before the query is hedged: SRTT + 4·RTTVAR
    /// (RFC 6298 §2.3), at least [`MIN_HEDGE`], at most `cap` (the per-attempt read timeout:
    /// beyond it the exchange has failed anyway). Never shorter than [`shortest_hedge`].
    pub(crate) fn hedge_after(&self, cap: Duration) -> Duration {
        let word = self.0.load(Ordering::Relaxed);
        let timeout = if word == 0 {
            INITIAL_HEDGE
        } else {
            let (srtt, rttvar) = (word >> 32, word & u64::from(u32::MAX));
            Duration::from_micros(srtt + 4 * rttvar)
        };
        timeout.clamp(shortest_hedge(cap), cap)
    }

    /// The smoothed round-trip time, if measured (tests).
    #[cfg(test)]
    pub(crate) fn srtt(&self) -> Option<Duration> {
        let word = self.0.load(Ordering::Relaxed);
        (word != 0).then(|| Duration::from_micros(word >> 32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAP: Duration = Duration::from_secs(2);

    #[test]
    fn before_any_reply_the_initial_timeout_applies() {
        assert_eq!(Rtt::default().hedge_after(CAP), INITIAL_HEDGE);
        assert_eq!(Rtt::default().srtt(), None);
    }

    #[test]
    fn the_first_sample_sets_srtt_and_half_of_it_as_variance() {
        let rtt = Rtt::default();
        rtt.sample(Duration::from_millis(40));
        assert_eq!(rtt.srtt(), Some(Duration::from_millis(40)));
        // 40 + 4 × 20 ms.
        assert_eq!(rtt.hedge_after(CAP), Duration::from_millis(120));
    }

    #[test]
    fn steady_fast_replies_bring_the_timeout_down_to_the_floor() {
        let rtt = Rtt::default();
        for _ in 0..100 {
            rtt.sample(Duration::from_micros(300));
        }
        assert_eq!(rtt.srtt(), Some(Duration::from_micros(300)));
        assert_eq!(rtt.hedge_after(CAP), MIN_HEDGE);
    }

    #[test]
    fn a_slow_upstream_gets_a_longer_timeout_up_to_the_cap() {
        let rtt = Rtt::default();
        for _ in 0..50 {
            rtt.sample(Duration::from_millis(150));
        }
        let steady = rtt.hedge_after(CAP);
        assert!(
            steady >= Duration::from_millis(150) && steady < Duration::from_millis(200),
            "{steady:?}"
        );
        // Alternating fast and very slow answers: a wide deviation, a timeout above both.
        for i in 0..50 {
            rtt.sample(Duration::from_millis(if i % 2 == 0 { 1 } else { 900 }));
        }
        assert!(rtt.hedge_after(CAP) > Duration::from_millis(900));
        assert_eq!(
            rtt.hedge_after(Duration::from_millis(700)),
            Duration::from_millis(700)
        );
    }

    #[test]
    fn samples_follow_rfc_6298() {
        let rtt = Rtt::default();
        rtt.sample(Duration::from_millis(100));
        rtt.sample(Duration::from_millis(20));
        // RTTVAR = 3/4 × 50 + 1/4 × |100 − 20| = 57.5; SRTT = 7/8 × 100 + 1/8 × 20 = 90.
        assert_eq!(rtt.srtt(), Some(Duration::from_millis(90)));
        assert_eq!(rtt.hedge_after(CAP), Duration::from_millis(90 + 230));
    }
}
