//! Logs: `tracing` to stderr, human-readable or JSON, with a filter that can change while the
//! agent runs; repeated errors rate-limited.
//!
//! - [`init`] installs the subscriber once, at start-up, and returns the [`Handle`] that changes
//!   the filter later: the admin endpoint `PUT /log-level` and the signals SIGUSR1 (everything
//!   at `debug`) and SIGUSR2 (back to the filter given at start) use it.
//! - [`RateLimit`]: an error that repeats (an upstream that is down fails every query) is logged
//!   once, then at most once per interval with the count of the lines it replaced, never one line
//!   per query.
//! - [`name_text`], [`TypeName`], [`rcode_text`]: a wire-form name, a type and an RCODE as
//!   CoreDNS's logs print them.
//!
//! What is logged is decided where it happens (the query log and the `errors` directive live
//! with the request path, in `serve`); this module knows nothing of DNS requests.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nodedns_wire::{rcode, rtype};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry, reload};

/// Why logging could not be set up or its filter changed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid log filter {filter:?}: {source}")]
    Filter {
        filter: String,
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("a global logger is already installed")]
    AlreadyInstalled,
    #[error("cannot change the log filter: the logger is gone")]
    Reload(#[source] reload::Error),
}

/// The output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
}

/// Changes the running filter. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct Handle {
    reload: reload::Handle<EnvFilter, Registry>,
    /// The filter given at start-up, which SIGUSR2 restores.
    initial: String,
    /// The filter in force (an `EnvFilter` cannot be printed back as it was written).
    current: Mutex<String>,
}

impl Handle {
    /// The filter in force, as it was written.
    pub fn current(&self) -> String {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces the filter (tracing `EnvFilter` syntax: `debug`, `info,nodedns::query=off`, ...).
    /// A filter that does not parse changes nothing.
    pub fn set(&self, filter: &str) -> Result<(), Error> {
        let filter = filter.trim();
        let parsed = parse(filter)?;
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        self.reload.reload(parsed).map_err(Error::Reload)?;
        *current = filter.to_owned();
        Ok(())
    }

    /// Back to the filter given at start-up.
    pub fn reset(&self) -> Result<(), Error> {
        self.set(&self.initial.clone())
    }
}

fn parse(filter: &str) -> Result<EnvFilter, Error> {
    EnvFilter::try_new(filter).map_err(|source| Error::Filter {
        filter: filter.to_owned(),
        source,
    })
}

/// Installs the global subscriber: stderr, `format`, filtered by `filter`.
pub fn init(format: Format, filter: &str) -> Result<Arc<Handle>, Error> {
    let (layer, reload) = reload::Layer::new(parse(filter)?);
    let registry = tracing_subscriber::registry().with(layer);
    // Colours only on a terminal: container logs and files get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let installed = match format {
        Format::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(ansi)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
        Format::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    };
    installed.map_err(|_| Error::AlreadyInstalled)?;
    Ok(Arc::new(Handle {
        reload,
        initial: filter.to_owned(),
        current: Mutex::new(filter.to_owned()),
    }))
}

/// SIGUSR1 sets the filter to `debug`; SIGUSR2 restores the start-up filter. Runs until the
/// runtime stops.
pub fn spawn_signal_handler(handle: Arc<Handle>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut usr1), Ok(mut usr2)) = (
        signal(SignalKind::user_defined1()),
        signal(SignalKind::user_defined2()),
    ) else {
        tracing::warn!("cannot handle SIGUSR1/SIGUSR2: the log level can only change over HTTP");
        return;
    };
    tokio::spawn(async move {
        loop {
            let result = tokio::select! {
                _ = usr1.recv() => handle.set("debug"),
                _ = usr2.recv() => handle.reset(),
            };
            match result {
                Ok(()) => {
                    tracing::warn!(filter = %handle.current(), "log filter changed by signal")
                }
                Err(err) => tracing::error!(%err, "log filter unchanged"),
            }
        }
    });
}

/// Lets one event through per interval and counts the rest, so an error that repeats for every
/// query becomes one line per interval. Lock-free: callers on any thread.
#[derive(Debug)]
pub struct RateLimit {
    interval: Duration,
    /// Times are nanoseconds since `base` (+1, so 0 means "never logged").
    base: Instant,
    /// Earliest time the next event may be logged.
    next: AtomicU64,
    /// Events held back since the last one logged.
    suppressed: AtomicU64,
}

impl RateLimit {
    pub fn new(interval: Duration, base: Instant) -> Self {
        RateLimit {
            interval,
            base,
            next: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)` if the event at `now` should be logged, `n` being how many were held back since
    /// the last one logged; `None` if it is held back (and counted).
    pub fn admit(&self, now: Instant) -> Option<u64> {
        let at = nanos(now.saturating_duration_since(self.base)).saturating_add(1);
        let next = self.next.load(Ordering::Relaxed);
        if at >= next
            && self
                .next
                .compare_exchange(
                    next,
                    at.saturating_add(nanos(self.interval)),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A query type as CoreDNS's log writes it: its mnemonic, or `TYPE<n>` (RFC 3597 §5).
#[derive(Debug, Clone, Copy)]
pub struct TypeName(pub u16);

impl std::fmt::Display for TypeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match rtype::name(self.0) {
            Some(name) => f.write_str(name),
            None => write!(f, "TYPE{}", self.0),
        }
    }
}

/// An RCODE as CoreDNS's log writes it: its name, or its number.
pub fn rcode_text(rcode: u8) -> Cow<'static, str> {
    match rcode::name(rcode.into()) {
        Some(name) => Cow::Borrowed(name),
        None => Cow::Owned(rcode.to_string()),
    }
}

/// A wire-form name in presentation form (RFC 1035 §5.1): labels joined by dots, ending with the
/// root dot; dots, backslashes and bytes outside printable ASCII escaped.
pub fn name_text(wire: &[u8]) -> String {
    let mut out = String::with_capacity(wire.len() + 1);
    let mut at = 0;
    while let Some(&len) = wire.get(at) {
        if len == 0 {
            break;
        }
        let Some(label) = wire.get(at + 1..at + 1 + usize::from(len)) else {
            break;
        };
        for &b in label {
            match b {
                b'.' | b'\\' => {
                    out.push('\\');
                    out.push(char::from(b));
                }
                0x21..=0x7e => out.push(char::from(b)),
                _ => out.push_str(&format!("\\{b:03}")),
            }
        }
        out.push('.');
        at += 1 + usize::from(len);
    }
    if out.is_empty() {
        out.push('.');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_logs_the_first_event_then_one_per_interval_with_the_count_held_back() {
        let base = Instant::now();
        let limit = RateLimit::new(Duration::from_secs(10), base);
        assert_eq!(limit.admit(base), Some(0));
        for ms in [1, 500, 9_000] {
            assert_eq!(limit.admit(base + Duration::from_millis(ms)), None);
        }
        assert_eq!(limit.admit(base + Duration::from_secs(10)), Some(3));
        assert_eq!(limit.admit(base + Duration::from_secs(11)), None);
        assert_eq!(limit.admit(base + Duration::from_secs(25)), Some(1));
    }

    #[test]
    fn rate_limit_admits_once_among_racing_threads() {
        let base = Instant::now();
        let limit = Arc::new(RateLimit::new(Duration::from_secs(60), base));
        let now = base + Duration::from_secs(1);
        let admitted: usize = (0..8)
            .map(|_| {
                let limit = limit.clone();
                std::thread::spawn(move || (0..1000).filter(|_| limit.admit(now).is_some()).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(admitted, 1);
        assert_eq!(
            limit.admit(now + Duration::from_secs(60)),
            Some(7999),
            "every held-back event is counted"
        );
    }

    #[test]
    fn types_and_rcodes_print_as_coredns_logs_them() {
        assert_eq!(TypeName(13).to_string(), "HINFO");
        assert_eq!(TypeName(65).to_string(), "HTTPS");
        assert_eq!(TypeName(54).to_string(), "TYPE54");
        assert_eq!(rcode_text(3), "NXDOMAIN");
        assert_eq!(rcode_text(11), "DSOTYPENI");
        assert_eq!(rcode_text(12), "12");
    }

    #[test]
    fn names_print_in_presentation_form() {
        assert_eq!(
            name_text(b"\x03api\x07example\x03com\x00"),
            "api.example.com."
        );
        assert_eq!(name_text(b"\x00"), ".");
        assert_eq!(name_text(b""), ".");
        assert_eq!(name_text(b"\x03a.b\x02\\\x01\x00"), "a\\.b.\\\\\\001.");
        // A label running past the end stops the name, never panics.
        assert_eq!(name_text(b"\x01a\x09abc"), "a.");
    }

    #[test]
    fn a_bad_filter_is_refused_with_its_text() {
        let err = parse("nodedns=loud").unwrap_err();
        assert!(err.to_string().contains("nodedns=loud"), "{err}");
        assert!(parse("info,nodedns::query=off").is_ok());
    }
}
