//! Entries carried from one cache to another: out of the running instance's caches at an
//! upgrade, or into a snapshot at shutdown ([`Cache::export`]), and into the new instance's
//! ([`Cache::import`]). No I/O here: the agent moves the bytes (a pipe, a file) and hands them
//! back.
//!
//! What travels is what the new cache cannot work out itself: the key, the reply's bytes, how
//! long ago it was stored, and whether it was asked often (it was in S3-FIFO's main queue).
//! Everything else is decided again by the importing cache's own policy, as if the reply had
//! just come from the upstream, that long ago: its class, its lifetime, its stale window. The
//! bytes are untrusted (a file anyone who broke into the directory could write): each entry is
//! checked first ([`Carried::parse`]: its reply parsed again by [`Reply::parse`], answering its
//! key's question), so the caller can refuse a whole file before storing any of it, and must be
//! cacheable here. An entry carried never replaces one stored later.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nodedns_wire::{Key, Reply, ReplyError};

use crate::{Cache, Class, Entry};

/// One entry as [`Cache::export`] hands it out.
#[derive(Debug, Clone)]
pub struct Exported {
    pub key: Box<[u8]>,
    /// The entry itself: its reply's bytes are what travels.
    pub entry: Arc<Entry>,
    /// Time since it was stored, at the export's `now`.
    pub age: Duration,
    /// It was in the main queue: asked again after it was stored.
    pub hot: bool,
}

/// An entry from another cache, checked: its key well-formed and canonical, its reply parsed
/// again by [`Reply::parse`] and answering the key's question. [`Cache::import`] stores it.
#[derive(Debug, Clone)]
pub struct Carried {
    key: Key,
    reply: Reply,
    age: Duration,
    hot: bool,
}

/// Why an entry from another cache was refused ([`Carried::parse`], [`Cache::import`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("not a cache key in canonical form")]
    Key,
    #[error("reply: {0}")]
    Reply(#[source] ReplyError),
    #[error("the reply does not answer the key's question")]
    Question,
    #[error("not cacheable here")]
    NotCacheable,
    #[error("past its stale window")]
    Expired,
    #[error("older than this host's monotonic clock")]
    Clock,
    #[error("the cache holds a newer entry for the key")]
    Held,
}

impl Carried {
    /// Checks an entry another cache exported: `key` (as [`nodedns_wire::Key::as_bytes`] gives
    /// it), `reply` (the stored bytes), stored `age` ago, `hot` if it was asked often there.
    pub fn parse(key: &[u8], reply: &[u8], age: Duration, hot: bool) -> Result<Carried, Refused> {
        let canonical = Key::from_bytes(key).ok_or(Refused::Key)?;
        if canonical.as_bytes() != key {
            return Err(Refused::Key);
        }
        let reply = Reply::parse(reply).map_err(Refused::Reply)?;
        if !answers(&reply, &canonical) {
            return Err(Refused::Question);
        }
        Ok(Carried {
            key: canonical,
            reply,
            age,
            hot,
        })
    }

    pub fn key(&self) -> &Key {
        &self.key
    }
}

/// The walk [`Cache::export`] returns.
#[derive(Debug)]
pub struct Export<'a> {
    cache: &'a Cache,
    now: Instant,
    /// The main queues first (the entries worth most, in case the reader stops early), then
    /// the small ones.
    main: bool,
    shard: usize,
    batch: std::vec::IntoIter<(Box<[u8]>, Arc<Entry>)>,
}

impl Iterator for Export<'_> {
    type Item = Exported;

    fn next(&mut self) -> Option<Exported> {
        loop {
            for (key, entry) in self.batch.by_ref() {
                // SERVFAIL is kept seconds and is about the moment: it does not travel.
                if entry.class() == Class::ServFail || self.cache.usable(&entry, self.now).is_none()
                {
                    continue;
                }
                let age = self.now.saturating_duration_since(entry.stored());
                return Some(Exported {
                    key,
                    entry,
                    age,
                    hot: self.main,
                });
            }
            if self.shard == self.cache.shard_count() {
                if !self.main {
                    return None;
                }
                self.main = false;
                self.shard = 0;
            }
            self.batch = self.cache.shard_entries(self.shard, self.main).into_iter();
            self.shard += 1;
        }
    }
}

impl Cache {
    /// Every entry still usable at `now` (fresh, or stale inside the window), SERVFAIL
    /// excepted: those asked often first (each shard's main queue, oldest first), then the
    /// rest. Each step locks one shard for a copy of its keys and `Arc`s, never longer: the
    /// cache serves on while the caller writes them out.
    pub fn export(&self, now: Instant) -> Export<'_> {
        Export {
            cache: self,
            now,
            main: true,
            shard: 0,
            batch: Vec::new().into_iter(),
        }
    }

    /// Stores an entry another cache exported, `age` old at `now`, unless the key holds one
    /// stored later (what this cache fetched meanwhile is newer). It is kept as this cache's
    /// policy would keep its reply had it come from the upstream `age` ago; a `hot` entry goes
    /// straight to the main queue.
    pub fn import(&self, carried: Carried, now: Instant) -> Result<(), Refused> {
        let Carried {
            key,
            reply,
            age,
            hot,
        } = carried;
        let (class, ttl) = self.classify(&reply).ok_or(Refused::NotCacheable)?;
        if ttl == 0 || class == Class::ServFail {
            return Err(Refused::NotCacheable);
        }
        let stored = now.checked_sub(age).ok_or(Refused::Clock)?;
        let entry = Arc::new(Entry::new(reply, class, ttl, stored));
        if self.usable(&entry, now).is_none() {
            return Err(Refused::Expired);
        }
        if self.store_unless_newer(key.as_bytes(), entry, hot) {
            Ok(())
        } else {
            Err(Refused::Held)
        }
    }
}

/// Whether `reply`'s question is `key`'s: the name equal but for ASCII case (RFC 4343), type
/// and class equal.
fn answers(reply: &Reply, key: &Key) -> bool {
    let question = reply.question();
    let Some(split) = question.len().checked_sub(4) else {
        return false;
    };
    let (name, rest) = question.split_at(split);
    let (qtype, qclass) = (key.qtype().to_be_bytes(), key.qclass().to_be_bytes());
    name.eq_ignore_ascii_case(key.qname()) && rest[..2] == qtype && rest[2..] == qclass
}

#[cfg(test)]
mod tests {
    use hickory_proto::op::ResponseCode;
    use nodedns_wire::TtlRule;

    use super::*;
    use crate::testutil::{insert, nxdomain, reply, secs, servfail, stale, success};
    use crate::{Clamp, Lookup, Policy};

    /// The key of `www.example.` A IN, as the agent files it.
    fn key(name: &str) -> Vec<u8> {
        let mut wire = Vec::new();
        for label in name.trim_end_matches('.').split('.') {
            wire.push(label.len() as u8);
            wire.extend_from_slice(label.as_bytes());
        }
        wire.push(0);
        Key::new(&wire, 1, 1, false, false)
            .unwrap()
            .as_bytes()
            .to_vec()
    }

    fn serving_stale() -> Cache {
        Cache::new(Policy {
            stale: Some(stale(secs(3600), 30)),
            ..Policy::default()
        })
    }

    fn import(cache: &Cache, e: &Exported, now: Instant) -> Result<(), Refused> {
        let carried = Carried::parse(&e.key, e.entry.reply().bytes(), e.age, e.hot)?;
        cache.import(carried, now)
    }

    fn carry(from: &Cache, to: &Cache, now: Instant) -> usize {
        from.export(now)
            .filter(|e| import(to, e, now).is_ok())
            .count()
    }

    #[test]
    fn usable_entries_carry_over_with_their_age_and_stale_ones_stay_stale() {
        let (old, new) = (serving_stale(), serving_stale());
        let t0 = Instant::now();
        let (www, nx, gone, fail) = (
            key("www.example."),
            key("nx.example."),
            key("gone.example."),
            key("fail.example."),
        );
        insert(&old, &www, success(&[300]), t0);
        insert(&old, &nx, nxdomain(Some((60, 60))), t0 + secs(100));
        insert(
            &old,
            &gone,
            reply("gone.example.", ResponseCode::NoError, &[5], None, false),
            t0,
        );
        insert(
            &old,
            &fail,
            reply("fail.example.", ResponseCode::ServFail, &[], None, false),
            t0 + secs(199),
        );
        let now = t0 + secs(200);
        // `gone` expired 195 s ago: still in its stale window, it travels. SERVFAIL does not.
        assert_eq!(carry(&old, &new, now), 3);
        let Lookup::Fresh { ttl, entry, .. } = new.lookup(&www, now) else {
            panic!("www not fresh");
        };
        assert_eq!(ttl, TtlRule::fresh(200, 100), "the age came along");
        assert_eq!(entry.reply().bytes(), success(&[300]).bytes());
        assert!(
            matches!(new.lookup(&nx, now), Lookup::Stale { .. }),
            "nx expired at 160 s"
        );
        assert!(matches!(new.lookup(&gone, now), Lookup::Stale { .. }));
        assert!(matches!(new.lookup(&fail, now), Lookup::Miss));
        // Past the window an entry is left behind.
        let empty = serving_stale();
        assert_eq!(
            carry(&old, &empty, t0 + secs(160 + 3600)),
            1,
            "only www is left"
        );
    }

    #[test]
    fn the_importing_policy_decides_the_lifetime() {
        let old = Cache::new(Policy::default());
        let short = Cache::new(Policy {
            success: Clamp { min: 5, max: 30 },
            ..Policy::default()
        });
        let t0 = Instant::now();
        let www = key("www.example.");
        insert(&old, &www, success(&[300]), t0);
        assert_eq!(carry(&old, &short, t0 + secs(10)), 1);
        let Lookup::Fresh { entry, ttl, .. } = short.lookup(&www, t0 + secs(10)) else {
            panic!("not fresh");
        };
        assert_eq!((entry.ttl(), ttl), (30, TtlRule::fresh(10, 20)));
        // Without serve-stale here, an entry expired there stays behind.
        assert_eq!(
            carry(&old, &Cache::new(Policy::default()), t0 + secs(301)),
            0
        );
    }

    #[test]
    fn hot_entries_come_first_and_land_in_the_main_queue() {
        // One shard, so the order is the queues' order.
        let policy = Policy {
            capacity_bytes: 64 * 1024,
            ..Policy::default()
        };
        let (old, new) = (Cache::new(policy.clone()), Cache::new(policy));
        let t0 = Instant::now();
        let names: Vec<Vec<u8>> = (0..40).map(|i| key(&format!("n{i}.example."))).collect();
        for (i, k) in names.iter().enumerate() {
            let name = format!("n{i}.example.");
            insert(
                &old,
                k,
                reply(&name, ResponseCode::NoError, &[300], None, false),
                t0,
            );
        }
        // n7 is asked again, then enough new names arrive that small's head moves on: n7 goes
        // to main.
        old.lookup(&names[7], t0);
        for i in 40..200 {
            let (k, name) = (key(&format!("n{i}.example.")), format!("n{i}.example."));
            insert(
                &old,
                &k,
                reply(&name, ResponseCode::NoError, &[300], None, false),
                t0,
            );
        }
        let exported: Vec<Exported> = old.export(t0).collect();
        assert_eq!(exported[0].key.as_ref(), names[7].as_slice());
        assert!(exported[0].hot && exported[1..].iter().all(|e| !e.hot));
        carry(&old, &new, t0);
        assert!(
            new.shard_entries(0, true)
                .iter()
                .any(|(k, _)| k.as_ref() == names[7].as_slice()),
            "n7 is in the new cache's main queue"
        );
    }

    #[test]
    fn an_older_entry_held_is_replaced_by_a_newer_one_carried() {
        // A take-back: the idle instance's cache is older than the one handed back.
        let (older, newer) = (Cache::new(Policy::default()), Cache::new(Policy::default()));
        let t0 = Instant::now();
        let www = key("www.example.");
        insert(&older, &www, success(&[60]), t0);
        insert(&newer, &www, success(&[300]), t0 + secs(30));
        assert_eq!(carry(&newer, &older, t0 + secs(40)), 1);
        assert!(
            matches!(older.lookup(&www, t0 + secs(40)), Lookup::Fresh { entry, .. } if entry.ttl() == 300)
        );
    }

    #[test]
    fn what_the_cache_holds_already_is_not_replaced() {
        let (old, new) = (Cache::new(Policy::default()), Cache::new(Policy::default()));
        let t0 = Instant::now();
        let www = key("www.example.");
        insert(&old, &www, success(&[300]), t0);
        insert(&new, &www, success(&[60]), t0 + secs(5));
        let e = old.export(t0 + secs(5)).next().unwrap();
        assert_eq!(import(&new, &e, t0 + secs(5)), Err(Refused::Held));
        assert!(
            matches!(new.lookup(&www, t0 + secs(5)), Lookup::Fresh { entry, .. } if entry.ttl() == 60)
        );
    }

    fn refused_by(
        cache: &Cache,
        key: &[u8],
        reply: &[u8],
        age: Duration,
        now: Instant,
    ) -> Result<(), Refused> {
        cache.import(Carried::parse(key, reply, age, false)?, now)
    }

    #[test]
    fn entries_that_are_not_what_they_claim_are_refused() {
        let cache = serving_stale();
        let now = Instant::now();
        let www = key("www.example.");
        let good = success(&[300]);
        let bytes = good.bytes();
        let refused = |key: &[u8], reply: &[u8], age| {
            cache.import(Carried::parse(key, reply, age, false)?, now)
        };
        let mut upper = www.clone();
        upper[1] = b'W';
        assert_eq!(
            refused(&upper, bytes, secs(1)),
            Err(Refused::Key),
            "not lowercased"
        );
        assert_eq!(refused(b"\x03www", bytes, secs(1)), Err(Refused::Key));
        let mut bad_flags = www.clone();
        *bad_flags.last_mut().unwrap() = 0x80;
        assert_eq!(refused(&bad_flags, bytes, secs(1)), Err(Refused::Key));
        assert!(matches!(
            refused(&www, &bytes[..20], secs(1)),
            Err(Refused::Reply(_))
        ));
        assert!(matches!(
            refused(&www, b"", secs(1)),
            Err(Refused::Reply(_))
        ));
        let other = reply("evil.example.", ResponseCode::NoError, &[300], None, false);
        assert_eq!(
            refused(&www, other.bytes(), secs(1)),
            Err(Refused::Question),
            "another name"
        );
        let mut aaaa = www.clone();
        let n = aaaa.len();
        aaaa[n - 4] = 28;
        assert_eq!(
            refused(&aaaa, bytes, secs(1)),
            Err(Refused::Question),
            "another type"
        );
        let mut chaos = www.clone();
        chaos[n - 2] = 3;
        assert_eq!(
            refused(&chaos, bytes, secs(1)),
            Err(Refused::Question),
            "another class"
        );
        let mut shouting = reply("WWW.Example.", ResponseCode::NoError, &[300], None, false);
        assert_eq!(
            refused(&www, shouting.bytes(), secs(1)),
            Ok(()),
            "case does not matter"
        );
        shouting = servfail();
        let fresh = serving_stale();
        assert_eq!(
            refused_by(&fresh, &www, shouting.bytes(), secs(1), now),
            Err(Refused::NotCacheable)
        );
        let refused_rcode = reply("www.example.", ResponseCode::Refused, &[300], None, false);
        assert_eq!(
            refused_by(&fresh, &www, refused_rcode.bytes(), secs(1), now),
            Err(Refused::NotCacheable)
        );
        assert_eq!(
            refused_by(&fresh, &www, bytes, secs(300 + 3600), now),
            Err(Refused::Expired)
        );
        assert_eq!(
            refused_by(&fresh, &www, bytes, Duration::MAX, now),
            Err(Refused::Clock)
        );
        assert_eq!(fresh.stats().success, 0);
    }

    proptest::proptest! {
        /// Whatever the bytes, an import never panics, and what it stores answers its own key.
        #[test]
        fn imports_of_any_bytes_store_only_what_answers_the_key(
            key in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
            reply in proptest::collection::vec(proptest::num::u8::ANY, 0..200),
            age in 0u64..100_000,
        ) {
            let cache = serving_stale();
            let now = Instant::now();
            let carried = Carried::parse(&key, &reply, Duration::from_millis(age), false);
            if carried.and_then(|c| cache.import(c, now)).is_ok() {
                let Some(entry) = cache.peek(&key) else {
                    return Err(proptest::test_runner::TestCaseError::fail("stored, not found"));
                };
                proptest::prop_assert!(answers(entry.reply(), &Key::from_bytes(&key).unwrap()));
            }
        }
    }
}
