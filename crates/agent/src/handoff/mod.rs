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
//! Limits (docs/reliability.md): what the crashed instance had read but not answered is lost;
//! a query on a TCP connection the old instance had accepted is answered by it, and the
//! connection closes when the old instance exits; the cache starts empty in the new instance.

mod link;
mod listeners;

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use link::{Link, Message, VERSION};
pub use listeners::{Generation, Kind, Listeners, Socket};
use rustix::fs::FlockOperation;
use rustix::net::SocketAddrUnix;
use tokio::io::unix::AsyncFd;

/// The socket file in the hand-over directory.
pub const SOCKET_FILE: &str = "nodedns.sock";
/// The lock file in the hand-over directory.
pub const LOCK_FILE: &str = "nodedns.lock";

/// How long one step of a hand-over may take (receiving the sockets, the answer to `take`).
/// Generous: both sides are local processes answering from their control task.
const STEP: Duration = Duration::from_secs(10);

/// Why a hand-over could not be done.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("hand-over directory {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("hand-over from the running instance failed: {0}")]
    Receive(#[source] io::Error),
    #[error("hand-over to a new instance failed: {0}")]
    Send(#[source] io::Error),
}

/// Something the serving or idle instance must act on (from [`Handoff::next`]).
#[derive(Debug)]
pub enum Event {
    /// A new instance connected and asks for the sockets: [`Handoff::hand_over`].
    Successor(Link),
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
    /// The instance this one handed the sockets to (only while idle).
    successor: Option<Link>,
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
        std::fs::create_dir_all(dir).map_err(dir_error)?;
        let lock = lock(&dir.join(LOCK_FILE)).await.map_err(dir_error)?;
        let mut handoff = Handoff {
            dir: Some(dir.to_path_buf()),
            lock: Some(lock),
            ..Handoff::default()
        };
        let path = dir.join(SOCKET_FILE);
        let link = match Link::connect(&path) {
            Ok(link) => link,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Ok((handoff, Vec::new()));
            }
            Err(err) if err.kind() == io::ErrorKind::ConnectionRefused => {
                // Nobody listens: the instance that bound it died without removing it.
                tracing::info!(path = %path.display(), "removing a stale hand-over socket");
                let _ = std::fs::remove_file(&path);
                return Ok((handoff, Vec::new()));
            }
            Err(err) => return Err(dir_error(err)),
        };
        let hello = Message::Hello {
            version: VERSION,
            pid: std::process::id(),
        };
        let received = tokio::time::timeout(STEP, async {
            link.send(&hello, None).await?;
            receive_sockets(&link).await
        })
        .await
        .unwrap_or_else(|_| Err(timed_out("the running instance's sockets")));
        match received {
            Ok(sockets) => {
                handoff.predecessor = Some(link);
                Ok((handoff, sockets))
            }
            Err(source) => Err(Error::Receive(source)),
        }
    }

    /// Start-up (or take-back) is done and every socket is being served: tells the instance
    /// this one took over from (it stops reading), listens for the next instance, unlocks.
    pub async fn serving(&mut self) -> Result<(), Error> {
        let Some(dir) = self.dir.clone() else {
            return Ok(());
        };
        if let Some(predecessor) = &self.predecessor {
            // If it is gone already, so much the better: nobody else reads the sockets.
            let _ = predecessor.send(&Message::Serving, None).await;
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
            ..
        } = self;
        loop {
            tokio::select! {
                accepted = accept(listener.as_ref()) => match accepted {
                    Ok(link) => return Event::Successor(link),
                    Err(err) => {
                        tracing::warn!(%err, "hand-over accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
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

    /// A new instance that connected and was not yet accepted (shutdown looks once, so that a
    /// new instance arriving then still gets the sockets).
    pub fn try_accept(&mut self) -> Option<Link> {
        let listener = self.listener.as_ref()?;
        let flags = rustix::net::SocketFlags::CLOEXEC | rustix::net::SocketFlags::NONBLOCK;
        let fd = rustix::net::accept_with(listener.fd.get_ref(), flags).ok()?;
        Link::new(fd).ok()
    }

    /// Hands `listeners` to the new instance on `link`; returns its pid once it serves them.
    /// Then this instance must stop reading (and its host reconcile loop) and idle.
    pub async fn hand_over(&mut self, link: Link, listeners: &Listeners) -> Result<u32, Error> {
        let exchange = async {
            let pid = match link.recv().await? {
                Some((Message::Hello { version, pid }, _)) if version == VERSION => pid,
                Some((Message::Hello { version, .. }, _)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("protocol version {version}, this instance speaks {VERSION}"),
                    ));
                }
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("expected hello, got {other:?}"),
                    ));
                }
            };
            send_sockets(&link, listeners).await?;
            match link.recv().await? {
                Some((Message::Serving, _)) => Ok(pid),
                other => Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("expected serving, got {other:?}"),
                )),
            }
        };
        let pid = tokio::time::timeout(STEP, exchange)
            .await
            .unwrap_or_else(|_| Err(timed_out("the new instance")))
            .map_err(Error::Send)?;
        // The new instance listens on the socket file now; ours is unlinked.
        self.listener = None;
        // Whoever this instance took over from must never take the sockets back because of it.
        if let Some(predecessor) = self.predecessor.take() {
            let _ = predecessor.send(&Message::Released, None).await;
        }
        self.successor = Some(link);
        Ok(pid)
    }

    /// After [`Event::TakeBack`]: the sockets the exiting instance hands back.
    pub async fn take_back(&mut self) -> Vec<Socket> {
        let Some(successor) = &self.successor else {
            return Vec::new();
        };
        match tokio::time::timeout(STEP, receive_sockets(successor)).await {
            Ok(Ok(sockets)) => sockets,
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
        let lock_path = dir.join(LOCK_FILE);
        let guard = lock(&lock_path).await.map_err(|source| Error::Dir {
            path: lock_path,
            source,
        })?;
        if let Some(successor) = self.successor.take() {
            let _ = successor.send(&Message::Taken, None).await;
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
            let _ = successor.send(&Message::Bye, None).await;
            successor.shutdown();
        }
    }

    /// Shutdown of the serving instance: if the instance it took over from is still there (idle),
    /// hands `listeners` back. True if that instance serves them now: then this one must exit
    /// without touching the host. False if this instance is the last.
    pub async fn give_back(&mut self, listeners: &Listeners) -> bool {
        let Some(predecessor) = self.predecessor.take() else {
            return false;
        };
        let exchange = async {
            predecessor.send(&Message::Take, None).await?;
            send_sockets(&predecessor, listeners).await?;
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

fn timed_out(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        format!("no answer from {what} within {STEP:?}"),
    )
}

/// Takes the directory's lock (waiting for another instance's start-up to finish).
async fn lock(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)?;
    tokio::task::spawn_blocking(move || {
        rustix::fs::flock(&file, FlockOperation::LockExclusive)?;
        Ok(file)
    })
    .await
    .map_err(io::Error::other)?
}

/// Binds and listens on `path`, replacing whatever file is there (a stale one, or the
/// previous serving instance's, which stopped listening for new instances).
fn listen(path: &Path) -> io::Result<Listener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(err),
    }
    let fd = link::seqpacket()?;
    rustix::net::bind(&fd, &SocketAddrUnix::new(path)?)?;
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
async fn receive_sockets(link: &Link) -> io::Result<Vec<Socket>> {
    let mut sockets = Vec::new();
    loop {
        match link.recv().await? {
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
