//! The cache carried between two instances' snapshots in one process: through a stream as at a
//! hand-over, through the file as across a restart, and what a broken or hostile file or
//! stream gets. (Two processes and real traffic: integration/tests/suite/reliability_warm.rs.)

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::{AtomicU64, Ordering};

use nodedns_cache::{Lookup, Policy, Refresh, Stale, Stored};
use nodedns_wire::{Key, Reply, TtlRule};

use super::*;
use crate::config::{Config, Forward};
use crate::metrics::Metrics;

/// A directory removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "nodedns-warm-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700)).unwrap();
        Dir(path)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A block for `zone` on `listen`, with serve-stale (1 h), forwarding to the discard port.
fn block(zone: &str, listen: u16) -> Server {
    Server {
        zones: vec![zone.to_owned()],
        listen: vec![SocketAddr::from((Ipv4Addr::LOCALHOST, listen))],
        cache: Some(Policy {
            stale: Some(Stale {
                window: Duration::from_secs(3600),
                ttl: 30,
                refresh: Refresh::Verify { timeout: None },
                recheck: Duration::from_secs(5),
                prefer_positive: false,
            }),
            ..Policy::default()
        }),
        forwards: vec![Forward {
            from: zone.to_owned(),
            except: Vec::new(),
            next: Vec::new(),
            upstream: nodedns_upstream::Config {
                addrs: vec![SocketAddr::from((Ipv4Addr::LOCALHOST, 9))],
                ..Default::default()
            },
        }],
        log: Vec::new(),
        errors: false,
        loop_check: false,
        dnstap: Vec::new(),
        chain: Default::default(),
        scheme: Default::default(),
        tls: None,
    }
}

/// A snapshot of these blocks (inside a runtime: the upstream pools spawn their tasks).
fn snapshot(servers: Vec<Server>) -> Snapshot {
    let upstream_metrics =
        nodedns_upstream::Metrics::register(&mut prometheus_client::registry::Registry::default());
    let config = Arc::new(Config {
        servers,
        ..Config::default()
    });
    let taps = crate::dnstap::Metrics::default();
    Snapshot::build(
        config,
        None,
        &upstream_metrics,
        &Default::default(),
        &Metrics::default(),
        &taps,
    )
    .unwrap()
}

fn cache(snapshot: &Snapshot, block: usize) -> &Arc<Cache> {
    snapshot.zones[block].cache.as_ref().unwrap()
}

/// `name` in wire form.
fn wire(name: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for label in name.trim_end_matches('.').split('.') {
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out
}

fn key(name: &str) -> Key {
    Key::new(&wire(name), 1, 1, false, false).unwrap()
}

/// An upstream reply to `name` A: one record `ip` with `ttl`.
fn reply(name: &str, ip: Ipv4Addr, ttl: u32) -> Reply {
    let mut r = vec![0x12, 0x34, 0x81, 0x80, 0, 1, 0, 1, 0, 0, 0, 0];
    r.extend_from_slice(&wire(name));
    r.extend_from_slice(&[0, 1, 0, 1, 0xc0, 12, 0, 1, 0, 1]);
    r.extend_from_slice(&ttl.to_be_bytes());
    r.extend_from_slice(&[0, 4]);
    r.extend_from_slice(&ip.octets());
    Reply::parse(&r).unwrap()
}

/// Fills `cache` with `n` names `n<i>.<zone>`, stored `age` ago, TTL 300.
fn fill(cache: &Cache, zone: &str, n: u8, age: Duration) {
    let stored = Instant::now() - age;
    for i in 0..n {
        let name = format!("n{i}.{zone}");
        let stored_as = cache.store(
            key(&name).as_bytes(),
            reply(&name, Ipv4Addr::new(10, 0, 0, i), 300),
            stored,
        );
        assert!(matches!(stored_as, Stored::Entry(_)));
    }
}

/// The TTL rule `cache` answers `name` with at `now`, and whether it is fresh.
fn answer(cache: &Cache, name: &str, now: Instant) -> Option<(TtlRule, bool)> {
    match cache.lookup(key(name).as_bytes(), now) {
        Lookup::Fresh { ttl, .. } => Some((ttl, true)),
        Lookup::Stale { ttl, .. } => Some((ttl, false)),
        Lookup::Miss => None,
    }
}

/// The old instance's side in a thread, the new one's here: what arrived.
fn through_a_stream(from: Arc<Snapshot>, to: &Snapshot) -> (io::Result<Written>, Received) {
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let sending = std::thread::spawn(move || send(OwnedFd::from(ours), &from));
    let received = receive(OwnedFd::from(theirs), to);
    (sending.join().unwrap(), received)
}

#[tokio::test]
async fn a_cache_carried_through_the_stream_keeps_every_entrys_age_and_state() {
    let old = Arc::new(snapshot(vec![block("cluster.local.", 53)]));
    let new = snapshot(vec![block("cluster.local.", 53)]);
    fill(
        cache(&old, 0),
        "cluster.local.",
        100,
        Duration::from_secs(100),
    );
    // Expired 100 s ago: stale, inside the window.
    fill(
        cache(&old, 0),
        "stale.cluster.local.",
        20,
        Duration::from_secs(400),
    );
    let (written, received) = through_a_stream(old.clone(), &new);
    let written = written.unwrap();
    assert_eq!(received.ended, Ok(()));
    assert_eq!(written.entries, 120);
    assert_eq!(received.loaded.stored, 120);
    assert_eq!(received.loaded.bytes, written.bytes);
    let now = Instant::now();
    for i in 0..100 {
        let (ttl, fresh) = answer(cache(&new, 0), &format!("n{i}.cluster.local."), now)
            .unwrap_or_else(|| panic!("n{i} did not arrive"));
        assert!(fresh);
        assert!(
            (100..=101).contains(&ttl.age),
            "the age came along: {ttl:?}"
        );
        assert_eq!(ttl.age + ttl.cap, 300);
    }
    for i in 0..20 {
        let (ttl, fresh) = answer(cache(&new, 0), &format!("n{i}.stale.cluster.local."), now)
            .unwrap_or_else(|| panic!("stale n{i} did not arrive"));
        assert!(!fresh, "stale there, stale here");
        assert_eq!(ttl, TtlRule::stale(30));
    }
}

#[tokio::test]
async fn entries_go_to_the_block_of_the_same_zones_addresses_and_upstreams_only() {
    let old = Arc::new(snapshot(vec![block("cluster.local.", 53), block(".", 53)]));
    fill(cache(&old, 0), "cluster.local.", 10, Duration::ZERO);
    fill(cache(&old, 1), "example.", 5, Duration::ZERO);
    // The new configuration kept the cluster block, and moved `.` to another port.
    let new = snapshot(vec![block("cluster.local.", 53), block(".", 5353)]);
    let (_, received) = through_a_stream(old, &new);
    assert_eq!(received.ended, Ok(()));
    assert_eq!((received.loaded.stored, received.loaded.unmatched), (10, 5));
    assert_eq!(cache(&new, 0).stats().success, 10);
    assert_eq!(cache(&new, 1).stats().success, 0);
}

#[tokio::test]
async fn what_the_new_instance_fetched_meanwhile_is_kept() {
    let old = Arc::new(snapshot(vec![block("cluster.local.", 53)]));
    let new = snapshot(vec![block("cluster.local.", 53)]);
    fill(cache(&old, 0), "cluster.local.", 3, Duration::from_secs(10));
    let name = "n1.cluster.local.";
    let fetched = reply(name, Ipv4Addr::new(10, 9, 9, 9), 60);
    cache(&new, 0).store(key(name).as_bytes(), fetched, Instant::now());
    let (_, received) = through_a_stream(old, &new);
    assert_eq!((received.loaded.stored, received.loaded.refused), (2, 1));
    let Lookup::Fresh { entry, .. } = cache(&new, 0).lookup(key(name).as_bytes(), Instant::now())
    else {
        panic!("n1 missing");
    };
    assert!(entry.reply().bytes().ends_with(&[10, 9, 9, 9]));
}

#[tokio::test]
async fn a_stream_cut_short_keeps_the_entries_that_came_whole() {
    let old = snapshot(vec![block("cluster.local.", 53)]);
    let new = snapshot(vec![block("cluster.local.", 53)]);
    fill(cache(&old, 0), "cluster.local.", 50, Duration::ZERO);
    let mut bytes = Vec::new();
    encode(&old, Instant::now(), u64::MAX, &mut bytes).unwrap();
    // The writer died in the middle of the 31st entry or so.
    let cut = bytes.len() * 6 / 10;
    let (mut ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    ours.write_all(&bytes[..cut]).unwrap();
    drop(ours);
    let received = receive(OwnedFd::from(theirs), &new);
    assert_eq!(
        received.ended.as_ref().map_err(String::as_str),
        Err("the stream ended before the end record")
    );
    let stored = received.loaded.stored;
    assert!(stored > 20 && stored < 50, "{stored}");
    assert_eq!(cache(&new, 0).stats().success, stored);
}

#[tokio::test]
async fn a_stream_closed_unwritten_is_no_cache_not_a_broken_one() {
    // What an instance with --no-cache-handover does with the stream it is given.
    let new = snapshot(vec![block("cluster.local.", 53)]);
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    drop(ours);
    let received = receive(OwnedFd::from(theirs), &new);
    assert_eq!(received.loaded, Loaded::default());
    assert!(
        received
            .ended
            .as_ref()
            .unwrap_err()
            .contains("closed empty"),
        "{:?}",
        received.ended
    );
}

#[tokio::test]
async fn a_stream_of_garbage_stores_nothing() {
    let new = snapshot(vec![block("cluster.local.", 53)]);
    let (mut ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    ours.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    drop(ours);
    let received = receive(OwnedFd::from(theirs), &new);
    assert!(received.ended.unwrap_err().contains("no magic"));
    assert_eq!(received.loaded.stored, 0);
}

#[tokio::test]
async fn the_snapshot_file_is_private_and_loads_back() {
    let dir = Dir::new();
    let old = snapshot(vec![block("cluster.local.", 53)]);
    fill(
        cache(&old, 0),
        "cluster.local.",
        200,
        Duration::from_secs(30),
    );
    let written = save(&dir.0, &old).unwrap();
    assert_eq!(written.entries, 200);
    let meta = std::fs::metadata(path(&dir.0)).unwrap();
    assert_eq!(meta.mode() & 0o777, 0o600);
    assert_eq!(meta.len(), written.bytes);
    let names: Vec<_> = std::fs::read_dir(&dir.0).unwrap().collect();
    assert_eq!(names.len(), 1, "no partial file left: {names:?}");

    let new = snapshot(vec![block("cluster.local.", 53)]);
    let loaded = load(&dir.0, &new, Duration::from_secs(600))
        .unwrap()
        .unwrap();
    assert_eq!((loaded.stored, loaded.refused), (200, 0));
    assert!(loaded.age < Duration::from_secs(5));
    let (ttl, fresh) = answer(cache(&new, 0), "n7.cluster.local.", Instant::now()).unwrap();
    assert!(fresh && (30..=31).contains(&ttl.age), "{ttl:?}");
    // No file: nothing to do, not an error.
    std::fs::remove_file(path(&dir.0)).unwrap();
    assert!(
        load(&dir.0, &new, Duration::from_secs(600))
            .unwrap()
            .is_none()
    );
}

/// A saved file of a few entries, its bytes, and a fresh snapshot to load it into.
async fn saved() -> (Dir, Vec<u8>, Snapshot) {
    let dir = Dir::new();
    let old = snapshot(vec![block("cluster.local.", 53)]);
    fill(cache(&old, 0), "cluster.local.", 5, Duration::ZERO);
    save(&dir.0, &old).unwrap();
    let bytes = std::fs::read(path(&dir.0)).unwrap();
    (dir, bytes, snapshot(vec![block("cluster.local.", 53)]))
}

/// `bytes` with their header's time moved `by` into the past (or the future), checksum fixed.
fn written_at(bytes: &[u8], past: bool, by: Duration) -> Vec<u8> {
    let now = SystemTime::now();
    let at = if past { now - by } else { now + by };
    let ms = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut out = format::header(ms).to_vec();
    out.extend_from_slice(&bytes[format::HEADER_LEN..]);
    out
}

/// Records re-encoded with `edit` applied to every entry (checksums valid): what only someone
/// who writes the file on purpose produces.
fn forged(bytes: &[u8], edit: impl Fn(&[u8], &[u8]) -> (Vec<u8>, Vec<u8>)) -> Vec<u8> {
    let mut out = bytes[..format::HEADER_LEN].to_vec();
    let mut at = format::HEADER_LEN;
    while let Ok(Some((record, used))) = format::read_record(&bytes[at..]) {
        match record {
            Record::Entry {
                age,
                hot,
                key,
                reply,
            } => {
                let (key, reply) = edit(key, reply);
                format::write_record(
                    &mut out,
                    &Record::Entry {
                        age,
                        hot,
                        key: &key,
                        reply: &reply,
                    },
                );
            }
            other => format::write_record(&mut out, &other),
        }
        at += used;
    }
    out
}

#[tokio::test]
async fn a_corrupt_or_hostile_snapshot_loads_nothing_and_says_why() {
    let (dir, good, new) = saved().await;
    let max = Duration::from_secs(600);
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x10;
    let mut trailing = good.clone();
    trailing.extend_from_slice(b"more");
    let mut version = format::header(0).to_vec();
    version[15] = 9;
    let crc = format::crc32(&version[..24]);
    version[24..].copy_from_slice(&crc.to_be_bytes());
    version.extend_from_slice(&good[format::HEADER_LEN..]);
    let other_name = reply("evil.example.", Ipv4Addr::new(6, 6, 6, 6), 300);
    let poisoned = forged(&good, |key, _| (key.to_vec(), other_name.bytes().to_vec()));
    let uppercase = forged(&good, |key, reply| {
        let mut key = key.to_vec();
        key[1] = key[1].to_ascii_uppercase();
        (key, reply.to_vec())
    });
    let garbage_reply = forged(&good, |key, _| (key.to_vec(), b"\x12\x34".to_vec()));
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("a flipped bit", flipped, "checksum mismatch"),
        ("cut short", good[..good.len() - 3].to_vec(), "cut short"),
        (
            "bytes after the end",
            trailing,
            "bytes after the end record",
        ),
        ("empty", Vec::new(), "shorter than the header"),
        (
            "another program's file",
            b"{\"not\": \"ours\"}".to_vec(),
            "no magic",
        ),
        ("another layout", version, "layout version 9"),
        (
            "too old",
            written_at(&good, true, Duration::from_secs(3600)),
            "longer than",
        ),
        (
            "from the future",
            written_at(&good, false, Duration::from_secs(3600)),
            "in the future",
        ),
        (
            "an answer for another name",
            poisoned,
            "does not answer the key's question",
        ),
        ("a key not in canonical form", uppercase, "canonical form"),
        (
            "a reply that does not parse",
            garbage_reply,
            "entry 0: reply",
        ),
    ];
    for (what, bytes, why) in cases {
        std::fs::write(path(&dir.0), &bytes).unwrap();
        std::fs::set_permissions(path(&dir.0), std::fs::Permissions::from_mode(0o600)).unwrap();
        let err = load(&dir.0, &new, max).expect_err(what);
        assert!(err.to_string().contains(why), "{what}: {err}");
        assert_eq!(
            cache(&new, 0).stats().success,
            0,
            "{what}: something was stored"
        );
    }

    // The file itself: readable by others, a link, too large.
    std::fs::write(path(&dir.0), &good).unwrap();
    std::fs::set_permissions(path(&dir.0), std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = load(&dir.0, &new, max).unwrap_err();
    assert!(err.to_string().contains("mode 0644"), "{err}");
    std::fs::remove_file(path(&dir.0)).unwrap();
    let elsewhere = dir.0.join("elsewhere");
    std::fs::write(&elsewhere, &good).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&elsewhere, path(&dir.0)).unwrap();
    let err = load(&dir.0, &new, max).unwrap_err();
    assert!(
        matches!(err, Refusal::Io(_)),
        "a symbolic link is not followed: {err}"
    );
    std::fs::remove_file(path(&dir.0)).unwrap();
    let small = snapshot(vec![Server {
        cache: Some(Policy {
            capacity_bytes: 1024,
            ..Policy::default()
        }),
        ..block("cluster.local.", 53)
    }]);
    let mut huge = good.clone();
    huge.resize((2 << 20) + 5000, 0);
    std::fs::write(path(&dir.0), &huge).unwrap();
    std::fs::set_permissions(path(&dir.0), std::fs::Permissions::from_mode(0o600)).unwrap();
    let err = load(&dir.0, &small, max).unwrap_err();
    assert!(matches!(err, Refusal::TooLarge { .. }), "{err}");
    // And the good file, as it was, loads.
    std::fs::write(path(&dir.0), &good).unwrap();
    assert_eq!(load(&dir.0, &new, max).unwrap().unwrap().stored, 5);
}
