//! Warm starts: a new instance begins with the cache of the one before it, so that an upgrade
//! or a restart sends no burst of misses to CoreDNS, and has something stale to answer if
//! CoreDNS is down at that moment.
//!
//! Two ways the entries come, in one format ([`format`]), each entry with how long ago it was
//! stored (so its remaining TTL and stale window carry over) and whether it was asked often:
//!
//! - **at a hand-over**, from the running instance: after the sockets, through the stream the
//!   hand-over protocol attaches to its `cache` message ([`send`] on the old side, [`receive`]
//!   on the new one), while the new instance already serves. Bounded by [`DEADLINE`] at both
//!   ends and, at the reader, by the bytes its own caches hold ([`byte_limit`]);
//! - **at a plain restart** (the pod deleted, the node rebooted), from the snapshot file the
//!   last instance wrote into the hand-over directory at its exit ([`save`], [`load`]), if it is
//!   recent enough. The file is private (0600, the directory the agent's user's alone), and not
//!   trusted: its owner, mode, size, version, every checksum and every entry are checked before
//!   anything is stored; one bad part and nothing is loaded.
//!
//! Entries go to the block they came from: the same zones, listen addresses and upstreams
//! ([`identity`]); others are skipped. Each is re-parsed and re-judged by the cache it enters
//! ([`nodedns_cache::Carried`], [`nodedns_cache::Cache::import`]): a different policy applies as
//! if the reply had just come from the upstream, and what the new instance fetched itself is
//! never replaced by an older entry.
//!
//! Blocking I/O throughout (the app runs these on blocking threads): each end of a stream has
//! socket timeouts within the deadline, a file is read in one go.

pub mod format;

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use nodedns_cache::{Cache, Carried, Refused};

use crate::config::Server;
use crate::serve::Snapshot;
use format::{FormatError, Record};

/// The snapshot file, in the hand-over directory.
pub const FILE: &str = "cache.snapshot";
/// How long a new instance waits for the running one's cache before it tells it that it serves
/// (the old instance answers meanwhile, warm): the cache of a node comes in well under it.
pub const WAIT: Duration = Duration::from_secs(1);
/// How long the cache stream of a hand-over may take, at either end.
///
/// It counts in the shutdown's bound: an instance exiting soon after a hand-over waits for its
/// stream to be written (docs/reliability.md, Deadlines).
pub const DEADLINE: Duration = Duration::from_secs(5);
/// Bytes written to a stream or a file at once.
const CHUNK: usize = 64 * 1024;
/// A snapshot written up to this far in the future (by the wall clock) counts as written now:
/// clocks step a little.
const CLOCK_SLACK: Duration = Duration::from_secs(2);

/// A server block's identity across instances: its zones, listen addresses and upstream
/// addresses, in configuration order. Entries carried over go only to a block of the same
/// identity: another one's zones, or answers from other upstreams, are not its business.
pub fn identity(server: &Server) -> String {
    let join = |items: Vec<String>| items.join(",");
    let listen = join(server.listen.iter().map(ToString::to_string).collect());
    let forward = join(
        server
            .forwards
            .iter()
            .flat_map(|f| &f.upstream.addrs)
            .map(ToString::to_string)
            .collect(),
    );
    format!(
        "zones={} listen={listen} forward={forward}",
        server.zones.join(",")
    )
}

/// Each cache of `snapshot` with its block's identity.
fn caches(snapshot: &Snapshot) -> Vec<(String, Arc<Cache>)> {
    snapshot
        .zones
        .iter()
        .filter_map(|zone| Some((identity(&zone.server), zone.cache.clone()?)))
        .collect()
}

/// The most bytes a load reads: what `snapshot`'s caches can hold (an entry takes fewer bytes
/// carried than it is charged in a cache), and a mebibyte for the format's own.
pub fn byte_limit(snapshot: &Snapshot) -> u64 {
    caches(snapshot)
        .iter()
        .map(|(_, cache)| cache.policy().capacity_bytes)
        .fold(1 << 20, u64::saturating_add)
}

/// What was written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Written {
    pub entries: u64,
    pub bytes: u64,
}

/// What a load stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Loaded {
    /// Entries stored.
    pub stored: u64,
    /// Entries not stored: past their window, not cacheable under this policy, or the cache
    /// held a newer entry for the key (a stream also counts malformed ones here).
    pub refused: u64,
    /// Entries of blocks this instance does not have (or has without a cache).
    pub unmatched: u64,
    /// Bytes read.
    pub bytes: u64,
    /// How long before the load the entries were written (by the wall clock).
    pub age: Duration,
}

/// Why a snapshot file was not loaded (nothing of it was).
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error(
        "owner uid {owner}, mode {mode:04o}: it must be a regular file of uid {uid} (the user \
         nodedns runs as) readable by it alone"
    )]
    Unsafe { owner: u32, mode: u32, uid: u32 },
    #[error("{bytes} bytes, more than this instance's caches hold ({limit})")]
    TooLarge { bytes: u64, limit: u64 },
    #[error("written {age:?} ago, longer than --cache-snapshot-max-age ({max:?})")]
    TooOld { age: Duration, max: Duration },
    #[error("written {0:?} in the future (by this host's clock)")]
    Future(Duration),
    #[error("{0}")]
    Format(#[from] FormatError),
    #[error("entry {index}: {why}")]
    Entry { index: u64, why: Refused },
    #[error("{what}")]
    Incomplete { what: String },
}

/// Writes every usable entry of `snapshot`'s caches, as of `now`, into `out` in [`format`]'s
/// layout, [`CHUNK`] bytes at a time, at most `limit` bytes (an error beyond it).
fn encode(
    snapshot: &Snapshot,
    now: Instant,
    limit: u64,
    mut out: impl Write,
) -> io::Result<Written> {
    let written_ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let mut buf = Vec::with_capacity(CHUNK + format::MAX_PAYLOAD);
    buf.extend_from_slice(&format::header(written_ms));
    let mut done = Written::default();
    let mut flush = |buf: &mut Vec<u8>, done: &mut Written| {
        done.bytes += buf.len() as u64;
        if done.bytes > limit {
            return Err(io::Error::other(format!("more than {limit} bytes")));
        }
        out.write_all(buf)?;
        buf.clear();
        Ok::<_, io::Error>(())
    };
    for (identity, cache) in caches(snapshot) {
        format::write_record(&mut buf, &Record::Block(&identity));
        for exported in cache.export(now) {
            format::write_record(
                &mut buf,
                &Record::Entry {
                    age: exported.age,
                    hot: exported.hot,
                    key: &exported.key,
                    reply: exported.entry.reply().bytes(),
                },
            );
            done.entries += 1;
            if buf.len() >= CHUNK {
                flush(&mut buf, &mut done)?;
            }
        }
    }
    format::write_record(
        &mut buf,
        &Record::End {
            entries: done.entries,
        },
    );
    flush(&mut buf, &mut done)?;
    Ok(done)
}

/// The old side of a hand-over: writes `snapshot`'s caches into `stream` (the local end of the
/// protocol's `cache` stream), within [`DEADLINE`], then closes it.
pub fn send(stream: OwnedFd, snapshot: &Snapshot) -> io::Result<Written> {
    let deadline = Instant::now() + DEADLINE;
    let stream = UnixStream::from(stream);
    let mut timed = Deadlined {
        stream: &stream,
        deadline,
    };
    let written = encode(snapshot, Instant::now(), u64::MAX, &mut timed)?;
    stream.shutdown(std::net::Shutdown::Both)?;
    Ok(written)
}

/// Writes to a stream, each write bounded by what is left of the deadline.
struct Deadlined<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
}

impl Deadlined<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("not done within {DEADLINE:?}"),
            ));
        }
        Ok(left)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        (&mut &*self.stream).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What [`receive`] read, and how it ended: `Ok` with the end record, else why it stopped
/// (what was stored before stays: each entry was whole, checked and stored on its own).
#[derive(Debug)]
pub struct Received {
    pub loaded: Loaded,
    pub ended: Result<(), String>,
}

/// The new side of a hand-over: reads the running instance's caches from `stream` into
/// `snapshot`'s, each entry stored as it comes (the instance serves meanwhile), within
/// [`DEADLINE`] and [`byte_limit`].
pub fn receive(stream: OwnedFd, snapshot: &Snapshot) -> Received {
    let deadline = Instant::now() + DEADLINE;
    let limit = byte_limit(snapshot);
    let targets = caches(snapshot);
    let mut stream = UnixStream::from(stream);
    let mut loader = Loader::new(&targets);
    let mut chunk = vec![0u8; CHUNK];
    let (mut stored, mut refused) = (0, 0);
    let ended = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(format!("not done within {DEADLINE:?}"));
        }
        if let Err(err) = stream.set_read_timeout(Some(left)) {
            break Err(err.to_string());
        }
        let n = match stream.read(&mut chunk) {
            Ok(0) if loader.ended() => break Ok(()),
            Ok(0) if loader.loaded.bytes == 0 => {
                break Err("the stream was closed empty (that instance sends none)".to_owned());
            }
            Ok(0) => break Err("the stream ended before the end record".to_owned()),
            Ok(n) => n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => break Err(err.to_string()),
        };
        if loader.loaded.bytes + n as u64 > limit {
            break Err(format!("more than {limit} bytes"));
        }
        let now = Instant::now();
        let fed = loader.feed(&chunk[..n], |cache, carried| {
            match cache.import(carried, now) {
                Ok(()) => stored += 1,
                Err(_) => refused += 1,
            }
        });
        if let Err(err) = fed {
            break Err(err.to_string());
        }
    };
    Received {
        loaded: Loaded {
            stored,
            refused,
            ..loader.loaded
        },
        ended,
    }
}

/// Reads records from the bytes fed to it, in order, and hands each entry (checked by
/// [`Carried::parse`]) with its block's cache to a caller's function.
struct Loader<'a> {
    targets: &'a [(String, Arc<Cache>)],
    /// Bytes fed and not read yet (at most one record's).
    pending: Vec<u8>,
    /// The header's time, once read.
    written: Option<SystemTime>,
    /// The cache of the block the entries being read belong to (`None`: skipped).
    block: Option<Arc<Cache>>,
    /// Entries read.
    entries: u64,
    /// The end record's count, once read.
    end: Option<u64>,
    loaded: Loaded,
}

/// Why a [`Loader`] stopped.
#[derive(Debug, thiserror::Error)]
enum Stop {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("written {0:?} in the future (by this host's clock)")]
    Future(Duration),
    #[error("entry {index}: {why}")]
    Entry { index: u64, why: Refused },
    #[error("the end record counts {counted} entries, {read} came")]
    Count { counted: u64, read: u64 },
}

impl<'a> Loader<'a> {
    fn new(targets: &'a [(String, Arc<Cache>)]) -> Self {
        Loader {
            targets,
            pending: Vec::new(),
            written: None,
            block: None,
            entries: 0,
            end: None,
            loaded: Loaded::default(),
        }
    }

    fn ended(&self) -> bool {
        self.end.is_some()
    }

    /// Reads what `bytes` completes. Each whole entry of a known block, checked by
    /// [`Carried::parse`] with the age it has now, goes to `store` with its block's cache; one
    /// that fails the check stops the load (whoever wrote it is broken, or hostile).
    fn feed(
        &mut self,
        bytes: &[u8],
        mut store: impl FnMut(&Arc<Cache>, Carried),
    ) -> Result<(), Stop> {
        self.loaded.bytes += bytes.len() as u64;
        self.pending.extend_from_slice(bytes);
        let mut at = 0;
        let result = loop {
            let rest = &self.pending[at..];
            if self.written.is_none() {
                match format::read_header(rest) {
                    Ok(Some(ms)) => {
                        let written = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
                        self.loaded.age = match SystemTime::now().duration_since(written) {
                            Ok(age) => age,
                            Err(ahead) if ahead.duration() <= CLOCK_SLACK => Duration::ZERO,
                            Err(ahead) => break Err(Stop::Future(ahead.duration())),
                        };
                        self.written = Some(written);
                        at += format::HEADER_LEN;
                        continue;
                    }
                    Ok(None) => break Ok(()),
                    Err(err) => break Err(err.into()),
                }
            }
            if rest.is_empty() {
                break Ok(());
            }
            if self.end.is_some() {
                break Err(FormatError::Trailing.into());
            }
            let (record, used) = match format::read_record(rest) {
                Ok(Some(read)) => read,
                Ok(None) => break Ok(()),
                Err(err) => break Err(err.into()),
            };
            at += used;
            match record {
                Record::Block(identity) => {
                    self.block = self
                        .targets
                        .iter()
                        .find(|(id, _)| id == identity)
                        .map(|(_, cache)| cache.clone());
                }
                Record::Entry {
                    age,
                    hot,
                    key,
                    reply,
                } => {
                    let index = self.entries;
                    self.entries += 1;
                    let Some(cache) = &self.block else {
                        self.loaded.unmatched += 1;
                        continue;
                    };
                    let age = age.saturating_add(self.loaded.age);
                    let carried = match Carried::parse(key, reply, age, hot) {
                        Ok(carried) => carried,
                        Err(why) => break Err(Stop::Entry { index, why }),
                    };
                    store(cache, carried);
                }
                Record::End { entries } => {
                    if entries != self.entries {
                        break Err(Stop::Count {
                            counted: entries,
                            read: self.entries,
                        });
                    }
                    self.end = Some(entries);
                }
            }
        };
        self.pending.drain(..at);
        result
    }
}

/// Writes the snapshot file of `snapshot`'s caches into `dir`: private (0600), complete or not
/// at all (written beside, then renamed over the last one).
pub fn save(dir: &Path, snapshot: &Snapshot) -> io::Result<Written> {
    let path = dir.join(FILE);
    let partial = dir.join(format!(".{FILE}.{}", std::process::id()));
    let _ = std::fs::remove_file(&partial);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&partial)?;
    // Exactly 0600, whatever the umask left.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    let result = (|| {
        let mut out = io::BufWriter::with_capacity(CHUNK, &file);
        let written = encode(snapshot, Instant::now(), byte_limit(snapshot), &mut out)?;
        out.flush()?;
        drop(out);
        file.sync_all()?;
        std::fs::rename(&partial, &path)?;
        Ok(written)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
}

/// Where the snapshot file of `dir` is.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Loads the snapshot file of `dir` into `snapshot`'s caches, if it was written at most
/// `max_age` ago and holds nothing wrong: `Ok(None)` when there is no file. Reads the whole
/// file (at most [`byte_limit`] bytes) and checks everything, every entry parsed, before it
/// stores anything.
pub fn load(dir: &Path, snapshot: &Snapshot, max_age: Duration) -> Result<Option<Loaded>, Refusal> {
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path(dir))
    {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(err.into()),
    };
    let meta = file.metadata()?;
    let uid = nix::unistd::geteuid().as_raw();
    if !meta.is_file() || meta.uid() != uid || meta.mode() & 0o077 != 0 {
        return Err(Refusal::Unsafe {
            owner: meta.uid(),
            mode: meta.mode() & 0o7777,
            uid,
        });
    }
    let limit = byte_limit(snapshot);
    if meta.len() > limit {
        return Err(Refusal::TooLarge {
            bytes: meta.len(),
            limit,
        });
    }
    let mut bytes = Vec::new();
    file.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(Refusal::TooLarge {
            bytes: bytes.len() as u64,
            limit,
        });
    }
    let checked = check(&bytes, snapshot)?;
    if checked.loaded.age > max_age {
        return Err(Refusal::TooOld {
            age: checked.loaded.age,
            max: max_age,
        });
    }
    Ok(Some(checked.store()))
}

/// A whole file, checked: its entries for this instance's caches, nothing stored yet.
struct Checked {
    entries: Vec<(Arc<Cache>, Carried)>,
    loaded: Loaded,
}

impl Checked {
    /// Stores every entry, as of now.
    fn store(self) -> Loaded {
        let now = Instant::now();
        let mut loaded = self.loaded;
        for (cache, carried) in self.entries {
            match cache.import(carried, now) {
                Ok(()) => loaded.stored += 1,
                Err(_) => loaded.refused += 1,
            }
        }
        loaded
    }
}

/// Reads and checks a whole snapshot file: every record and checksum, the end record and its
/// count, every entry of a known block parsed. Stores nothing.
fn check(bytes: &[u8], snapshot: &Snapshot) -> Result<Checked, Refusal> {
    let targets = caches(snapshot);
    let mut loader = Loader::new(&targets);
    let mut entries = Vec::new();
    loader
        .feed(bytes, |cache, carried| {
            entries.push((cache.clone(), carried))
        })
        .map_err(|stop| match stop {
            Stop::Format(err) => Refusal::Format(err),
            Stop::Future(ahead) => Refusal::Future(ahead),
            Stop::Entry { index, why } => Refusal::Entry { index, why },
            count @ Stop::Count { .. } => Refusal::Incomplete {
                what: count.to_string(),
            },
        })?;
    if loader.written.is_none() {
        return Err(Refusal::Incomplete {
            what: "shorter than the header".to_owned(),
        });
    }
    if !loader.ended() {
        return Err(Refusal::Incomplete {
            what: "no end record (cut short)".to_owned(),
        });
    }
    Ok(Checked {
        entries,
        loaded: loader.loaded,
    })
}

#[cfg(test)]
mod tests;
