//! Warm upgrades and restarts: the cache goes to the new instance after the listening sockets
//! (`--handoff-dir`), and across a plain restart through the snapshot file the last instance
//! writes there at exit. Names cached before are answered after without an upstream query, and
//! with the upstream stopped; a corrupt snapshot is logged and ignored; under a steady hot mix
//! an upgrade costs the upstream at most 5 % more queries in the minute after it.
//!
//! Real parts: the `nodedns` binary (two processes), kernel sockets, the snapshot file; the
//! upstream is the scripted one, which counts every query per name and can be stopped outright.

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use nix::sys::signal::Signal;
use nodedns_integration::scripted::{Action, Scripted};
use nodedns_integration::{Process, TempDir, client};

use crate::reliability_support::{Load, free_addr, runtime, spawn_agent, wait_for_line};
use crate::reliability_upgrade::{
    HANDED_OVER, NOT_LAST, RESUMED, TOOK_OVER, handoff_args, start_first,
};

/// What the new instance logs once the cache the old one streamed is stored.
const LOADED_STREAM: &str = "loaded the cache of the instance that handed over";
/// What the old instance logs once it has written its cache into the stream.
const SENT: &str = "sent the cache to the new instance";
/// What the last instance logs once the snapshot file is written.
const WROTE: &str = "wrote the cache snapshot";
/// What a plain start logs once the snapshot file is stored.
const LOADED_FILE: &str = "loaded the cache snapshot";
/// What a plain start logs when the snapshot file is refused.
const REFUSED_FILE: &str = "cache snapshot not loaded, starting cold";

/// The names the tests cache, under one suffix the scripted upstream counts apart from the
/// agent's own queries.
const SUFFIX: &str = "warm.test.";
const NAMES: u32 = 200;

fn name(i: u32) -> String {
    format!("n{i}.{SUFFIX}")
}

fn address(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, (i / 256) as u8, (i % 256) as u8)
}

/// The `i` of a name `<letter><i>.<anything>`.
fn index(qname: &str) -> Option<u32> {
    qname.split('.').next()?.get(1..)?.parse().ok()
}

/// An upstream answering `<letter><i>.<suffix>` A with [`address`]`(i)` and the TTL `ttl`
/// gives for `i` and the name's query count (1 for its first), anything else NXDOMAIN.
fn answering(
    suffix: &'static str,
    ttl: impl Fn(u32, u64) -> u32 + Send + Sync + 'static,
) -> Scripted {
    Scripted::start(move |query, ctx| {
        let qname = query
            .queries
            .first()
            .map(|q| q.name().to_ascii())
            .unwrap_or_default();
        match index(&qname) {
            Some(i) if qname.ends_with(suffix) => Action::a(address(i), ttl(i, ctx.nth)),
            _ => Action::Rcode(ResponseCode::NXDomain),
        }
    })
    .expect("scripted upstream")
}

/// [`answering`] the test names, every one with `ttl`.
fn upstream(ttl: u32) -> Scripted {
    answering(SUFFIX, move |_, _| ttl)
}

/// Asks every name once at `listen`; each must be answered with its address. Returns the
/// answers' TTLs (the least and the greatest).
fn ask_all(listen: SocketAddr) -> (u32, u32) {
    let (mut least, mut greatest) = (u32::MAX, 0);
    for i in 0..NAMES {
        let reply = client::udp_blocking(
            listen,
            &client::query(&name(i), RecordType::A),
            Duration::from_secs(2),
        )
        .unwrap_or_else(|err| panic!("{}: {err}", name(i)));
        assert_eq!(
            (reply.response_code, client::a_addrs(&reply)),
            (ResponseCode::NoError, vec![address(i)]),
            "{}",
            name(i)
        );
        for ttl in client::answer_ttls(&reply) {
            least = least.min(ttl);
            greatest = greatest.max(ttl);
        }
    }
    (least, greatest)
}

/// The number after `field=` on the first line of `output` that contains `message`.
fn logged(output: &str, message: &str, field: &str) -> Option<u64> {
    let line = output.lines().find(|line| line.contains(message))?;
    let at = line.find(&format!(" {field}="))? + field.len() + 2;
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Waits for `message` in `process`'s log and returns its `entries=` count.
fn entries(what: &str, process: &Process, message: &str) -> u64 {
    wait_for_line(what, Duration::from_secs(15), || process.output(), message).unwrap();
    let output = process.output();
    logged(&output, message, "entries").unwrap_or_else(|| panic!("{what}: no count:\n{output}"))
}

/// A hand-over from A to B (a DaemonSet rollout with `maxSurge`): B takes the sockets and the
/// cache, then A gets SIGTERM and exits as the idle instance. Returns B and the number of
/// entries it loaded (the same A sent).
fn upgrade(
    a: &mut Process,
    listen: SocketAddr,
    upstream: SocketAddr,
    dir: &TempDir,
) -> (Process, u64) {
    let args = handoff_args(dir);
    let b = spawn_agent("nodedns-b", listen, &[upstream], &args).expect("instance B spawns");
    wait_for_line("B", Duration::from_secs(15), || b.output(), TOOK_OVER).unwrap();
    wait_for_line("A", Duration::from_secs(5), || a.output(), HANDED_OVER).unwrap();
    let sent = entries("A", a, SENT);
    let loaded = entries("B", &b, LOADED_STREAM);
    assert_eq!(
        sent,
        loaded,
        "A sent what B stored:\n{}\n{}",
        a.output(),
        b.output()
    );
    a.signal(Signal::SIGTERM).unwrap();
    let status = a.wait_timeout(Duration::from_secs(10)).expect("A exits");
    assert!(status.success(), "A exits 0: {status}\n{}", a.output());
    assert!(a.output().contains(NOT_LAST), "{}", a.output());
    (b, loaded)
}

/// Starts an instance on `listen` with the hand-over directory `dir`, forwarding to
/// `upstream`, and returns once it answers: the first on the node, or one starting after the
/// last exited.
fn start_in(dir: &TempDir, listen: SocketAddr, upstream: SocketAddr, what: &str) -> Process {
    let args = handoff_args(dir);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    start_first(listen, upstream, &args).unwrap_or_else(|err| panic!("{what} starts: {err:#}"))
}

/// SIGTERM to `process`, which must exit 0.
fn stop(mut process: Process, what: &str) -> Process {
    let status = process.stop().unwrap_or_else(|| panic!("{what} exits"));
    assert!(status.success(), "{what}: {status}\n{}", process.output());
    process
}

/// When the names were cached: the first asked, the last answered.
#[derive(Debug, Clone, Copy)]
struct Cached {
    first: Instant,
    last: Instant,
}

/// Starts A with the hand-over directory `dir` and caches every name through it.
fn cached(listen: SocketAddr, upstream: &Scripted, dir: &TempDir) -> (Process, Cached) {
    let a = start_in(dir, listen, upstream.addr(), "A");
    let first = Instant::now();
    ask_all(listen);
    let last = Instant::now();
    assert_eq!(
        upstream.queries_under(SUFFIX),
        u64::from(NAMES),
        "one miss per name"
    );
    (a, Cached { first, last })
}

/// Asks every name at `listen` once every entry is at least 2 s old, and checks that the
/// answers' TTLs count down from 300 as the entries aged since they were cached: their
/// remaining TTLs came along (an entry stored anew would answer 300).
fn ask_all_aged(listen: SocketAddr, cached: Cached) {
    std::thread::sleep(Duration::from_secs(2).saturating_sub(cached.last.elapsed()));
    let (least, greatest) = ask_all(listen);
    let oldest = cached.first.elapsed().as_secs() as u32;
    assert!(
        greatest <= 298 && least + oldest >= 300,
        "TTLs {least}..{greatest}, {oldest} s after the first name was cached"
    );
}

#[test]
fn names_cached_before_a_hand_over_are_answered_after_it_without_an_upstream_query() {
    let _turn = crate::shared();
    let upstream = upstream(300);
    let dir = TempDir::new("nodedns-warm").unwrap();
    let listen = free_addr();
    let (mut a, when) = cached(listen, &upstream, &dir);

    let (b, loaded) = upgrade(&mut a, listen, upstream.addr(), &dir);
    assert!(loaded >= u64::from(NAMES), "{loaded} entries carried");
    // B alone serves now: every name from the cache it was handed.
    ask_all_aged(listen, when);
    assert_eq!(
        upstream.queries_under(SUFFIX),
        u64::from(NAMES),
        "no query for a name cached before the hand-over: {:?}",
        upstream.names()
    );
    stop(b, "B");
}

#[test]
fn what_the_new_instance_cached_goes_back_with_the_sockets_when_it_exits_first() {
    let _turn = crate::shared();
    let upstream = upstream(300);
    let dir = TempDir::new("nodedns-warm").unwrap();
    let listen = free_addr();
    let a = start_in(&dir, listen, upstream.addr(), "A");
    let b = spawn_agent("nodedns-b", listen, &[upstream.addr()], &handoff_args(&dir))
        .expect("instance B spawns");
    wait_for_line("B", Duration::from_secs(15), || b.output(), TOOK_OVER).unwrap();
    wait_for_line("A", Duration::from_secs(5), || a.output(), HANDED_OVER).unwrap();
    // Only B has seen these names.
    ask_all(listen);
    assert_eq!(upstream.queries_under(SUFFIX), u64::from(NAMES));

    // A rollback, or the new pod deleted first: B hands the sockets back, and its cache.
    let b = stop(b, "B");
    assert!(b.output().contains(NOT_LAST), "{}", b.output());
    wait_for_line("A", Duration::from_secs(5), || a.output(), RESUMED).unwrap();
    let loaded = entries("A", &a, LOADED_STREAM);
    assert!(loaded >= u64::from(NAMES), "{loaded} entries carried back");
    ask_all(listen);
    assert_eq!(
        upstream.queries_under(SUFFIX),
        u64::from(NAMES),
        "no query for a name B had cached: {:?}",
        upstream.names()
    );
    // A is the last now.
    let a = stop(a, "A");
    assert!(a.output().contains(WROTE), "{}", a.output());
}

#[test]
fn with_the_upstream_stopped_across_an_upgrade_every_cached_name_is_still_answered() {
    let _turn = crate::shared();
    // TTL 5 s (the least the cache keeps): stale by the time of the upgrade.
    let upstream = upstream(5);
    let upstream_addr = upstream.addr();
    let dir = TempDir::new("nodedns-warm").unwrap();
    let listen = free_addr();
    let (mut a, when) = cached(listen, &upstream, &dir);
    // CoreDNS goes away, and stays away across the upgrade.
    drop(upstream);
    std::thread::sleep(Duration::from_secs(6).saturating_sub(when.last.elapsed()));

    let (b, loaded) = upgrade(&mut a, listen, upstream_addr, &dir);
    assert!(loaded >= u64::from(NAMES), "{loaded} entries carried");
    // Every name answered from its stale entry, with the stale TTL (RFC 8767 §4).
    assert_eq!(ask_all(listen), (30, 30));
    stop(b, "B");
}

#[test]
fn a_restart_from_the_snapshot_answers_cached_names_without_the_upstream() {
    let _turn = crate::shared();
    let upstream = upstream(300);
    let upstream_addr = upstream.addr();
    let dir = TempDir::new("nodedns-warm").unwrap();
    let listen = free_addr();
    let (a, when) = cached(listen, &upstream, &dir);
    // The pod is deleted: A is the last instance, and writes its cache at exit.
    let a = stop(a, "A");
    let written = logged(&a.output(), WROTE, "entries").expect("the snapshot was written");
    assert!(written >= u64::from(NAMES), "{written} entries written");
    let file = dir.path().join("cache.snapshot");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "private");
    let files: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert!(
        !files
            .iter()
            .any(|f| f.to_string_lossy().starts_with(".cache.snapshot")),
        "no partial file left: {files:?}"
    );
    // And CoreDNS is gone too when the new pod starts.
    drop(upstream);

    let b = start_in(&dir, listen, upstream_addr, "B");
    assert_eq!(entries("B", &b, LOADED_FILE), written, "{}", b.output());
    ask_all_aged(listen, when);
    stop(b, "B");
}

#[test]
fn a_corrupt_snapshot_is_logged_and_ignored() {
    let _turn = crate::shared();
    let upstream = upstream(300);
    let dir = TempDir::new("nodedns-warm").unwrap();
    let listen = free_addr();
    let (a, _) = cached(listen, &upstream, &dir);
    stop(a, "A");
    // One bit flipped in an answer (a bad disk, a partial copy by hand): the last byte of the
    // last entry, before its checksum (4 bytes) and the end record (17 bytes). A flipped length
    // field is refused before its checksum is read (its bound), which the format's unit tests
    // cover.
    let file = dir.path().join("cache.snapshot");
    let mut bytes = std::fs::read(&file).unwrap();
    let in_an_answer = bytes.len() - 17 - 4 - 1;
    bytes[in_an_answer] ^= 0x04;
    std::fs::write(&file, &bytes).unwrap();

    let b = start_in(&dir, listen, upstream.addr(), "B");
    wait_for_line("B", Duration::from_secs(15), || b.output(), REFUSED_FILE).unwrap();
    let output = b.output();
    let line = output.lines().find(|l| l.contains(REFUSED_FILE)).unwrap();
    assert!(line.contains("checksum mismatch"), "{line}");
    assert!(!output.contains(LOADED_FILE), "{output}");
    // B serves, cold: every name is fetched again.
    ask_all(listen);
    assert_eq!(upstream.queries_under(SUFFIX), 2 * u64::from(NAMES));
    stop(b, "B");
}

#[test]
fn each_half_turns_off_on_its_own_switch() {
    let _turn = crate::shared();
    let upstream = upstream(300);
    let dir = TempDir::new("nodedns-warm").unwrap();
    let listen = free_addr();
    let (a, _) = cached(listen, &upstream, &dir);
    // A new instance with --no-cache-handover takes the sockets, not the cache.
    let mut args = handoff_args(&dir);
    args.extend([
        "--no-cache-handover".to_owned(),
        "--cache-snapshot-max-age=0".to_owned(),
    ]);
    let b = spawn_agent("nodedns-b", listen, &[upstream.addr()], &args).expect("instance B spawns");
    wait_for_line("B", Duration::from_secs(15), || b.output(), TOOK_OVER).unwrap();
    assert!(
        b.output().contains(
            "--no-cache-handover: the cache of the instance that handed over is not read"
        ),
        "{}",
        b.output()
    );
    assert!(!b.output().contains(LOADED_STREAM), "{}", b.output());
    stop(a, "A");
    ask_all(listen);
    assert_eq!(upstream.queries_under(SUFFIX), 2 * u64::from(NAMES), "cold");
    // And with --cache-snapshot-max-age 0 the last instance writes no snapshot.
    let b = stop(b, "B");
    assert!(!b.output().contains(WROTE), "{}", b.output());
    assert!(!dir.path().join("cache.snapshot").exists());
}

/// The window the hot-mix measurement compares (`NODEDNS_WARM_SECS`, 60 s by default: the
/// issue's minute).
fn window() -> Duration {
    let secs = std::env::var("NODEDNS_WARM_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    Duration::from_secs(secs)
}

/// The hot mix's names: each with its own TTL from 15 to 45 s, and a first answer of a shorter
/// TTL of its own (5 s up to its TTL), so that their refreshes spread over time (the same first
/// TTL for all would bunch them: up to 10 % more in one minute than in the next, without any
/// upgrade).
fn hot_mix_upstream(suffix: &'static str) -> Scripted {
    answering(suffix, |i, nth| {
        let ttl = 15 + i % 31;
        if nth == 1 {
            5 + (i * 37) % (ttl - 4)
        } else {
            ttl
        }
    })
}

#[test]
fn an_upgrade_under_a_steady_hot_mix_costs_the_upstream_at_most_5_percent_more() {
    let _turn = crate::alone();
    // Two instances side by side, each with an upstream of its own and the same mix: 300 names,
    // each asked twice a second, so prefetch refreshes it before it expires. One is upgraded at
    // the start of the window, the other is not: the minute without an upgrade is the other
    // instance's same minute, with the same names, TTLs and refreshes due.
    const HOT: u32 = 300;
    const MIX: &str = "mix.test.";
    let upstream = hot_mix_upstream(MIX);
    let control_upstream = hot_mix_upstream(MIX);
    let dir = TempDir::new("nodedns-warm").unwrap();
    let control_dir = TempDir::new("nodedns-warm").unwrap();
    let listen = free_addr();
    let control_listen = free_addr();
    let mut a = start_in(&dir, listen, upstream.addr(), "A");
    let control = start_in(
        &control_dir,
        control_listen,
        control_upstream.addr(),
        "control",
    );

    let window = window();
    let warm_up = Duration::from_secs(10);
    let runtime = runtime();
    let started = Instant::now();
    let load = |target| Load {
        target,
        qps: 2 * HOT,
        duration: warm_up + window + Duration::from_secs(1),
        sockets: 8,
        deadline: Duration::from_secs(2),
        query: Arc::new(|n| (format!("h{}.{MIX}", n % u64::from(HOT)), RecordType::A)),
    };
    let running = runtime.spawn(load(listen).run());
    let control_running = runtime.spawn(load(control_listen).run());
    let at = |offset: Duration| std::thread::sleep(offset.saturating_sub(started.elapsed()));

    at(warm_up);
    let upgrade_at = upstream.queries_under(MIX);
    let control_before = control_upstream.queries_under(MIX);
    // The rollout: B takes over, A gets SIGTERM once B is ready (`minReadySeconds`: 5 s). (Not
    // `upgrade`: this test also runs with `NODEDNS_NO_CACHE_HANDOVER=true`, where it must fail,
    // to show what a cold upgrade costs.)
    let b = spawn_agent("nodedns-b", listen, &[upstream.addr()], &handoff_args(&dir))
        .expect("instance B spawns");
    wait_for_line("B", Duration::from_secs(15), || b.output(), TOOK_OVER).unwrap();
    std::thread::sleep(Duration::from_secs(5));
    a.signal(Signal::SIGTERM).unwrap();
    let status = a.wait_timeout(Duration::from_secs(10)).expect("A exits");
    assert!(status.success(), "A exits 0: {status}\n{}", a.output());
    at(warm_up + window);
    let after = upstream.queries_under(MIX);
    let control_after = control_upstream.queries_under(MIX);
    let report = runtime.block_on(running).unwrap();
    let control_report = runtime.block_on(control_running).unwrap();

    let without = control_after - control_before;
    let with = after - upgrade_at;
    eprintln!(
        "upstream queries in {window:?}: {without} without an upgrade, {with} with one \
         ({:.3}x); load: {report:?}; the other instance's load: {control_report:?}",
        with as f64 / without as f64
    );
    for (what, report) in [("upgraded", &report), ("not upgraded", &control_report)] {
        assert_eq!(
            (report.lost, report.servfail, report.wrong),
            (0, 0, 0),
            "every query answered ({what}): {report:#?}"
        );
    }
    assert!(without > u64::from(HOT), "the mix refreshes: {without}");
    assert!(
        with * 100 <= without * 105,
        "{with} upstream queries in the window after the upgrade, {without} in the same window \
         without one"
    );
    stop(b, "B");
    stop(control, "the instance not upgraded");
}
