//! Two instances in one process: the protocol, the stale socket file, hand-back, a lost
//! successor. (The binary, two processes and real traffic:
//! integration/tests/suite/reliability_upgrade.rs.)

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;
use crate::serve::Endpoint;

struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "nodedns-handoff-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        Dir(path)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A loopback address whose port is free for UDP and TCP alike.
pub(super) fn free_addr() -> SocketAddr {
    for _ in 0..64 {
        let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = tcp.local_addr().unwrap();
        if std::net::UdpSocket::bind(addr).is_ok() {
            return addr;
        }
    }
    panic!("no free port");
}

fn open(dns: SocketAddr, inherited: Vec<Socket>) -> Listeners {
    Listeners::open(
        &[(dns, Endpoint::Dns)].into(),
        &BTreeMap::new(),
        2,
        inherited,
    )
    .unwrap()
    .0
}

/// An instance that serves: started, listening on `dns`, accepting new instances.
async fn first(dir: &Dir, dns: SocketAddr) -> (Handoff, Listeners) {
    let (mut handoff, inherited) = Handoff::start(Some(&dir.0)).await.unwrap();
    assert!(inherited.is_empty());
    let listeners = open(dns, inherited);
    handoff.serving().await.unwrap();
    (handoff, listeners)
}

/// Starts a second instance while `old` serves: `old` hands over from a task. Returns both.
async fn second(
    dir: &Dir,
    dns: SocketAddr,
    mut old: Handoff,
    old_listeners: Listeners,
) -> ((Handoff, Listeners), (Handoff, Listeners)) {
    let handing = tokio::spawn(async move {
        let Event::Successor(link) = old.next().await else {
            panic!("expected a new instance");
        };
        old.hand_over(link, &old_listeners, &|_| {}).await.unwrap();
        (old, old_listeners)
    });
    let (mut new, inherited) = Handoff::start(Some(&dir.0)).await.unwrap();
    assert_eq!(inherited.len(), 3, "two UDP sockets and a TCP listener");
    let listeners = open(dns, inherited);
    new.serving().await.unwrap();
    let old = handing.await.unwrap();
    (old, (new, listeners))
}

#[tokio::test]
async fn without_a_directory_nothing_is_handed_over() {
    let (mut handoff, inherited) = Handoff::start(None).await.unwrap();
    assert!(inherited.is_empty());
    handoff.serving().await.unwrap();
    let next = tokio::time::timeout(Duration::from_millis(50), handoff.next()).await;
    assert!(next.is_err(), "nothing to wait for");
    assert!(!handoff.give_back(&Listeners::default(), &|_| {}).await);
}

#[tokio::test]
async fn a_new_instance_receives_the_very_sockets_of_the_running_one() {
    let dir = Dir::new();
    let dns = free_addr();
    let (old, old_listeners) = first(&dir, dns).await;
    let udp = std::net::UdpSocket::from(
        old_listeners.sockets()[0]
            .fd
            .try_clone()
            .expect("dup the old UDP socket"),
    );
    // A query queued on the old socket before the hand-over...
    let client = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    client.send_to(b"queued", dns).unwrap();
    let ((_old, _), (new, listeners)) = second(&dir, dns, old, old_listeners).await;
    assert!(new.has_predecessor());
    // ...is read by the new instance from one of the sockets it received (the kernel puts a
    // client's datagrams on one socket of the group; try both).
    let mut got = None;
    for socket in listeners.sockets().iter().filter(|s| s.kind == Kind::Udp) {
        let socket = std::net::UdpSocket::from(socket.fd.try_clone().unwrap());
        socket.set_nonblocking(true).unwrap();
        let mut buf = [0; 16];
        if let Ok((n, _)) = socket.recv_from(&mut buf) {
            got = Some(buf[..n].to_vec());
        }
    }
    assert_eq!(got.as_deref(), Some(&b"queued"[..]));
    drop(udp);
}

#[tokio::test]
async fn a_stale_socket_file_is_replaced() {
    let dir = Dir::new();
    std::fs::create_dir_all(&dir.0).unwrap();
    // An instance that died: its socket file stays, nobody listens on it.
    drop(listen(&dir.0.join(SOCKET_FILE)).unwrap());
    assert!(dir.0.join(SOCKET_FILE).exists());
    let (mut handoff, inherited) = Handoff::start(Some(&dir.0)).await.unwrap();
    assert!(inherited.is_empty());
    handoff.serving().await.unwrap();
    // And the new file is live: a third instance can connect to it.
    assert!(Link::connect(&dir.0.join(SOCKET_FILE)).is_ok());
    handoff.close();
    assert!(!dir.0.join(SOCKET_FILE).exists());
}

#[tokio::test]
async fn the_idle_instance_says_bye_and_the_serving_one_is_then_the_last() {
    let dir = Dir::new();
    let dns = free_addr();
    let (old, old_listeners) = first(&dir, dns).await;
    let ((mut old, _), (mut new, listeners)) = second(&dir, dns, old, old_listeners).await;
    old.bye().await;
    assert!(matches!(new.next().await, Event::PredecessorGone));
    assert!(!new.has_predecessor());
    assert!(
        !new.give_back(&listeners, &|_| {}).await,
        "nobody to give back to"
    );
}

#[tokio::test]
async fn an_exiting_successor_hands_the_sockets_back() {
    let dir = Dir::new();
    let dns = free_addr();
    let (old, old_listeners) = first(&dir, dns).await;
    let ((mut old, _kept), (mut new, listeners)) = second(&dir, dns, old, old_listeners).await;
    let taking = tokio::spawn(async move {
        assert!(matches!(old.next().await, Event::TakeBack));
        let sockets = old.take_back().await;
        old.resumed().await.unwrap();
        (old, sockets)
    });
    assert!(
        new.give_back(&listeners, &|_| {}).await,
        "the old instance took them"
    );
    let (mut old, sockets) = taking.await.unwrap();
    assert_eq!(sockets.len(), 3);
    // The old instance listens for the next one again; the exiting one leaves its file alone.
    new.close();
    assert!(dir.0.join(SOCKET_FILE).exists());
    old.close();
    assert!(!dir.0.join(SOCKET_FILE).exists());
}

#[tokio::test]
async fn a_successor_that_dies_gives_the_sockets_back_to_the_idle_instance() {
    let dir = Dir::new();
    let dns = free_addr();
    let (old, old_listeners) = first(&dir, dns).await;
    let ((mut old, kept), (new, _listeners)) = second(&dir, dns, old, old_listeners).await;
    drop(new);
    assert!(matches!(old.next().await, Event::SuccessorLost));
    assert_eq!(
        kept.sockets().len(),
        3,
        "the idle instance kept its descriptors"
    );
    old.resumed().await.unwrap();
    // A new instance can take over from it again.
    let ((_, _), (new, _)) = second(&dir, dns, old, kept).await;
    assert!(new.has_predecessor());
}

#[tokio::test]
async fn a_second_hand_over_releases_the_first_idle_instance() {
    let dir = Dir::new();
    let dns = free_addr();
    let (a, a_listeners) = first(&dir, dns).await;
    let ((mut a, _), (b, b_listeners)) = second(&dir, dns, a, a_listeners).await;
    let ((_b, _), (mut c, c_listeners)) = second(&dir, dns, b, b_listeners).await;
    // A must not take the sockets back because B went idle: it is released.
    assert!(matches!(a.next().await, Event::Released));
    let next = tokio::time::timeout(Duration::from_millis(50), a.next()).await;
    assert!(next.is_err(), "nothing more for A: {next:?}");
    // C's predecessor is B (idle), not A.
    assert!(c.has_predecessor());
    drop(c_listeners);
    c.close();
}

#[tokio::test]
async fn a_peer_speaking_garbage_fails_the_start_up_not_the_process() {
    let dir = Dir::new();
    std::fs::create_dir_all(&dir.0).unwrap();
    let listener = listen(&dir.0.join(SOCKET_FILE)).unwrap();
    let talking = tokio::spawn(async move {
        let link = accept(Some(&listener)).await.unwrap();
        let _hello = link.recv().await.unwrap();
        link.send(&Message::Serving, None).await.unwrap();
        // Keep the connection open until the other side gave up.
        let _ = link.recv().await;
    });
    let err = Handoff::start(Some(&dir.0)).await.unwrap_err();
    assert!(matches!(err, Error::Receive(_)), "{err}");
    talking.await.unwrap();
}

#[tokio::test]
async fn a_new_instance_waiting_at_shutdown_is_handed_the_sockets() {
    let dir = Dir::new();
    let dns = free_addr();
    let (mut old, old_listeners) = first(&dir, dns).await;
    assert!(old.try_accept().is_none(), "nobody waiting");
    // The new instance connects while the old one is shutting down (not in `next`).
    let starting = {
        let path = dir.0.clone();
        tokio::spawn(async move { Handoff::start(Some(&path)).await })
    };
    let link = loop {
        if let Some(link) = old.try_accept() {
            break link;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let handing = tokio::spawn(async move {
        old.hand_over(link, &old_listeners, &|_| {}).await.unwrap();
        old.bye().await;
        old.close();
    });
    let (mut new, inherited) = starting.await.unwrap().unwrap();
    assert_eq!(inherited.len(), 3);
    let listeners = open(dns, inherited);
    new.serving().await.unwrap();
    handing.await.unwrap();
    assert!(matches!(new.next().await, Event::PredecessorGone));
    assert!(
        !new.give_back(&listeners, &|_| {}).await,
        "the new instance is the last"
    );
    // The old one left the new one's socket file alone.
    assert!(dir.0.join(SOCKET_FILE).exists());
}

#[tokio::test]
async fn a_directory_other_users_can_write_to_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    for mode in [0o777, 0o770, 0o1777] {
        let dir = Dir::new();
        std::fs::create_dir_all(&dir.0).unwrap();
        std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(mode)).unwrap();
        let err = Handoff::start(Some(&dir.0)).await.unwrap_err();
        let Error::Unsafe {
            path, mode: seen, ..
        } = &err
        else {
            panic!("{mode:o}: {err}");
        };
        assert_eq!((path, *seen), (&dir.0, mode));
        let text = err.to_string();
        assert!(text.contains(&format!("mode {mode:04o}")), "{text}");
        assert!(!dir.0.join(SOCKET_FILE).exists());
    }
    // Made here, or already there and writable by its owner alone: fine.
    let dir = Dir::new();
    let (mut handoff, _) = Handoff::start(Some(&dir.0)).await.unwrap();
    let made = std::fs::metadata(&dir.0).unwrap();
    assert_eq!(made.mode() & 0o777, 0o700);
    handoff.serving().await.unwrap();
    let socket = std::fs::metadata(dir.0.join(SOCKET_FILE)).unwrap();
    assert_eq!(socket.mode() & 0o777, 0o600);
    handoff.close();
}

#[tokio::test]
async fn a_silent_connection_does_not_hold_up_the_next_instance() {
    let dir = Dir::new();
    let dns = free_addr();
    let (mut old, old_listeners) = first(&dir, dns).await;
    let path = dir.0.join(SOCKET_FILE);
    // Connected, and never a word.
    let silent = Link::connect(&path).unwrap();
    let greeter = Link::connect(&path).unwrap();
    greeter
        .send(
            &Message::Hello {
                version: VERSION,
                pid: 1,
            },
            None,
        )
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let Event::Successor(successor) = old.next().await else {
        panic!("expected the instance that said hello");
    };
    assert!(started.elapsed() < HELLO, "waited for the silent one");
    assert!(successor.greeted);
    // The `hello` pid is not believed: the kernel's is this process's.
    assert_eq!(successor.peer.pid, Some(std::process::id()));
    drop(old_listeners);
    // The silent one is closed after its deadline.
    let ended = tokio::time::timeout(HELLO * 3, async {
        loop {
            tokio::select! {
                _ = old.next() => {}
                end = silent.recv() => return end,
            }
        }
    })
    .await
    .expect("closed within its deadline");
    assert!(matches!(ended, Ok(None)), "{ended:?}");
}

/// A `follow` that writes `bytes` into the stream it is given, and closes it.
fn writing(bytes: &'static [u8]) -> impl Fn(OwnedFd) + Sync {
    move |fd| {
        let mut stream = std::os::unix::net::UnixStream::from(fd);
        std::thread::spawn(move || {
            use std::io::Write;
            stream.write_all(bytes).unwrap();
        });
    }
}

/// Everything the other end of a cache stream wrote, until it closed it.
fn read_all(fd: OwnedFd) -> Vec<u8> {
    use std::io::Read;
    let mut stream = std::os::unix::net::UnixStream::from(fd);
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut got = Vec::new();
    stream.read_to_end(&mut got).unwrap();
    got
}

#[tokio::test]
async fn the_cache_stream_follows_the_sockets_both_ways() {
    let dir = Dir::new();
    let dns = free_addr();
    let (mut old, old_listeners) = first(&dir, dns).await;
    let handing = tokio::spawn(async move {
        let Event::Successor(link) = old.next().await else {
            panic!("expected a new instance");
        };
        assert_eq!(link.version, VERSION);
        old.hand_over(link, &old_listeners, &writing(b"the old cache"))
            .await
            .unwrap();
        (old, old_listeners)
    });
    let (mut new, inherited) = Handoff::start(Some(&dir.0)).await.unwrap();
    let stream = new.take_cache().expect("a cache stream after the sockets");
    assert!(new.take_cache().is_none(), "once");
    assert_eq!(read_all(stream), b"the old cache");
    let listeners = open(dns, inherited);
    new.serving().await.unwrap();
    let (mut old, _kept) = handing.await.unwrap();

    // And back, at a hand-back.
    let taking = tokio::spawn(async move {
        assert!(matches!(old.next().await, Event::TakeBack));
        let sockets = old.take_back().await;
        let stream = old
            .take_cache()
            .expect("a cache stream after the sockets handed back");
        old.resumed().await.unwrap();
        (sockets, read_all(stream))
    });
    assert!(
        new.give_back(&listeners, &writing(b"the newer cache"))
            .await
    );
    let (sockets, cache) = taking.await.unwrap();
    assert_eq!(sockets.len(), 3);
    assert_eq!(cache, b"the newer cache");
}

/// An instance of protocol version 1 serving at `dir`: it refuses any other version by closing
/// the connection, and hands `listeners` over without a cache. Returns the versions it was
/// asked in and the messages that came after its `end`.
fn version_1_instance(dir: &Dir, listeners: Listeners) -> tokio::task::JoinHandle<Vec<u32>> {
    std::fs::create_dir_all(&dir.0).unwrap();
    let listener = listen(&dir.0.join(SOCKET_FILE)).unwrap();
    tokio::spawn(async move {
        let mut asked = Vec::new();
        loop {
            let link = accept(Some(&listener)).await.unwrap();
            let Some((Message::Hello { version, .. }, _)) = link.recv().await.unwrap() else {
                panic!("expected hello");
            };
            asked.push(version);
            if version != 1 {
                continue;
            }
            send_sockets(&link, &listeners).await.unwrap();
            let next = link.recv().await.unwrap();
            assert!(matches!(next, Some((Message::Serving, None))), "{next:?}");
            return asked;
        }
    })
}

#[tokio::test]
async fn a_version_1_instance_is_asked_again_in_version_1_and_sends_no_cache() {
    let dir = Dir::new();
    let dns = free_addr();
    let old = version_1_instance(&dir, open(dns, Vec::new()));
    let (mut new, inherited) = Handoff::start(Some(&dir.0)).await.unwrap();
    assert_eq!(inherited.len(), 3, "the sockets, in version 1");
    assert!(new.take_cache().is_none());
    assert_eq!(new.predecessor_version, 1);
    new.serving().await.unwrap();
    assert_eq!(old.await.unwrap(), [VERSION, 1]);
}

#[tokio::test]
async fn a_version_1_successor_gets_the_sockets_without_a_cache() {
    let dir = Dir::new();
    let dns = free_addr();
    let (mut old, old_listeners) = first(&dir, dns).await;
    let path = dir.0.join(SOCKET_FILE);
    let new = tokio::spawn(async move {
        let link = Link::connect(&path).unwrap();
        let hello = Message::Hello { version: 1, pid: 1 };
        link.send(&hello, None).await.unwrap();
        let sockets = receive_sockets(&link).await.unwrap();
        link.send(&Message::Serving, None).await.unwrap();
        // Nothing after `end` but what version 1 knows: the connection stays quiet.
        let next = tokio::time::timeout(Duration::from_millis(200), link.recv()).await;
        assert!(next.is_err(), "{next:?}");
        sockets.len()
    });
    let Event::Successor(link) = old.next().await else {
        panic!("expected a new instance");
    };
    let followed = std::sync::atomic::AtomicBool::new(false);
    let follow = |_| followed.store(true, Ordering::SeqCst);
    old.hand_over(link, &old_listeners, &follow).await.unwrap();
    assert!(
        !followed.load(Ordering::SeqCst),
        "no cache stream in version 1"
    );
    assert_eq!(old.successor_version, 1);
    assert_eq!(new.await.unwrap(), 3);
}
