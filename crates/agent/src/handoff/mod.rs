//! Zero-gap upgrades: a new instance on the node takes the very listening sockets over from the
//! running one, through a Unix socket in a directory every instance shares (`--handoff-dir`, a
//! hostPath), the way proxies hand sockets over on a hot restart (`SCM_RIGHTS`).
//!
//! Why hand sockets over rather than bind beside the old instance with `SO_REUSEPORT`: a socket
//! closed by the exiting instance loses the datagrams queued on it, and a closed TCP listener
//! resets the connections in its accept queue. Handed over, the sockets (and their queues) never
//! close: the new instance reads them from the moment it has them, the old one stops reading
//! after the new one said it serves, and answers what it had already read.
//!
//! The life of an instance (see [`link::Message`] for the words):
//!
//! 1. start: lock `nodedns.lock` (start-ups and take-backs go one at a time); connect to
//!    `nodedns.sock`. Nobody there (no file, or a file nobody listens on: a crashed instance;
//!    it is removed): bind everything. Someone there: receive its sockets ([`Handoff::start`]).
//! 2. serve them, then say `serving` and listen on `nodedns.sock` ([`Handoff::serving`]). The
//!    old instance stops reading, stops its host reconcile loop, and idles: it never exits by
//!    itself (a DaemonSet would restart it), and never tears the host plumbing down.
//! 3. exits:
//!    - an idle instance says `bye` to the instance it handed to, and exits without touching
//!      the host: another instance serves.
//!    - the serving instance, if the instance it took over from is still idle, hands the sockets
//!      back (`take`) and exits without touching the host once that one said `taken`
//!      ([`Handoff::give_back`]); otherwise it is the last, and withdraws and tears down.
//!    - if the serving instance dies (the connection ends without `take`), the idle one serves
//!      the sockets it kept again ([`Event::SuccessorLost`]).
//!
//! Who may take part ([`peer`]): the directory must belong to the agent's user and be writable by
//! it alone (else start-up fails, naming it); the socket file is created 0600 whatever the umask;
//! each end checks the other's credentials as the kernel gives them (`SO_PEERCRED`): the same
//! uid, and where the other process is visible, an executable of this one's name. Nothing the
//! peer says about itself is trusted.
//!
//! Every step has a deadline ([`HELLO`], [`STEP`], [`LOCK_WAIT`]): a peer that says nothing
//! costs a slot among [`MAX_GREETING`], never a wait; a shutdown waits at most for one hand-over
//! in progress, one to an instance waiting then, and one hand-back (docs/reliability.md).
//!
//! What follows the sockets (protocol version 2): a `cache` message with one end of a Unix
//! stream socket, into which the instance handing over writes its cache while the other reads
//! it ([`Handoff::take_cache`]; the app fills and empties it, this module only carries it, as
//! it must know nothing of caches). A version-1 peer is spoken to in version 1, without it.
//!
//! Limits (docs/reliability.md): what the crashed instance had read but not answered is lost;
//! a query on a TCP connection the old instance had accepted is answered by it, and the
//! connection closes when the old instance exits.

mod link;
mod listeners;
mod peer;

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use link::{Link, Message, OLDEST, VERSION};
pub use listeners::{Generation, Kind, ListenError, Listeners, Socket};
pub use peer::Peer;
use rustix::fs::FlockOperation;
use rustix::net::SocketAddrUnix;
use tokio::io::unix::AsyncFd;
use tokio::task::JoinSet;

/// The socket file in the hand-over directory.
pub const SOCKET_FILE: &str = "nodedns.sock";
/// The lock file in the hand-over directory.
pub const LOCK_FILE: &str = "nodedns.lock";

/// How long a new instance may take to say `hello` once connected. It says it right after
/// connecting.
pub const HELLO: Duration = Duration::from_secs(1);
/// How long any other step of a hand-over may take (receiving the sockets, the answer to
/// `serving` or `take`, a message sent). Both sides are local processes answering from their
/// control task within milliseconds; the bound keeps a hung peer from holding a shutdown.
pub const STEP: Duration = Duration::from_secs(5);
/// How long to wait for the directory's lock (held by an instance starting or taking back, for
/// a few of its steps at most).
pub const LOCK_WAIT: Duration = Duration::from_secs(10);
/// Connections waiting for their `hello` at once; more are closed at once.
pub const MAX_GREETING: usize = 4;

/// Why a hand-over could not be done.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("hand-over directory {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "hand-over directory {path} has mode {mode:04o} and owner uid {owner}: it must belong to \
         uid {uid} (the user nodedns runs as) and be writable by it alone, or another user could \
         put a socket there and be handed every listening socket (chown {uid} and chmod go-w it, \
         or name another directory)"
    )]
    Unsafe {
        path: PathBuf,
        mode: u32,
        owner: u32,
        uid: u32,
    },
    #[error("hand-over socket {path}: refusing the process listening there: {why}")]
    Peer { path: PathBuf, why: String },
    #[error("hand-over from the running instance failed: {0}")]
    Receive(#[source] io::Error),
    #[error("hand-over to a new instance failed: {0}")]
    Send(#[source] io::Error),
}

/// Something the serving or idle instance must act on (from [`Handoff::next`]).
#[derive(Debug)]
pub enum Event {
    /// A new instance connected and asks for the sockets: [`Handoff::hand_over`].
    Successor(Successor),
    /// The instance this one handed to exits and hands the sockets back: receive them with
    /// [`Handoff::take_back`], serve them, then [`Handoff::resumed`].
    TakeBack,
    /// The instance this one handed to is gone without handing back (it crashed): serve the
    /// kept sockets again, then [`Handoff::resumed`].
    SuccessorLost,
    /// The instance this one handed to handed over to yet another: this one stays idle for good.
    Released,
    /// The instance this one took over from exited (or released it).
    PredecessorGone,
}

/// A new instance that connected: its credentials checked, its `hello` received (`greeted`, in
/// protocol `version`) or still to come.
#[derive(Debug)]
pub struct Successor {
    link: Link,
    peer: Peer,
    greeted: bool,
    version: u32,
}

/// Where the instance handing the sockets over writes what follows them (the cache): given the
/// local end of the stream once the peer holds the other.
pub type Follow<'a> = &'a (dyn Fn(OwnedFd) + Sync);

/// The hand-over state of this instance.
#[derive(Debug, Default)]
pub struct Handoff {
    dir: Option<PathBuf>,
    /// Held from [`Handoff::start`] until [`Handoff::serving`] (and around a take-back).
    lock: Option<File>,
    /// Listening for new instances (only while serving).
    listener: Option<Listener>,
    /// The idle instance this one took the sockets from.
    predecessor: Option<Link>,
    /// The protocol version spoken with the predecessor.
    predecessor_version: u32,
    /// The instance this one handed the sockets to (only while idle).
    successor: Option<Link>,
    /// The protocol version spoken with the successor.
    successor_version: u32,
    /// What followed the sockets this instance last received: the stream its cache comes in.
    cache: Option<OwnedFd>,
    /// New instances connected, each waiting (at most [`HELLO`]) for its `hello`.
    greeting: JoinSet<io::Result<Successor>>,
}

#[derive(Debug)]
struct Listener {
    fd: AsyncFd<std::os::fd::OwnedFd>,
    /// Inode of the socket file bound, so that exiting removes the file only if it is still
    /// this instance's (another instance may have bound a new one since).
    inode: u64,
}

impl Handoff {
    /// Start-up. Without a directory: no hand-over, ever. With one: locks it, and if an
    /// instance serves there, receives its sockets (returned, to give to [`Listeners::open`]).
    /// Fails if an instance serves but the hand-over fails: starting beside it would leave two
    /// instances that each think they are alone, and the running one keeps serving meanwhile.
    pub async fn start(dir: Option<&Path>) -> Result<(Handoff, Vec<Socket>), Error> {
        let Some(dir) = dir else {
            return Ok((Handoff::default(), Vec::new()));
        };
        let dir_error = |source| Error::Dir {
            path: dir.to_path_buf(),
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(dir_error)?;
        check_dir(dir)?;
        let lock = lock(&dir.join(LOCK_FILE)).await.map_err(dir_error)?;
        let mut handoff = Handoff {
            dir: Some(dir.to_path_buf()),
            lock: Some(lock),
            ..Handoff::default()
        };
        let path = dir.join(SOCKET_FILE);
        for version in [VERSION, OLDEST] {
            let Some(link) = connect(&path).map_err(dir_error)? else {
                return Ok((handoff, Vec::new()));
            };
            // Whoever listens there gets this instance's `take` (and every socket) at its exit.
            if let Err(why) = Peer::of(&link).and_then(|peer| peer.check()) {
                return Err(Error::Peer { path, why });
            }
            let hello = Message::Hello {
                version,
                pid: std::process::id(),
            };
            let received = tokio::time::timeout(STEP, async {
                link.send(&hello, None).await?;
                let sockets = receive_sockets(&link).await?;
                let cache = if version >= 2 {
                    receive_cache(&link).await?
                } else {
                    None
                };
                Ok::<_, io::Error>((sockets, cache))
            })
            .await
            .unwrap_or_else(|_| Err(timed_out("the running instance's sockets", STEP)));
            match received {
                Ok((sockets, cache)) => {
                    handoff.predecessor = Some(link);
                    handoff.predecessor_version = version;
                    handoff.cache = cache;
                    return Ok((handoff, sockets));
                }
                // Closed at our hello: an instance that speaks only an older version.
                Err(err) if err.kind() == io::ErrorKind::ConnectionAborted && version > OLDEST => {
                    tracing::info!(
                        "the running instance does not speak hand-over version {version}; \
                         asking in version {OLDEST} (no cache follows the sockets)"
                    );
                }
                Err(source) => return Err(Error::Receive(source)),
            }
        }
        Err(Error::Receive(io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "the running instance closed the connection at every version",
        )))
    }

    /// The stream the instance that handed the sockets over writes its cache into, once: after
    /// [`Handoff::start`] and after a take-back. `None` from a version-1 instance.
    pub fn take_cache(&mut self) -> Option<OwnedFd> {
        self.cache.take()
    }

    /// Start-up (or take-back) is done and every socket is being served: tells the instance
    /// this one took over from (it stops reading), listens for the next instance, unlocks.
    pub async fn serving(&mut self) -> Result<(), Error> {
        let Some(dir) = self.dir.clone() else {
            return Ok(());
        };
        if let Some(predecessor) = &self.predecessor {
            // If it is gone already, so much the better: nobody else reads the sockets.
            let _ = tokio::time::timeout(STEP, predecessor.send(&Message::Serving, None)).await;
        }
        let path = dir.join(SOCKET_FILE);
        let listener = listen(&path).map_err(|source| Error::Dir { path, source })?;
        self.listener = Some(listener);
        self.lock = None;
        Ok(())
    }

    /// The next thing to act on. Cancel-safe; pending forever when there is nothing to watch.
    pub async fn next(&mut self) -> Event {
        let Handoff {
            listener,
            predecessor,
            successor,
            greeting,
            ..
        } = self;
        loop {
            tokio::select! {
                accepted = accept(listener.as_ref()) => match accepted {
                    Ok(link) => greet(greeting, link),
                    Err(err) => {
                        tracing::warn!(%err, "hand-over accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                greeted = greeting.join_next(), if !greeting.is_empty() => match greeted {
                    Some(Ok(Ok(successor))) => return Event::Successor(successor),
                    Some(Ok(Err(err))) => tracing::warn!(%err, "ignoring a hand-over connection"),
                    Some(Err(_)) | None => {}
                },
                message = recv(successor.as_ref()) => match message {
                    Ok(Some((Message::Take, _))) => return Event::TakeBack,
                    Ok(Some((Message::Released, _))) => {
                        *successor = None;
                        return Event::Released;
                    }
                    Ok(Some((other, _))) => {
                        tracing::warn!(?other, "unexpected hand-over message from the new instance");
                    }
                    Ok(None) | Err(_) => {
                        *successor = None;
                        return Event::SuccessorLost;
                    }
                },
                message = recv(predecessor.as_ref()) => match message {
                    Ok(Some((Message::Bye | Message::Taken, _))) | Ok(None) | Err(_) => {
                        *predecessor = None;
                        return Event::PredecessorGone;
                    }
                    Ok(Some((other, _))) => {
                        tracing::warn!(?other, "unexpected hand-over message from the old instance");
                    }
                },
            }
        }
    }

    /// A new instance that connected and was not yet handed the sockets (shutdown looks once,
    /// so that a new instance arriving then still gets the sockets): one that said `hello`
    /// already, else one waiting in the listen queue. Never waits.
    pub fn try_accept(&mut self) -> Option<Successor> {
        while let Some(done) = self.greeting.try_join_next() {
            if let Ok(Ok(successor)) = done {
                return Some(successor);
            }
        }
        let listener = self.listener.as_ref()?;
        let flags = rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK;
        loop {
            let fd = rustix::net::accept_with(listener.fd.get_ref(), flags).ok()?;
            let link = Link::new(fd).ok()?;
            match Peer::of(&link).and_then(|peer| peer.check().map(|()| peer)) {
                Ok(peer) => {
                    return Some(Successor {
                        link,
                        peer,
                        greeted: false,
                        version: OLDEST,
                    });
                }
                Err(why) => tracing::warn!("refusing a hand-over connection: {why}"),
            }
        }
    }

    /// Hands `listeners` to the new instance `successor`; returns its pid (as the kernel gives
    /// it: 0 for a process in another PID namespace) once it serves them. Then this instance
    /// must stop reading (and its host reconcile loop) and idle.
    ///
    /// A successor that speaks version 2 gets a `cache` stream after the sockets; `follow` gets
    /// this end of it before the wait for `serving`, so that the cache flows while the new
    /// instance waits for it.
    pub async fn hand_over(
        &mut self,
        successor: Successor,
        listeners: &Listeners,
        follow: Follow<'_>,
    ) -> Result<u32, Error> {
        let Successor {
            link,
            peer,
            greeted,
            mut version,
        } = successor;
        if !greeted {
            version = tokio::time::timeout(HELLO, hello(&link))
                .await
                .unwrap_or_else(|_| Err(timed_out("the new instance's hello", HELLO)))
                .map_err(Error::Send)?;
        }
        let exchange = async {
            send_sockets(&link, listeners).await?;
            if version >= 2 {
                send_cache(&link, follow).await?;
            }
            match link.recv().await? {
                Some((Message::Serving, _)) => Ok(()),
                other => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("expected serving, got {other:?}"),
                )),
            }
        };
        tokio::time::timeout(STEP, exchange)
            .await
            .unwrap_or_else(|_| Err(timed_out("the new instance", STEP)))
            .map_err(Error::Send)?;
        self.successor_version = version;
        // The new instance listens on the socket file now; ours is unlinked.
        self.listener = None;
        // Whoever this instance took over from must never take the sockets back because of it.
        if let Some(predecessor) = self.predecessor.take() {
            let _ = tokio::time::timeout(STEP, predecessor.send(&Message::Released, None)).await;
        }
        self.successor = Some(link);
        Ok(peer.pid.unwrap_or(0))
    }

    /// After [`Event::TakeBack`]: the sockets the exiting instance hands back.
    pub async fn take_back(&mut self) -> Vec<Socket> {
        let Some(successor) = &self.successor else {
            return Vec::new();
        };
        let version = self.successor_version;
        let exchange = async {
            let sockets = receive_sockets(successor).await?;
            let cache = if version >= 2 {
                receive_cache(successor).await?
            } else {
                None
            };
            Ok::<_, io::Error>((sockets, cache))
        };
        match tokio::time::timeout(STEP, exchange).await {
            Ok(Ok((sockets, cache))) => {
                self.cache = cache;
                sockets
            }
            Ok(Err(err)) => {
                tracing::warn!(%err, "take-back: serving the sockets kept instead");
                Vec::new()
            }
            Err(_) => {
                tracing::warn!("take-back timed out: serving the sockets kept instead");
                Vec::new()
            }
        }
    }

    /// After a take-back or a lost successor, once every socket is served again: confirms to
    /// the exiting instance (it then exits without tearing down) and listens for the next one.
    pub async fn resumed(&mut self) -> Result<(), Error> {
        let Some(dir) = self.dir.clone() else {
            return Ok(());
        };
        // This instance serves the sockets already: a lock it cannot get must not stop it.
        let guard = lock(&dir.join(LOCK_FILE))
            .await
            .inspect_err(|err| tracing::warn!(%err, "taking the sockets back without the lock"))
            .ok();
        if let Some(successor) = self.successor.take() {
            let _ = tokio::time::timeout(STEP, successor.send(&Message::Taken, None)).await;
        }
        let path = dir.join(SOCKET_FILE);
        let listener = listen(&path).map_err(|source| Error::Dir { path, source })?;
        self.listener = Some(listener);
        drop(guard);
        Ok(())
    }

    /// Shutdown of an idle instance: tells the serving one that it is the last.
    pub async fn bye(&mut self) {
        if let Some(successor) = self.successor.take() {
            let _ = tokio::time::timeout(STEP, successor.send(&Message::Bye, None)).await;
            successor.shutdown();
        }
    }

    /// Shutdown of the serving instance: if the instance it took over from is still there (idle),
    /// hands `listeners` back. True if that instance serves them now: then this one must exit
    /// without touching the host. False if this instance is the last.
    /// As in [`Handoff::hand_over`], a version-2 instance gets a `cache` stream after the
    /// sockets, `follow` this end of it.
    pub async fn give_back(&mut self, listeners: &Listeners, follow: Follow<'_>) -> bool {
        let Some(predecessor) = self.predecessor.take() else {
            return false;
        };
        let version = self.predecessor_version;
        let exchange = async {
            predecessor.send(&Message::Take, None).await?;
            send_sockets(&predecessor, listeners).await?;
            if version >= 2 {
                send_cache(&predecessor, follow).await?;
            }
            loop {
                match predecessor.recv().await? {
                    Some((Message::Taken, _)) => return Ok::<_, io::Error>(true),
                    // It is exiting too (its `bye` crossed our `take`): this one is the last.
                    Some((Message::Bye, _)) | None => return Ok(false),
                    Some(_) => {}
                }
            }
        };
        match tokio::time::timeout(STEP, exchange).await {
            Ok(Ok(taken)) => taken,
            Ok(Err(err)) => {
                tracing::debug!(%err, "the old instance did not take the sockets back");
                false
            }
            Err(_) => {
                tracing::warn!("the old instance did not answer the take-back in time");
                false
            }
        }
    }

    /// Stops listening for new instances, and removes the socket file if it is still this
    /// instance's (a new instance then finds no file and binds its own sockets).
    pub fn close(&mut self) {
        let (Some(dir), Some(listener)) = (&self.dir, self.listener.take()) else {
            return;
        };
        let path = dir.join(SOCKET_FILE);
        if std::fs::metadata(&path).is_ok_and(|m| m.ino() == listener.inode) {
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Whether an instance this one took over from is still connected.
    #[cfg(test)]
    pub fn has_predecessor(&self) -> bool {
        self.predecessor.is_some()
    }
}

fn timed_out(what: &str, limit: Duration) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("no answer from {what} within {limit:?}"),
    )
}

/// Refuses a directory another user could write to (or that belongs to another user): whoever
/// can put `nodedns.sock` there is handed every listening socket.
fn check_dir(dir: &Path) -> Result<(), Error> {
    let meta = std::fs::metadata(dir).map_err(|source| Error::Dir {
        path: dir.to_path_buf(),
        source,
    })?;
    let uid = nix::unistd::geteuid().as_raw();
    let mode = meta.mode() & 0o7777;
    if !meta.is_dir() || meta.uid() != uid || mode & 0o022 != 0 {
        return Err(Error::Unsafe {
            path: dir.to_path_buf(),
            mode,
            owner: meta.uid(),
            uid,
        });
    }
    Ok(())
}

/// Takes the directory's lock, waiting for another instance's start-up or take-back to finish,
/// at most [`LOCK_WAIT`].
async fn lock(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path)?;
    // A lock file another user can open could be locked by that user forever.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    let deadline = tokio::time::Instant::now() + LOCK_WAIT;
    loop {
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(file),
            Err(rustix::io::Errno::WOULDBLOCK) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{} is held by another instance for more than {LOCK_WAIT:?}",
                        path.display()
                    ),
                ));
            }
            Err(err) => return Err(err.into()),
        }
    }
}

/// Binds and listens on `path`, replacing whatever file is there (a stale one, or the
/// previous serving instance's, which stopped listening for new instances). The file is 0600:
/// only this user (and root) can connect.
fn listen(path: &Path) -> io::Result<Listener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    let fd = link::seqpacket()?;
    // On Linux the file `bind` creates takes the socket's mode less the umask: never more than
    // 0600, from the start.
    rustix::fs::fchmod(&fd, rustix::fs::Mode::from_raw_mode(0o600))?;
    rustix::net::bind(&fd, &SocketAddrUnix::new(path)?)?;
    // Exactly 0600, whatever the umask took away.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    rustix::net::listen(&fd, 8)?;
    let inode = std::fs::metadata(path)?.ino();
    Ok(Listener {
        fd: link::register(fd)?,
        inode,
    })
}

async fn accept(listener: Option<&Listener>) -> io::Result<Link> {
    let Some(listener) = listener else {
        return std::future::pending().await;
    };
    let fd = listener
        .fd
        .async_io(tokio::io::Interest::READABLE, |fd| {
            rustix::net::accept_with(
                fd,
                rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK,
            )
            .map_err(io::Error::from)
        })
        .await?;
    Link::new(fd)
}

/// A new instance connected: if the kernel's credentials are right, waits (beside everything
/// else, at most [`HELLO`]) for its `hello`.
fn greet(greeting: &mut JoinSet<io::Result<Successor>>, link: Link) {
    let peer = match Peer::of(&link).and_then(|peer| peer.check().map(|()| peer)) {
        Ok(peer) => peer,
        Err(why) => {
            tracing::warn!("refusing a hand-over connection: {why}");
            return;
        }
    };
    if greeting.len() >= MAX_GREETING {
        tracing::warn!(%peer, "refusing a hand-over connection: {MAX_GREETING} wait for their hello already");
        return;
    }
    greeting.spawn(async move {
        let version = tokio::time::timeout(HELLO, hello(&link))
            .await
            .unwrap_or_else(|_| Err(timed_out("a new instance's hello", HELLO)))
            .map_err(|err| io::Error::new(err.kind(), format!("{peer}: {err}")))?;
        Ok(Successor {
            link,
            peer,
            greeted: true,
            version,
        })
    });
}

/// Reads a new instance's `hello` (its pid is ignored: the kernel's is used): the protocol
/// version to speak with it, any from [`OLDEST`] to [`VERSION`].
async fn hello(link: &Link) -> io::Result<u32> {
    match link.recv().await? {
        Some((Message::Hello { version, .. }, _)) if (OLDEST..=VERSION).contains(&version) => {
            Ok(version)
        }
        Some((Message::Hello { version, .. }, _)) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("protocol version {version}, this instance speaks {OLDEST} to {VERSION}"),
        )),
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected hello, got {other:?}"),
        )),
    }
}

/// Connects to the instance serving at `path`: `None` when there is none (no file, or a file
/// nobody listens on: the instance that bound it died; the file is removed).
fn connect(path: &Path) -> io::Result<Option<Link>> {
    match Link::connect(path) {
        Ok(link) => Ok(Some(link)),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(err) if err.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!(path = %path.display(), "removing a stale hand-over socket");
            let _ = std::fs::remove_file(path);
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

/// Sends `cache` with one end of a new stream, and gives `follow` the other.
async fn send_cache(link: &Link, follow: Follow<'_>) -> io::Result<()> {
    let (ours, theirs) = link::stream_pair()?;
    link.send(&Message::Cache, Some(theirs.as_fd())).await?;
    follow(ours);
    Ok(())
}

/// Reads the `cache` message that follows the sockets in version 2: its stream, if the
/// descriptor is one (anything else is closed and no cache is read).
async fn receive_cache(link: &Link) -> io::Result<Option<OwnedFd>> {
    match link.recv().await? {
        Some((Message::Cache, Some(fd))) => match rustix::net::sockopt::socket_type(&fd) {
            Ok(rustix::net::SocketType::STREAM) => Ok(Some(fd)),
            other => {
                tracing::warn!(
                    ?other,
                    "hand-over: the cache stream is not a stream socket; no cache"
                );
                Ok(None)
            }
        },
        other => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected cache, got {other:?}"),
        )),
    }
}

async fn recv(link: Option<&Link>) -> io::Result<Option<(Message, Option<std::os::fd::OwnedFd>)>> {
    match link {
        Some(link) => link.recv().await,
        None => std::future::pending().await,
    }
}

async fn send_sockets(link: &Link, listeners: &Listeners) -> io::Result<()> {
    for socket in listeners.sockets() {
        let message = Message::Socket {
            kind: socket.kind,
            addr: socket.addr,
        };
        link.send(&message, Some(socket.as_fd())).await?;
    }
    link.send(&Message::End, None).await
}

/// Reads `socket` messages up to `end`. A descriptor that is not what its message says is
/// closed and skipped (its address is then bound afresh).
///
/// A connection closed before the first message is `ConnectionAborted`: what an instance that
/// does not speak the version asked in does.
async fn receive_sockets(link: &Link) -> io::Result<Vec<Socket>> {
    let mut sockets = Vec::new();
    let mut first = true;
    loop {
        let message = link.recv().await?;
        if first && message.is_none() {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the running instance closed the connection at hello",
            ));
        }
        first = false;
        match message {
            Some((Message::Socket { kind, addr }, Some(fd))) => {
                match Socket::received(kind, addr, fd) {
                    Ok(socket) => sockets.push(socket),
                    Err(err) => tracing::warn!(%err, "hand-over: ignoring a socket"),
                }
            }
            Some((Message::End, _)) => return Ok(sockets),
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("expected a socket or end, got {other:?}"),
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests;
