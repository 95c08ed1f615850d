//! A forward target set: selection, deadlines, hedges, retries, failover, admission, health
//! checking.
//!
//! How one query is sent ([`Group::query`]), all inside the caller's task (no task and one timer
//! per query, however many exchanges it takes):
//!
//! - The first exchange goes to the first address of the query's order (the selection policy,
//!   addresses marked down left out, silent ones last), on the newest idle connection.
//! - **Hedge.** When an exchange has been silent (no reply, no error) for its address's
//!   adaptive timeout (`rtt`: SRTT + 4·RTTVAR, at least 50 ms), the query is also sent on
//!   another connection: the next address, or with one address a connection that has answered
//!   since this query began, else a new one (never an older idle connection: behind a ClusterIP
//!   it may lead to the same dead endpoint). The silent exchange keeps waiting beside it; the
//!   first accepted reply wins and every other exchange is dropped, its connection closed: so a
//!   silent connection is retired by the query that found it.
//! - Hedging goes on while it can still find something. A hedge on a connection known to be
//!   alive (it answered since the query began, or its handshake just completed: a dead
//!   endpoint never completes one) that still goes silent means the server is slow on this
//!   query: no further hedge, one duplicate at most. So is a UDP hedge, since a datagram's
//!   silence proves nothing either way. A hedge still connecting at its timeout is on a dead
//!   path (through a ClusterIP a new connection may land on the dead endpoint again until
//!   kube-proxy rewrites its rules): the next one follows one timeout later. At most [`MAX_HEDGES`] hedges, [`PARALLEL`] exchanges
//!   in flight (the oldest silent one makes room), and none towards an address silent as a
//!   whole (`health::SILENT`).
//! - **Failures.** An exchange that fails fast (refused, reset, closed, a rejected reply) is
//!   replaced at once on the next address, up to [`PASSES`] walks of the address list. One that
//!   stays silent for `read_timeout` has failed too.
//! - **Deadline.** The whole query ends within `timeout`.
//!
//! Health is CoreDNS's: a failed exchange starts the checker, more than `max_fails` failed
//! checks in a row mark the address down, any reply marks it up (`health`).

use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use nodedns_wire::Header;
use rand::seq::SliceRandom;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::{Instant, Sleep, sleep, sleep_until, timeout_at};

use crate::dial::{Dial, Tcp};
use crate::health::Health;
use crate::metrics::{self, Held};
use crate::msg::{self, Check};
use crate::pool::{Fault, Pick, Pool};
use crate::rtt::{Rtt, shortest_hedge};
use crate::{Config, ConfigError, Error, Metrics, Net, Selection, Transport, udp};

/// How many times the failures of one query may walk its address list. Attempts that fail fast
/// (refused, reset) start the next one at once; a few passes ride out a CoreDNS pod going away
/// behind a Service without spinning on an upstream that refuses everything.
const PASSES: usize = 3;

/// Exchanges of one query in flight at once, at most.
const PARALLEL: usize = 4;

/// Hedges one query sends at most.
const MAX_HEDGES: u32 = 6;

/// How long a health check waits for its reply (CoreDNS: 1 s), at most the read timeout.
const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// One upstream address: its pool, health, round-trip estimate and metric handles.
#[derive(Debug)]
struct Target<D: Dial> {
    addr: SocketAddr,
    /// A `tls://` upstream: every exchange, health checks included, goes over its pool's
    /// (TLS) connections, never over UDP.
    tls: bool,
    pool: Pool<D>,
    health: Health,
    /// Set while the checker runs, so that failures meanwhile do not queue another round
    /// (CoreDNS's probe: one in progress at most).
    checking: AtomicBool,
    rtt: Rtt,
    metrics: Arc<metrics::Target>,
}

impl<D: Dial> Target<D> {
    /// An exchange with it failed: the health checker starts, unless it already runs.
    fn failed(&self) {
        if !self.checking.swap(true, Ordering::AcqRel) {
            self.health.exchange_failed();
        }
    }
}

/// One `forward` target set: its upstream addresses with a connection pool each, the selection
/// policy, health tracking and the deadline of every query. Cheap to share (hold it in an `Arc`);
/// dropping it stops its background tasks and closes its connections.
///
/// `D` opens the pools' connections: plain TCP, or TLS to the `tls://` addresses ([`Net`]),
/// unless built [`Group::with_dialer`].
#[derive(Debug)]
pub struct Group<D: Dial = Net> {
    config: Config,
    targets: Box<[Arc<Target<D>>]>,
    /// Round-robin position.
    robin: AtomicUsize,
    /// Queries in flight (`max_concurrent`).
    in_flight: AtomicUsize,
    metrics: Metrics,
    /// The health check's message ([`Config::probe`]), built once.
    probe: Arc<[u8]>,
    /// Idle reapers and health checkers, aborted on drop.
    tasks: Vec<AbortHandle>,
}

/// Releases a query's `max_concurrent` place, however the query ends.
struct Admitted<'a>(&'a AtomicUsize);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why an exchange of a query was started (for the metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    First,
    /// An earlier exchange failed.
    Retry,
    /// An earlier exchange went silent.
    Hedge,
}

/// What a query learns from one of its exchanges in flight: written by the exchange, read by
/// the query between polls. Both run in the same task; atomics only because the query's future
/// must be `Send`. 0: waiting for a connection slot (queued, not silent); otherwise the moment
/// the exchange got its slot (µs after the query began, plus one) and whether its path is known
/// to be alive (lowest bit): a connection that answered since the query began or was just
/// opened, or a UDP socket.
#[derive(Debug, Default)]
struct Mark(AtomicU64);

impl Mark {
    fn set(&self, active: Duration, proven: bool) {
        let us = u64::try_from(active.as_micros()).unwrap_or(u64::MAX >> 2);
        self.0
            .store((us + 1) << 1 | u64::from(proven), Ordering::Relaxed);
    }

    /// When the exchange became active (since the query began) and whether it is proven.
    fn get(&self) -> Option<(Duration, bool)> {
        let word = self.0.load(Ordering::Relaxed);
        (word != 0).then(|| (Duration::from_micros((word >> 1) - 1), word & 1 == 1))
    }

    fn clear(&self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// An exchange of a query: to which address, and what the query has decided about it.
#[derive(Debug, Clone, Copy, Default)]
struct Flight {
    live: bool,
    target: usize,
    /// Passed its hedge timeout without a reply.
    silent: bool,
    /// Sent because another exchange of the query went silent.
    hedge: bool,
}

impl Group {
    /// Validates the config (every bad field reported at once) and builds the pools, over plain
    /// TCP, and TLS to the addresses of `config.tls`. Must be called inside a tokio runtime: it
    /// spawns one idle reaper per address and, unless `max_fails` is 0, one health checker per
    /// address.
    ///
    /// An address listed twice is kept once (CoreDNS would just query it twice as often).
    pub fn new(config: Config, metrics: &Metrics) -> Result<Self, ConfigError> {
        let net = Net::new(Tcp, config.tls.as_ref(), metrics);
        Group::with_dialer(config, metrics, net)
    }
}

impl<D: Dial> Group<D> {
    /// As [`Group::new`], with the pools' connections opened by `dial`, which must speak TLS to
    /// the addresses of `config.tls` (as [`Net`] does).
    pub fn with_dialer(
        mut config: Config,
        metrics: &Metrics,
        dial: D,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut seen = Vec::with_capacity(config.addrs.len());
        config.addrs.retain(|a| {
            let new = !seen.contains(a);
            seen.push(*a);
            new
        });
        let dial = Arc::new(dial);
        let targets: Box<[Arc<Target<D>>]> = config
            .addrs
            .iter()
            .map(|&addr| {
                let tls = config.tls.as_ref().is_some_and(|t| t.addrs.contains(&addr));
                let handles = Arc::new(metrics.target(addr, tls));
                Arc::new(Target {
                    addr,
                    tls,
                    pool: Pool::new(
                        addr,
                        config.max_connections,
                        config.expire,
                        dial.clone(),
                        handles.clone(),
                    ),
                    health: Health::new(config.max_fails),
                    checking: AtomicBool::new(false),
                    rtt: Rtt::default(),
                    metrics: handles,
                })
            })
            .collect();
        let probe: Arc<[u8]> = config.probe.query().into();
        let mut tasks = Vec::new();
        for target in targets.iter() {
            let t = target.clone();
            tasks.push(tokio::spawn(async move { t.pool.reap().await }).abort_handle());
            if config.max_fails > 0 {
                let t = target.clone();
                let (transport, every) = (config.transport, config.health_check);
                let timeout = CHECK_TIMEOUT.min(config.read_timeout);
                let query = probe.clone();
                tasks.push(
                    tokio::spawn(async move {
                        check_health(t, &query, transport, every, timeout).await
                    })
                    .abort_handle(),
                );
            }
        }
        Ok(Group {
            config,
            targets,
            robin: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            metrics: metrics.clone(),
            probe,
            tasks,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Queries in flight in the group now, of at most `max_concurrent`: how busy it is, for
    /// work that should give way to clients (a speculative fetch skips a busy group).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether at least one upstream answers as far as the group knows: not marked down, and
    /// not silent (its last exchanges all went unanswered). The caller serves stale answers at
    /// once while this is false.
    pub fn healthy(&self) -> bool {
        self.targets
            .iter()
            .any(|t| !t.health.is_down() && !t.health.is_silent())
    }

    /// Probes every upstream once (`. IN NS`; any reply counts as alive, and marks it up) and
    /// returns true as soon as one answered, false if none did within `timeout`. Used by
    /// readiness at start.
    pub async fn probe(&self) -> bool {
        let mut probes = JoinSet::new();
        for target in self.targets.iter() {
            let (target, query) = (target.clone(), self.probe.clone());
            let (transport, deadline) =
                (self.config.transport, Instant::now() + self.config.timeout);
            probes.spawn(async move {
                let alive = probe(&target, &query, transport, deadline).await;
                if alive {
                    target.health.replied();
                }
                alive
            });
        }
        while let Some(done) = probes.join_next().await {
            if matches!(done, Ok(true)) {
                return true;
            }
        }
        false
    }

    /// Sends `query` (a complete DNS query message; its ID is replaced by a random one per
    /// exchange) and returns the validated reply bytes with the caller's ID restored.
    ///
    /// The whole query, every hedge, retry and failover included, ends within `timeout`; see
    /// the module's documentation for how the exchanges are chosen. Dropping the future
    /// mid-query is safe: the connections it was using are closed, never pooled.
    pub async fn query(&self, query: &[u8]) -> Result<Vec<u8>, Error> {
        if !msg::forwardable(query) {
            return Err(Error::BadQuery);
        }
        let id = Header::read(query).map_or(0, |h| h.id());
        let _admitted = self.admit()?;
        let order = self.order()?;
        let start = Instant::now();
        let marks: [Mark; PARALLEL] = Default::default();
        let new = |target: usize, slot: usize, pick: Pick, why: Why| {
            self.exchange(target, query, start, &marks[slot], pick, why)
        };
        // The first exchange lives in this future (no allocation on the common path).
        let first = pin!(Some(new(order.get(0), 0, Pick::Newest, Why::First)));
        let mut race = Race::new(self, &order, start, &marks, first, new);
        let timer = pin!(sleep_until(race.earliest_wake()));
        let outcome = race.run(timer).await;
        race.retire();
        let mut reply = outcome?;
        nodedns_wire::set_id(&mut reply, id);
        Ok(reply)
    }

    /// Where a hedge of an exchange with `from` goes: the next address of the query's order
    /// that is not silent as a whole (`from` itself, on another connection, when it is the only
    /// one left).
    fn hedge_target(&self, order: &Order, from: usize) -> Option<usize> {
        let at = (0..order.len())
            .position(|k| order.get(k) == from)
            .unwrap_or(0);
        (1..=order.len())
            .map(|step| order.get((at + step) % order.len()))
            .find(|&i| !self.targets[i].health.is_silent())
    }

    fn admit(&self) -> Result<Admitted<'_>, Error> {
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        let admitted = Admitted(&self.in_flight);
        if before >= self.config.max_concurrent {
            self.metrics.max_concurrent_rejects.inc();
            return Err(Error::Overloaded);
        }
        Ok(admitted)
    }

    /// The addresses to try, in order: those not marked down, arranged by the selection policy,
    /// the silent ones last. If all are down, all of them: health checking itself may be what
    /// is broken (CoreDNS does the same, and counts it in
    /// `coredns_forward_healthcheck_broken_total`), unless `failfast_all_unhealthy` says to
    /// fail at once.
    fn order(&self) -> Result<Order, Error> {
        let mut order = Order::default();
        for i in (0..self.targets.len()).filter(|&i| !self.targets[i].health.is_down()) {
            order.push(i);
        }
        if order.is_empty() {
            self.metrics.healthcheck_broken.inc();
            if self.config.failfast_all_unhealthy {
                return Err(Error::AllDown);
            }
            for i in 0..self.targets.len() {
                order.push(i);
            }
        }
        let len = order.len();
        let order_of = order.slice_mut();
        match self.config.selection {
            Selection::Random => order_of.shuffle(&mut rand::rng()),
            Selection::RoundRobin => {
                let first = self.robin.fetch_add(1, Ordering::Relaxed) % len;
                order_of.rotate_left(first);
            }
            Selection::Sequential => {}
        }
        let silent = |i: &u8| self.targets[usize::from(*i)].health.is_silent();
        if order_of.iter().any(silent) {
            // Stable: the policy's order holds among the silent and among the others.
            order_of.sort_by_key(silent);
        }
        Ok(order)
    }

    /// One exchange with address `index`, on a connection `pick` chooses; updates its health,
    /// round-trip estimate and metrics. Bounded by its query (which drops it).
    async fn exchange(
        &self,
        index: usize,
        query: &[u8],
        start: Instant,
        mark: &Mark,
        pick: Pick,
        why: Why,
    ) -> Result<Vec<u8>, Fault> {
        let target = &self.targets[index];
        let m = &target.metrics;
        let _in_flight = Held::new(&m.in_flight);
        m.requests.inc();
        match why {
            Why::First => {}
            Why::Retry => {
                m.retries.inc();
            }
            Why::Hedge => {
                m.hedges.inc();
            }
        }
        // The first exchange begins with its query.
        let begun = match why {
            Why::First => start,
            Why::Retry | Why::Hedge => Instant::now(),
        };
        let result = match self.config.transport {
            // Boxed: the common path (TCP) does not carry the UDP exchange's state.
            Transport::PreferUdp if !target.tls => {
                Box::pin(udp_first(target, query, start, mark)).await
            }
            Transport::Tcp | Transport::PreferUdp => {
                tcp(target, query, start, begun, mark, pick).await
            }
        };
        match result {
            Ok((reply, active)) => {
                let now = Instant::now();
                m.reply(msg::rcode(&reply), now - begun);
                target.rtt.sample(now - active);
                if target.health.replied() {
                    tracing::info!(upstream = %target.addr, "upstream answered again, marked up");
                }
                Ok(reply)
            }
            Err(fault) => {
                if fault.counts_against_upstream() {
                    target.failed();
                }
                tracing::debug!(upstream = %target.addr, ?fault, "exchange failed");
                Err(fault)
            }
        }
    }

    #[cfg(test)]
    fn target(&self, addr: SocketAddr) -> &Target<D> {
        self.targets
            .iter()
            .find(|t| t.addr == addr)
            .expect("address in the group")
    }

    /// Every change of `addr`'s down mark (tests of other modules).
    #[cfg(test)]
    pub(crate) fn down_mark(&self, addr: SocketAddr) -> tokio::sync::watch::Receiver<bool> {
        self.target(addr).health.subscribe()
    }
}

/// The addresses one query tries, in order: indices into the group's targets, in place (a
/// group has [`crate::MAX_ADDRS`] at most), so that choosing them allocates nothing.
#[derive(Debug, Clone, Copy, Default)]
struct Order {
    at: [u8; crate::MAX_ADDRS],
    len: u8,
}

impl Order {
    fn push(&mut self, index: usize) {
        self.at[usize::from(self.len)] = index as u8;
        self.len += 1;
    }

    fn len(&self) -> usize {
        usize::from(self.len)
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn get(&self, k: usize) -> usize {
        usize::from(self.at[k])
    }

    fn slice_mut(&mut self) -> &mut [u8] {
        &mut self.at[..usize::from(self.len)]
    }
}

/// The exchanges of one query in flight, and what decides the next one ([`Group::query`]).
/// Polled by the query's own task; `F` is the exchange future, `N` makes one.
struct Race<'a, D: Dial, F, N> {
    group: &'a Group<D>,
    order: &'a Order,
    start: Instant,
    deadline: Instant,
    marks: &'a [Mark; PARALLEL],
    flights: [Flight; PARALLEL],
    /// Flight 0's exchange, inside the query's future.
    first: Pin<&'a mut Option<F>>,
    /// The other flights' exchanges, boxed when a hedge or a retry needs them.
    others: [Option<Pin<Box<F>>>; PARALLEL - 1],
    new: N,
    /// Where the next replacement goes in `order`.
    next: usize,
    /// Replacements of failed exchanges left (the passes), and failed ones not replaced yet
    /// (waiting for room).
    failures_left: usize,
    owed: usize,
    hedges_left: u32,
    /// Whether hedging can still find something.
    exploring: bool,
    timed_out: bool,
    bad_reply: bool,
}

impl<'a, D, F, N> Race<'a, D, F, N>
where
    D: Dial,
    F: Future<Output = Result<Vec<u8>, Fault>>,
    N: Fn(usize, usize, Pick, Why) -> F,
{
    fn new(
        group: &'a Group<D>,
        order: &'a Order,
        start: Instant,
        marks: &'a [Mark; PARALLEL],
        first: Pin<&'a mut Option<F>>,
        new: N,
    ) -> Self {
        let mut flights = [Flight::default(); PARALLEL];
        flights[0] = Flight {
            live: true,
            target: order.get(0),
            silent: false,
            hedge: false,
        };
        Race {
            group,
            order,
            start,
            deadline: start + group.config.timeout,
            marks,
            flights,
            first,
            others: std::array::from_fn(|_| None),
            new,
            next: 1,
            failures_left: PASSES * order.len() - 1,
            owed: 0,
            hedges_left: MAX_HEDGES,
            exploring: true,
            timed_out: false,
            bad_reply: false,
        }
    }

    /// The earliest moment anything can fall due: no hedge comes sooner after an exchange
    /// began than [`shortest_hedge`], no expiry sooner than the read timeout (which that is
    /// never longer than), no deadline sooner than the timeout.
    fn earliest_wake(&self) -> Instant {
        let config = &self.group.config;
        self.start + shortest_hedge(config.read_timeout).min(config.timeout)
    }

    /// Runs until a reply is accepted, every exchange has failed, or the deadline; sleeps on
    /// `timer` alone, set first to [`Race::earliest_wake`].
    ///
    /// The timer is moved earlier at once, but later only once it has fired: moving a
    /// registered timer takes it out of the runtime's timer wheel and puts it back, and on the
    /// common path (a slot, a write, a reply within the hedge timeout) the timer never fires
    /// and is set once. A query still waiting at the earliest wake is looked at once more.
    async fn run(&mut self, mut timer: Pin<&mut Sleep>) -> Result<Vec<u8>, Error> {
        poll_fn(|cx| {
            loop {
                if let Some(reply) = self.poll_exchanges(cx) {
                    return Poll::Ready(Ok(reply));
                }
                let now = Instant::now();
                if now >= self.deadline {
                    return Poll::Ready(Err(Error::Timeout));
                }
                self.expire(now);
                if self.replace() {
                    continue;
                }
                let hedge_at = match self.hedge(now) {
                    Hedge::Sent => continue,
                    Hedge::Due(at) => Some(at),
                    Hedge::None => None,
                };
                if let Some(error) = self.failed() {
                    return Poll::Ready(Err(error));
                }
                let wake = self.wake(hedge_at);
                let timer_at = timer.deadline();
                if wake < timer_at || timer_at <= now {
                    timer.as_mut().reset(wake);
                }
                if timer.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
        })
        .await
    }

    /// Polls every exchange in flight; returns the first accepted reply, and notes (and drops)
    /// the ones that failed.
    fn poll_exchanges(&mut self, cx: &mut Context<'_>) -> Option<Vec<u8>> {
        for i in 0..PARALLEL {
            if !self.flights[i].live {
                continue;
            }
            let polled = match i {
                0 => self.first.as_mut().as_pin_mut().map(|f| f.poll(cx)),
                _ => self.others[i - 1].as_mut().map(|f| f.as_mut().poll(cx)),
            };
            match polled {
                Some(Poll::Ready(Ok(reply))) => return Some(reply),
                Some(Poll::Ready(Err(fault))) => {
                    match fault {
                        Fault::BadReply => self.bad_reply = true,
                        Fault::Timeout => self.timed_out = true,
                        Fault::Refused | Fault::Closed => {}
                    }
                    self.end(i);
                    self.owed += 1;
                }
                Some(Poll::Pending) | None => {}
            }
        }
        None
    }

    /// Exchanges silent for the whole read timeout have failed.
    fn expire(&mut self, now: Instant) {
        let read_timeout = self.group.config.read_timeout;
        for i in 0..PARALLEL {
            let active = self.marks[i].get().map(|(at, _)| self.start + at);
            if self.flights[i].live && active.is_some_and(|at| at + read_timeout <= now) {
                let target = &self.group.targets[self.flights[i].target];
                tracing::debug!(upstream = %target.addr, "no reply within read_timeout");
                target.failed();
                self.timed_out = true;
                self.end(i);
                self.owed += 1;
            }
        }
    }

    /// Replaces a failed exchange at once, on the next address, while the passes last. Returns
    /// whether it sent one.
    fn replace(&mut self) -> bool {
        if self.failures_left == 0 {
            self.owed = 0;
        }
        let Some(slot) = self.free().filter(|_| self.owed > 0) else {
            return false;
        };
        self.owed -= 1;
        self.failures_left -= 1;
        let target = self.order.get(self.next % self.order.len());
        self.next += 1;
        self.launch(slot, target, Pick::Newest, Why::Retry);
        true
    }

    /// Hedges the newest exchange that is talking if it has been silent for its address's
    /// timeout. None while an exchange waits for a connection slot: the pool is saturated, more
    /// exchanges would not help.
    fn hedge(&mut self, now: Instant) -> Hedge {
        if !self.exploring || self.hedges_left == 0 {
            return Hedge::None;
        }
        let mut newest = None;
        for i in (0..PARALLEL).filter(|&i| self.flights[i].live) {
            match self.marks[i].get() {
                None => return Hedge::None,
                Some((at, proven)) if newest.is_none_or(|(_, last, _)| at > last) => {
                    newest = Some((i, at, proven));
                }
                Some(_) => {}
            }
        }
        let Some((i, at, proven)) = newest else {
            return Hedge::None;
        };
        let from = self.flights[i].target;
        let target = &self.group.targets[from];
        let due = self.start + at + target.rtt.hedge_after(self.group.config.read_timeout);
        if due > now {
            return Hedge::Due(due);
        }
        if !self.flights[i].silent {
            self.flights[i].silent = true;
            target.health.went_silent();
        }
        let to = self.group.hedge_target(self.order, from);
        let (Some(to), false) = (to, proven && self.flights[i].hedge) else {
            // A hedge on a live path is silent too: the server is slow on this query. Or
            // nowhere left to try.
            self.exploring = false;
            return Hedge::None;
        };
        let Some(slot) = self.free().or_else(|| self.evictable(i)) else {
            // No room: an exchange that ends makes some, and wakes the query.
            return Hedge::None;
        };
        if self.flights[slot].live {
            // The oldest silent exchange makes room: it has failed.
            self.group.targets[self.flights[slot].target].failed();
            self.timed_out = true;
            self.end(slot);
        }
        self.hedges_left -= 1;
        // With one address, another connection of its own: one that answered meanwhile, or a
        // new one (an older idle one may share the silent one's fate).
        let pick = if to == from {
            Pick::AnsweredAfter(self.start)
        } else {
            Pick::Newest
        };
        self.launch(slot, to, pick, Why::Hedge);
        Hedge::Sent
    }

    /// The error, once nothing is in flight.
    fn failed(&self) -> Option<Error> {
        if self.flights.iter().any(|f| f.live) {
            return None;
        }
        Some(if self.bad_reply {
            Error::BadReply
        } else if self.timed_out {
            Error::Timeout
        } else {
            Error::Unreachable
        })
    }

    /// When to look again: the next hedge, read timeout or the deadline.
    fn wake(&self, hedge_at: Option<Instant>) -> Instant {
        let mut wake = hedge_at.unwrap_or(self.deadline).min(self.deadline);
        for (flight, mark) in self.flights.iter().zip(self.marks) {
            if let (true, Some((at, _))) = (flight.live, mark.get()) {
                wake = wake.min(self.start + at + self.group.config.read_timeout);
            }
        }
        wake
    }

    fn free(&self) -> Option<usize> {
        self.flights.iter().position(|f| !f.live)
    }

    /// The flight to drop to make room for a hedge: the oldest silent one that had not proven
    /// alive, never `keep` (the one being hedged).
    fn evictable(&self, keep: usize) -> Option<usize> {
        (0..PARALLEL)
            .filter(|&i| i != keep && self.flights[i].live && self.flights[i].silent)
            .filter_map(|i| self.marks[i].get().map(|(at, proven)| (i, at, proven)))
            .filter(|&(_, _, proven)| !proven)
            .min_by_key(|&(_, at, _)| at)
            .map(|(i, _, _)| i)
    }

    /// Puts a new exchange with address `target` in flight `slot`.
    fn launch(&mut self, slot: usize, target: usize, pick: Pick, why: Why) {
        let exchange = (self.new)(target, slot, pick, why);
        match slot {
            0 => self.first.set(Some(exchange)),
            _ => self.others[slot - 1] = Some(Box::pin(exchange)),
        }
        self.flights[slot] = Flight {
            live: true,
            target,
            silent: false,
            hedge: why == Why::Hedge,
        };
    }

    /// Drops flight `slot`'s exchange (closing its connection) and frees its mark.
    fn end(&mut self, slot: usize) {
        self.flights[slot].live = false;
        match slot {
            0 => self.first.set(None),
            _ => self.others[slot - 1] = None,
        }
        self.marks[slot].clear();
    }

    /// Once the query is over: every exchange still in flight is dropped (its connection
    /// closed); a silent one has failed.
    fn retire(&mut self) {
        for slot in 0..PARALLEL {
            if self.flights[slot].live {
                if self.flights[slot].silent {
                    self.group.targets[self.flights[slot].target].failed();
                }
                self.end(slot);
            }
        }
    }
}

/// What [`Race::hedge`] did.
enum Hedge {
    Sent,
    /// Not yet: at this moment.
    Due(Instant),
    None,
}

impl<D: Dial> Drop for Group<D> {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// One exchange over UDP (`prefer_udp`), asked again over TCP when the reply is truncated.
/// Returns the reply and when the exchange started.
async fn udp_first<D: Dial>(
    target: &Target<D>,
    query: &[u8],
    start: Instant,
    mark: &Mark,
) -> Result<(Vec<u8>, Instant), Fault> {
    let m = &target.metrics;
    m.udp_misses.inc();
    let active = Instant::now();
    // A datagram's silence says nothing about the path: a UDP hedge is never followed by
    // another.
    mark.set(active - start, true);
    match udp::exchange(target.addr, query, Check::Answer(query)).await {
        Ok(reply) if msg::truncated(&reply) => {
            // The answer does not fit a datagram: ask again over TCP, same address.
            m.requests.inc();
            m.retries.inc();
            tcp(target, query, start, Instant::now(), mark, Pick::Newest).await
        }
        Ok(reply) => Ok((reply, active)),
        Err(fault) => Err(fault),
    }
}

/// One exchange over a pooled TCP (or TLS) connection. Returns the reply and when the exchange
/// got its connection slot (the start of its round trip, for the estimator).
async fn tcp<D: Dial>(
    target: &Target<D>,
    query: &[u8],
    start: Instant,
    begun: Instant,
    mark: &Mark,
    pick: Pick,
) -> Result<(Vec<u8>, Instant), Fault> {
    let (slot, waited) = target.pool.slot().await.ok_or(Fault::Refused)?;
    // The round trip starts with the slot; one taken at once was taken when the exchange began.
    let active = if waited { Instant::now() } else { begun };
    let since_start = active - start;
    mark.set(since_start, false);
    let mut lease = target.pool.lease(slot, pick).await?;
    // Alive: it answered since the query began, or its handshake just completed.
    if lease.answered().is_none_or(|at| at > start) {
        mark.set(since_start, true);
    }
    let reply = lease.exchange(query).await?;
    lease.release();
    Ok((reply, active))
}

/// Sends the health check `query` (`. IN NS` unless configured otherwise) to the target, on a
/// connection of its own (over TLS to a `tls://` upstream, as CoreDNS checks it); any reply
/// before `deadline` means it is alive.
async fn probe<D: Dial>(
    target: &Target<D>,
    query: &[u8],
    transport: Transport,
    deadline: Instant,
) -> bool {
    match transport {
        Transport::PreferUdp if !target.tls => {
            timeout_at(deadline, udp::exchange(target.addr, query, Check::Alive))
                .await
                .unwrap_or(Err(Fault::Timeout))
        }
        Transport::Tcp | Transport::PreferUdp => {
            target
                .pool
                .exchange_once(query, Check::Alive, deadline)
                .await
        }
    }
    .is_ok()
}

/// CoreDNS's health checking: once an exchange with the address failed, checks it at once and
/// then every `every` until a check is answered; each check without a reply within `timeout`
/// counts towards the down mark (`Health::check_failed`). Runs until aborted.
async fn check_health<D: Dial>(
    target: Arc<Target<D>>,
    query: &[u8],
    transport: Transport,
    every: Duration,
    timeout: Duration,
) {
    loop {
        target.health.exchange_failure().await;
        loop {
            if probe(&target, query, transport, Instant::now() + timeout).await {
                if target.health.replied() {
                    tracing::info!(upstream = %target.addr, "health check answered, marked up");
                }
                break;
            }
            target.metrics.healthcheck_failures.inc();
            if target.health.check_failed() {
                tracing::warn!(upstream = %target.addr, "health checks unanswered, upstream marked down");
            }
            sleep(every).await;
        }
        target.checking.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::sync::atomic::Ordering::SeqCst;

    use prometheus_client::registry::Registry;

    use super::*;
    use crate::Probe;
    use crate::health::SILENT;
    use crate::rtt::{INITIAL_HEDGE, MIN_HEDGE};
    use crate::scripted::{
        Dnat, Memory, Mode, SERVER_IDLE, Unmovable, Upstream, query, read_reply, refusing_addr,
    };

    /// A ClusterIP: what the tests with [`Dnat`] forward to.
    const SERVICE: SocketAddr =
        SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::new(10, 96, 0, 11)), 53);

    fn config(addrs: &[SocketAddr]) -> Config {
        Config {
            addrs: addrs.to_vec(),
            selection: Selection::Sequential,
            timeout: Duration::from_millis(500),
            health_check: Duration::from_millis(20),
            ..Config::default()
        }
    }

    /// A group whose TCP connections are in-memory pipes to the scripted upstreams.
    fn group(config: Config) -> Group<Memory> {
        group_with(config, &Metrics::register(&mut Registry::default()))
    }

    fn group_with(config: Config, metrics: &Metrics) -> Group<Memory> {
        Group::with_dialer(config, metrics, Memory).expect("valid config")
    }

    /// A group forwarding to [`SERVICE`], whose connections `dnat` spreads over its endpoints.
    fn behind(dnat: &Dnat, config: Config) -> Group<Dnat> {
        let metrics = Metrics::register(&mut Registry::default());
        Group::with_dialer(config, &metrics, dnat.clone()).expect("valid config")
    }

    fn tag(n: u8) -> Option<Ipv4Addr> {
        Some(Ipv4Addr::new(192, 0, 2, n))
    }

    /// Asks for `name` with ID 0x4242 and checks the reply answers it with that ID.
    async fn ask<D: Dial>(group: &Group<D>, name: &str) -> Result<Option<Ipv4Addr>, Error> {
        let reply = group.query(&query(name, 0x4242)).await?;
        let (id, ip, qname) = read_reply(&reply);
        assert_eq!(id, 0x4242, "the caller's ID is restored");
        assert_eq!(qname, name, "the reply answers the question asked");
        Ok(ip)
    }

    #[tokio::test(start_paused = true)]
    async fn sequential_queries_reuse_one_connection() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let g = group(config(&[up.addr]));
        for i in 0..20 {
            assert_eq!(ask(&g, &format!("q{i}.example.")).await, Ok(tag(1)));
        }
        assert_eq!(up.stats().accepted.load(SeqCst), 1);
        let m = &g.target(up.addr).metrics;
        assert_eq!(
            (m.connects.get(), m.tcp_hits.get(), m.connections.get()),
            (1, 19, 1)
        );
        assert_eq!(m.requests.get(), 20);
        assert_eq!((m.retries.get(), m.hedges.get()), (0, 0));
    }

    /// Runs `ask` on a runtime of its own (a current-thread one, as the agent's UDP workers
    /// have), on a blocking thread, and ends the runtime with it.
    async fn ask_on_own_runtime<D: Dial>(
        g: &Arc<Group<D>>,
        name: &str,
    ) -> Result<Option<Ipv4Addr>, Error> {
        let (g, name) = (g.clone(), name.to_owned());
        tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(ask(&g, &name))
        })
        .await
        .expect("no panic")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn an_idle_connection_moves_to_the_runtime_that_needs_one() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let g = Arc::new(group(config(&[up.addr])));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        for i in 0..3 {
            let answer = ask_on_own_runtime(&g, &format!("r{i}.example.")).await;
            assert_eq!(answer, Ok(tag(1)));
        }
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        // One connection, moved to each runtime that asked, and back.
        assert_eq!(up.stats().accepted.load(SeqCst), 1);
        let m = &g.target(up.addr).metrics;
        assert_eq!(
            (m.connects.get(), m.tcp_hits.get(), m.moves.get()),
            (1, 4, 4)
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn each_runtime_reuses_its_own_idle_connection_first() {
        let up = Upstream::start(Mode::Hold, 1).await;
        let g = Arc::new(group(Config {
            timeout: Duration::from_secs(30),
            ..config(&[up.addr])
        }));
        let other = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        // A query on each runtime at once: two connections, one opened by each.
        let (theirs, mine) = (g.clone(), g.clone());
        let on_other = tokio::task::spawn_blocking(move || {
            let answer = other.block_on(ask(&theirs, "o1.example."));
            (other, answer)
        });
        let here = tokio::spawn(async move { ask(&mine, "h1.example.").await });
        up.until("two held queries", |s| s.tcp_queries.load(SeqCst) == 2)
            .await;
        up.set_mode(Mode::Answer);
        up.release(2);
        assert_eq!(here.await.expect("no panic"), Ok(tag(1)));
        let (other, answer) = on_other.await.expect("no panic");
        assert_eq!(answer, Ok(tag(1)));
        let theirs = g.clone();
        let other = tokio::task::spawn_blocking(move || {
            assert_eq!(other.block_on(ask(&theirs, "o2.example.")), Ok(tag(1)));
            other
        })
        .await
        .expect("no panic");
        assert_eq!(ask(&g, "h2.example.").await, Ok(tag(1)));
        let m = &g.target(up.addr).metrics;
        assert_eq!(
            (m.connects.get(), m.tcp_hits.get(), m.moves.get()),
            (2, 2, 0)
        );
        tokio::task::spawn_blocking(move || drop(other))
            .await
            .expect("no panic");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn connections_that_cannot_move_stay_and_the_oldest_idle_one_makes_room() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let metrics = Metrics::register(&mut Registry::default());
        let g = Arc::new(
            Group::with_dialer(
                Config {
                    max_connections: 2,
                    ..config(&[up.addr])
                },
                &metrics,
                Unmovable,
            )
            .expect("valid config"),
        );
        for i in 0..4 {
            let answer = ask_on_own_runtime(&g, &format!("r{i}.example.")).await;
            assert_eq!(answer, Ok(tag(1)));
            let open = g.target(up.addr).metrics.connections.get();
            assert_eq!(open, (i + 1).min(2), "after the query of runtime {i}");
        }
        // Four runtimes, a connection each; the third and fourth dial closed the oldest idle one.
        assert_eq!(up.stats().accepted.load(SeqCst), 4);
        assert_eq!(g.target(up.addr).metrics.moves.get(), 0);
        up.until("two closed by the client", |s| {
            s.client_closed.load(SeqCst) == 2 && s.open.load(SeqCst) == 2
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrency_grows_the_pool_up_to_max_connections_and_no_further() {
        let up = Upstream::start(Mode::Hold, 1).await;
        let g = Arc::new(group(Config {
            max_connections: 8,
            timeout: Duration::from_secs(30),
            ..config(&[up.addr])
        }));
        let mut queries = JoinSet::new();
        for i in 0..200 {
            let g = g.clone();
            queries.spawn(async move { ask(&g, &format!("c{i}.example.")).await });
        }
        // Eight queries held by the upstream, each on a connection of its own; the others wait
        // for a slot instead of dialing.
        up.until("eight held queries", |s| s.tcp_queries.load(SeqCst) == 8)
            .await;
        assert_eq!(up.stats().accepted.load(SeqCst), 8);
        up.set_mode(Mode::Answer);
        up.release(8);
        while let Some(done) = queries.join_next().await {
            assert_eq!(done.expect("no panic"), Ok(tag(1)));
        }
        let stats = up.stats();
        assert_eq!(stats.accepted.load(SeqCst), 8, "{stats:?}");
        assert_eq!(stats.max_open.load(SeqCst), 8, "{stats:?}");
        // More if the machine held the release past a hedge timeout: hedges wait for a slot.
        assert!(stats.tcp_queries.load(SeqCst) >= 200, "{stats:?}");
        assert_eq!(g.target(up.addr).metrics.connections.get(), 8);
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_the_server_closed_while_idle_is_replaced_transparently() {
        let up = Upstream::start(Mode::CloseAfter(1), 1).await;
        let g = group(Config {
            max_fails: 1,
            ..config(&[up.addr])
        });
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        up.until("the server closed the connection", |s| {
            s.open.load(SeqCst) == 0
        })
        .await;
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
        let t = g.target(up.addr);
        assert!(
            !t.health.is_down(),
            "a closed idle connection is not an upstream failure"
        );
        assert_eq!(t.metrics.connects.get(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reused_connection_closed_with_the_query_in_flight_is_retried_on_a_fresh_one() {
        let up = Upstream::start(Mode::DropAfter(1), 1).await;
        let g = group(Config {
            max_fails: 1,
            ..config(&[up.addr])
        });
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        // The second query goes out on the pooled connection; the server reads it and closes.
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        let t = g.target(up.addr);
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
        assert_eq!(up.stats().tcp_queries.load(SeqCst), 3);
        assert_eq!((t.metrics.resets.get(), t.metrics.retries.get()), (1, 1));
        assert!(
            !t.health.is_down(),
            "a stale pooled connection is not an upstream failure"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_reset_mid_flight_is_retried_on_the_other_address() {
        let bad = Upstream::start(Mode::Reset, 1).await;
        let good = Upstream::start(Mode::Answer, 2).await;
        // No health checks: they would reach `bad` too.
        let g = group(Config {
            max_fails: 0,
            ..config(&[bad.addr, good.addr])
        });
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));
        assert_eq!(bad.stats().tcp_queries.load(SeqCst), 1);
        assert_eq!(g.target(bad.addr).metrics.resets.get(), 1);
        assert_eq!(g.target(good.addr).metrics.retries.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reset_on_the_only_address_is_retried_on_a_new_connection() {
        let up = Upstream::start(Mode::ResetFirst(1), 1).await;
        let g = group(Config {
            max_fails: 0,
            ..config(&[up.addr])
        });
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
        let m = &g.target(up.addr).metrics;
        assert_eq!((m.resets.get(), m.retries.get()), (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_upstream_times_out_at_the_deadline() {
        let up = Upstream::start(Mode::Silent, 1).await;
        let timeout = Duration::from_millis(200);
        let g = group(Config {
            timeout,
            ..config(&[up.addr])
        });
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Err(Error::Timeout));
        assert_eq!(start.elapsed(), timeout, "neither early nor late");
        assert_eq!(
            g.target(up.addr).metrics.connections.get(),
            0,
            "the silent connection is closed"
        );
    }

    /// A query waiting for its pool slot has no exchange in flight: its timer fires at the
    /// earliest moment a hedge could fall due, finds nothing due, and is moved to the deadline,
    /// which still bounds the wait and the exchange after it.
    #[tokio::test(start_paused = true)]
    async fn a_query_that_waited_for_its_slot_still_ends_at_its_deadline() {
        let up = Upstream::start(Mode::Silent, 1).await;
        let timeout = Duration::from_millis(300);
        let g = Arc::new(group(Config {
            max_connections: 1,
            timeout,
            ..config(&[up.addr])
        }));
        let first = tokio::spawn({
            let g = g.clone();
            async move { ask(&g, "a.example.").await }
        });
        up.until("the first query", |s| s.tcp_queries.load(SeqCst) == 1)
            .await;
        tokio::time::advance(Duration::from_millis(100)).await;
        // The only slot is the first query's until its deadline, 200 ms from now; this one's
        // deadline is 300 ms from now, before its own hedge could fall due.
        let asked = Instant::now();
        assert_eq!(ask(&g, "b.example.").await, Err(Error::Timeout));
        assert_eq!(asked.elapsed(), timeout, "neither early nor late");
        assert_eq!(first.await.expect("no panic"), Err(Error::Timeout));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_upstream_fails_over_to_the_second_address_in_time() {
        let silent = Upstream::start(Mode::Silent, 1).await;
        let good = Upstream::start(Mode::Answer, 2).await;
        let timeout = Duration::from_millis(400);
        let g = group(Config {
            timeout,
            ..config(&[silent.addr, good.addr])
        });
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));
        // The silent one is hedged to the second one after its timeout (nothing measured yet:
        // the initial one), which answers at once.
        assert_eq!(start.elapsed(), INITIAL_HEDGE);
        assert_eq!(good.stats().tcp_queries.load(SeqCst), 1);
        assert_eq!(g.target(good.addr).metrics.hedges.get(), 1);
        // Once answered, the silent exchange is dropped and its connection closed.
        silent
            .until("the silent connection closed", |s| {
                s.client_closed.load(SeqCst) == 1
            })
            .await;
        assert_eq!(start.elapsed(), INITIAL_HEDGE);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reply_with_the_wrong_id_is_rejected() {
        let up = Upstream::start(Mode::WrongId, 1).await;
        let g = group(config(&[up.addr]));
        assert_eq!(ask(&g, "a.example.").await, Err(Error::BadReply));
        assert_eq!(
            up.stats().accepted.load(SeqCst),
            PASSES,
            "each bad reply closed its connection"
        );
        assert_eq!(g.target(up.addr).metrics.connections.get(), 0);

        let good = Upstream::start(Mode::Answer, 2).await;
        let g = group(config(&[up.addr, good.addr]));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_reply_to_another_question_is_rejected() {
        let up = Upstream::start(Mode::WrongQuestion, 1).await;
        let g = group(config(&[up.addr]));
        assert_eq!(ask(&g, "a.example.").await, Err(Error::BadReply));

        let good = Upstream::start(Mode::Answer, 2).await;
        let g = group(config(&[up.addr, good.addr]));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));
    }

    #[tokio::test]
    async fn a_spoofed_udp_datagram_is_ignored_and_the_real_reply_accepted() {
        let up = Upstream::start(Mode::SpoofFirst, 1).await;
        let g = group(Config {
            transport: Transport::PreferUdp,
            ..config(&[up.addr])
        });
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().udp_queries.load(SeqCst), 1);
    }

    // Real UDP under the paused clock: the outcome is the timeout whatever the sockets do.
    #[tokio::test(start_paused = true)]
    async fn a_silent_udp_upstream_times_out_at_the_deadline() {
        let up = Upstream::start(Mode::Silent, 1).await;
        let timeout = Duration::from_millis(100);
        let g = group(Config {
            transport: Transport::PreferUdp,
            timeout,
            ..config(&[up.addr])
        });
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Err(Error::Timeout));
        assert_eq!(start.elapsed(), timeout);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_connection_fails_over() {
        let refused = refusing_addr().await;
        let good = Upstream::start(Mode::Answer, 2).await;
        let g = group(config(&[refused, good.addr]));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));

        let g = group(config(&[refused]));
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Err(Error::Unreachable));
        assert_eq!(start.elapsed(), Duration::ZERO, "refusal fails fast");
        let m = &g.target(refused).metrics;
        assert_eq!(
            (m.requests.get(), m.retries.get()),
            (PASSES as u64, PASSES as u64 - 1),
            "one attempt per pass"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_exchange_starts_health_checks_and_more_than_max_fails_mark_down() {
        let flaky = Upstream::start(Mode::Reset, 1).await;
        let good = Upstream::start(Mode::Answer, 2).await;
        let every = Duration::from_millis(20);
        let g = group(Config {
            max_fails: 2,
            health_check: every,
            ..config(&[flaky.addr, good.addr])
        });
        let t = g.target(flaky.addr);
        let mut down = t.health.subscribe();
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));
        assert!(
            !t.health.is_down(),
            "a failed exchange is not a failed check"
        );

        // The failure started the checker: a check at once, then every `health_check`; the
        // third in a row without a reply (more than max_fails) marks it down.
        down.wait_for(|d| *d).await.expect("health alive");
        assert_eq!(start.elapsed(), every * 2);
        assert_eq!(t.metrics.healthcheck_failures.get(), 3);
        assert_eq!(flaky.stats().tcp_queries.load(SeqCst), 1 + 3);
        assert!(g.healthy(), "the other address is up");

        // Down: queries skip it (the good one gets a first attempt, not a retry).
        let retries = g.target(good.addr).metrics.retries.get();
        assert_eq!(ask(&g, "c.example.").await, Ok(tag(2)));
        assert_eq!(g.target(good.addr).metrics.retries.get(), retries);

        // The checks go on until one is answered, which marks it up.
        flaky.set_mode(Mode::Answer);
        down.wait_for(|d| !*d).await.expect("health alive");
        assert_eq!(start.elapsed(), every * 3);
        assert_eq!(t.metrics.requests.get(), 1, "checks are not queries");
        assert_eq!(
            ask(&g, "d.example.").await,
            Ok(tag(1)),
            "back in first place"
        );
        // Answered: the checker is idle until the next failure.
        tokio::time::sleep(every * 10).await;
        assert_eq!(flaky.stats().tcp_queries.load(SeqCst), 1 + 4 + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn replies_between_failed_checks_keep_an_address_up() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let every = Duration::from_millis(20);
        let g = group(Config {
            max_fails: 1,
            health_check: every,
            ..config(&[up.addr])
        });
        let t = g.target(up.addr);
        // Checks fail (a check is told apart from queries by the health module only: here by
        // hand), but every query in between is answered: never down.
        for _ in 0..10 {
            t.health.check_failed();
            assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
            assert!(!t.health.is_down());
        }
        t.health.check_failed();
        assert!(t.health.check_failed(), "two in a row without a reply");
    }

    /// A refusing upstream, and its group once one query failed and two checks (at once and an
    /// hour later: more than `max_fails` 1) marked it down.
    async fn marked_down(failfast_all_unhealthy: bool) -> (Upstream, Metrics, Group<Memory>) {
        let up = Upstream::start(Mode::Reset, 1).await;
        let metrics = Metrics::register(&mut Registry::default());
        let g = group_with(
            Config {
                max_fails: 1,
                health_check: Duration::from_secs(3600),
                failfast_all_unhealthy,
                ..config(&[up.addr])
            },
            &metrics,
        );
        let mut down = g.target(up.addr).health.subscribe();
        assert_eq!(ask(&g, "a.example.").await, Err(Error::Unreachable));
        down.wait_for(|d| *d).await.expect("health alive");
        assert!(!g.healthy());
        (up, metrics, g)
    }

    #[tokio::test(start_paused = true)]
    async fn when_every_address_is_down_they_are_tried_anyway() {
        let (up, metrics, g) = marked_down(false).await;
        up.set_mode(Mode::Answer);
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        assert_eq!(metrics.healthcheck_broken.get(), 1);
        assert!(g.healthy(), "the reply marked it up");
    }

    #[tokio::test(start_paused = true)]
    async fn failfast_all_unhealthy_fails_at_once_when_every_address_is_down() {
        let (up, metrics, g) = marked_down(true).await;
        let sent = up.stats().tcp_queries.load(SeqCst);
        let start = Instant::now();
        assert_eq!(ask(&g, "b.example.").await, Err(Error::AllDown));
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(up.stats().tcp_queries.load(SeqCst), sent, "not sent");
        assert_eq!(metrics.healthcheck_broken.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn zero_max_fails_never_marks_down() {
        let up = Upstream::start(Mode::Reset, 1).await;
        let g = group(Config {
            max_fails: 0,
            ..config(&[up.addr])
        });
        for _ in 0..3 {
            assert_eq!(ask(&g, "a.example.").await, Err(Error::Unreachable));
        }
        assert!(g.healthy());
    }

    #[tokio::test(start_paused = true)]
    async fn beyond_max_concurrent_a_query_fails_at_once() {
        let up = Upstream::start(Mode::Hold, 1).await;
        let metrics = Metrics::register(&mut Registry::default());
        let g = group_with(
            Config {
                max_concurrent: 2,
                timeout: Duration::from_secs(5),
                ..config(&[up.addr])
            },
            &metrics,
        );
        let held = async { tokio::join!(ask(&g, "a.example."), ask(&g, "b.example.")) };
        let extra = async {
            up.until("two held queries", |s| s.tcp_queries.load(SeqCst) == 2)
                .await;
            let start = Instant::now();
            let third = ask(&g, "c.example.").await;
            assert_eq!(start.elapsed(), Duration::ZERO, "rejected at once");
            up.release(2);
            third
        };
        let ((a, b), third) = tokio::join!(held, extra);
        assert_eq!(third, Err(Error::Overloaded));
        assert_eq!((a, b), (Ok(tag(1)), Ok(tag(1))));
        assert_eq!(metrics.max_concurrent_rejects.get(), 1);
        up.release(1);
        assert_eq!(
            ask(&g, "d.example.").await,
            Ok(tag(1)),
            "places are given back"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn idle_connections_are_closed_after_expire_before_coredns_would() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let expire = Config::default().expire;
        assert!(expire < SERVER_IDLE);
        let g = group(Config {
            expire,
            ..config(&[up.addr])
        });
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        let idle_since = Instant::now();
        up.until("the client closed the idle connection", |s| {
            s.client_closed.load(SeqCst) == 1
        })
        .await;
        assert_eq!(idle_since.elapsed(), expire);
        assert_eq!(up.stats().server_closed_idle.load(SeqCst), 0);
        let t = g.target(up.addr);
        assert_eq!((t.pool.idle_count(), t.metrics.connections.get()), (0, 0));
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickle_of_queries_keeps_the_newest_connection_and_lets_the_rest_expire() {
        let up = Upstream::start(Mode::Hold, 1).await;
        let expire = Duration::from_millis(100);
        let g = group(Config {
            expire,
            timeout: Duration::from_secs(5),
            ..config(&[up.addr])
        });
        // A burst of three opens three connections.
        let burst = async {
            tokio::join!(
                ask(&g, "a.example."),
                ask(&g, "b.example."),
                ask(&g, "c.example.")
            )
        };
        let release = async {
            up.until("three queries", |s| s.tcp_queries.load(SeqCst) == 3)
                .await;
            up.set_mode(Mode::Answer);
            up.release(3);
        };
        let ((a, b, c), ()) = tokio::join!(burst, release);
        assert_eq!((a, b, c), (Ok(tag(1)), Ok(tag(1)), Ok(tag(1))));
        assert_eq!(up.stats().accepted.load(SeqCst), 3);
        // One query every quarter of `expire` (the trickle's pace, in paused time) for twice
        // `expire`: each reuses the newest connection; the two others age out meanwhile.
        for _ in 0..8 {
            tokio::time::sleep(expire / 4).await;
            assert_eq!(ask(&g, "t.example.").await, Ok(tag(1)));
        }
        let stats = up.stats();
        assert_eq!(stats.client_closed.load(SeqCst), 2, "the older two expired");
        assert_eq!(
            stats.accepted.load(SeqCst),
            3,
            "no new connection was needed"
        );
        assert_eq!(stats.open.load(SeqCst), 1);
        assert_eq!(g.target(up.addr).metrics.tcp_hits.get(), 8);
    }

    #[tokio::test]
    async fn a_truncated_udp_reply_is_retried_over_tcp() {
        let up = Upstream::start_truncating(1).await;
        let g = group(Config {
            transport: Transport::PreferUdp,
            ..config(&[up.addr])
        });
        let reply = g.query(&query("a.example.", 7)).await.expect("answered");
        assert!(!msg::truncated(&reply));
        assert_eq!(read_reply(&reply).1, tag(1));
        let stats = up.stats();
        assert_eq!(
            (
                stats.udp_queries.load(SeqCst),
                stats.tcp_queries.load(SeqCst)
            ),
            (1, 1)
        );
        assert_eq!(g.target(up.addr).metrics.retries.get(), 1);
    }

    #[tokio::test]
    async fn prefer_udp_answers_over_udp_without_opening_connections() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let g = group(Config {
            transport: Transport::PreferUdp,
            ..config(&[up.addr])
        });
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 0);
        assert_eq!(g.target(up.addr).metrics.udp_misses.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_a_query_mid_flight_does_not_corrupt_the_pool() {
        let up = Upstream::start(Mode::Hold, 1).await;
        let g = group(config(&[up.addr]));
        {
            let first = ask(&g, "first.example.");
            tokio::pin!(first);
            tokio::select! {
                _ = &mut first => panic!("held query answered"),
                () = up.until("the first query", |s| s.tcp_queries.load(SeqCst) == 1) => {}
            }
            // Dropped here, with its query in flight.
        }
        // The lease was dropped with the future: the connection is closed, not pooled.
        let t = g.target(up.addr);
        assert_eq!((t.pool.idle_count(), t.metrics.connections.get()), (0, 0));
        assert_eq!(t.metrics.in_flight.get(), 0);
        // The server answers the abandoned query late, into a closed connection.
        up.set_mode(Mode::Answer);
        up.release(1);
        up.until("the server saw the abandoned connection closed", |s| {
            s.client_closed.load(SeqCst) == 1
        })
        .await;
        assert_eq!(ask(&g, "second.example.").await, Ok(tag(1)));
        assert_eq!(t.metrics.retries.get(), 0, "no mismatch, no retry");
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
        assert_eq!(
            g.in_flight.load(Ordering::SeqCst),
            0,
            "max_concurrent place given back"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn round_robin_alternates_and_random_spreads() {
        let a = Upstream::start(Mode::Answer, 1).await;
        let b = Upstream::start(Mode::Answer, 2).await;
        let g = group(Config {
            selection: Selection::RoundRobin,
            ..config(&[a.addr, b.addr])
        });
        let mut got = Vec::new();
        for _ in 0..4 {
            got.push(ask(&g, "a.example.").await.unwrap());
        }
        assert_eq!(got, [tag(1), tag(2), tag(1), tag(2)]);

        let g = group(Config {
            selection: Selection::Random,
            ..config(&[a.addr, b.addr])
        });
        let mut seen = std::collections::HashSet::new();
        for _ in 0..64 {
            seen.insert(ask(&g, "a.example.").await.unwrap());
        }
        assert_eq!(seen.len(), 2, "64 random picks all went to one address");
    }

    #[tokio::test(start_paused = true)]
    async fn probe_is_true_when_any_upstream_answers() {
        let refused = refusing_addr().await;
        let up = Upstream::start(Mode::Answer, 1).await;
        assert!(group(config(&[refused, up.addr])).probe().await);
        assert!(!group(config(&[refused])).probe().await);
        let silent = Upstream::start(Mode::Silent, 1).await;
        let g = group(config(&[silent.addr]));
        let start = Instant::now();
        assert!(!g.probe().await);
        assert_eq!(
            start.elapsed(),
            g.config().timeout,
            "gave up at the timeout"
        );
    }

    #[tokio::test]
    async fn the_probe_asks_the_configured_name_with_rd_as_configured() {
        for (probe, question, rd) in [
            (Probe::default(), &b"\x00\x00\x02\x00\x01"[..], true),
            (
                Probe {
                    name: b"\x07example\x03com\x00".to_vec(),
                    recursion_desired: false,
                },
                &b"\x07example\x03com\x00\x00\x02\x00\x01"[..],
                false,
            ),
        ] {
            let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let g = group(Config {
                transport: Transport::PreferUdp,
                probe,
                ..config(&[socket.local_addr().unwrap()])
            });
            let asked = tokio::spawn(async move {
                let mut buf = [0u8; 512];
                let (n, from) = socket.recv_from(&mut buf).await.unwrap();
                let mut reply = buf[..n].to_vec();
                reply[2] |= 0x80; // QR
                socket.send_to(&reply, from).await.unwrap();
                buf[..n].to_vec()
            });
            assert!(g.probe().await);
            let query = asked.await.unwrap();
            assert_eq!(query[2] & 0x01 != 0, rd, "RD");
            assert_eq!(&query[12..], question);
        }
    }

    #[tokio::test]
    async fn probe_over_udp() {
        let silent = Upstream::start(Mode::Silent, 1).await;
        let g = group(Config {
            transport: Transport::PreferUdp,
            timeout: Duration::from_millis(100),
            ..config(&[silent.addr])
        });
        assert!(!g.probe().await);
        silent.set_mode(Mode::Answer);
        assert!(g.probe().await, "a UDP probe");
    }

    #[tokio::test(start_paused = true)]
    async fn a_malformed_query_is_not_sent() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let g = group(config(&[up.addr]));
        assert_eq!(g.query(&[0u8; 5]).await, Err(Error::BadQuery));
        let mut response = query("a.example.", 1);
        response[2] |= 0x80;
        assert_eq!(g.query(&response).await, Err(Error::BadQuery));
        assert_eq!(up.stats().accepted.load(SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_group_closes_its_connections() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let g = group(config(&[up.addr]));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        drop(g);
        up.until("the pooled connection closed", |s| {
            s.client_closed.load(SeqCst) == 1
        })
        .await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_the_server_closed_after_its_idle_timeout_is_not_an_upstream_failure() {
        let up = Upstream::start(Mode::Answer, 1).await;
        // Misconfigured: the pool would keep the connection longer than the server does.
        let g = group(Config {
            max_fails: 1,
            expire: SERVER_IDLE * 3,
            ..config(&[up.addr])
        });
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        let idle_since = Instant::now();
        up.until("the server closed the idle connection", |s| {
            s.server_closed_idle.load(SeqCst) == 1
        })
        .await;
        assert_eq!(idle_since.elapsed(), SERVER_IDLE);
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        let t = g.target(up.addr);
        assert_eq!(t.metrics.connects.get(), 2, "the closed one was replaced");
        assert_eq!(
            t.metrics.resets.get(),
            0,
            "seen closed before the query was written"
        );
        assert!(!t.health.is_down());
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_with_bytes_after_its_reply_is_not_reused() {
        let up = Upstream::start(Mode::Twice, 1).await;
        let g = group(config(&[up.addr]));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        assert_eq!(
            up.stats().accepted.load(SeqCst),
            2,
            "a new connection each time"
        );
        assert_eq!(g.target(up.addr).metrics.tcp_hits.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_query_silent_on_a_dead_endpoint_is_answered_on_a_connection_that_answered_meanwhile()
    {
        let a = Upstream::start(Mode::Answer, 1).await;
        let b = Upstream::start(Mode::HoldSlow, 2).await;
        let dnat = Dnat::new(SERVICE, &[a.addr, b.addr]);
        // Two pooled connections, one to each endpoint, B's on top of the idle stack.
        dnat.script(&[1, 0]);
        let g = behind(
            &dnat,
            Config {
                max_fails: 0,
                ..config(&[SERVICE])
            },
        );
        let (held, warm) = tokio::join!(ask(&g, "slow-warm.example."), async {
            let warm = ask(&g, "warm.example.").await;
            b.release(1);
            warm
        });
        assert_eq!((held, warm), (Ok(tag(2)), Ok(tag(1))));

        // B's node dies. A query takes B's connection; another, 10 ms later, A's, which answers.
        b.kill();
        let start = Instant::now();
        let (silent, meanwhile) = tokio::join!(
            async {
                let answer = ask(&g, "x.example.").await;
                (answer, start.elapsed())
            },
            async {
                tokio::time::sleep(Duration::from_millis(10)).await;
                ask(&g, "y.example.").await
            }
        );
        assert_eq!(meanwhile, Ok(tag(1)));
        // The first is hedged at its timeout (replies so far took no time: the floor) on A's
        // connection, which answered after it began: no new connection.
        assert_eq!(silent, (Ok(tag(1)), MIN_HEDGE));
        assert_eq!(dnat.dials(), [b.addr, a.addr]);
        let m = &g.target(SERVICE).metrics;
        assert_eq!((m.hedges.get(), m.retries.get()), (1, 0));
        // B's connection was retired with the query that found it silent.
        b.until("B's connection closed", |s| {
            s.client_closed.load(SeqCst) == 1
        })
        .await;
        assert_eq!(m.connections.get(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hedge_dials_again_until_a_new_connection_lands_on_a_live_endpoint() {
        let a = Upstream::start(Mode::Answer, 1).await;
        let b = Upstream::start(Mode::Answer, 2).await;
        let dnat = Dnat::new(SERVICE, &[a.addr, b.addr]);
        let expire = Duration::from_millis(100);
        let g = behind(
            &dnat,
            Config {
                max_fails: 0,
                expire,
                ..config(&[SERVICE])
            },
        );
        // One reply measured, then its connection expires: nothing pooled, nothing proven.
        dnat.script(&[0]);
        assert_eq!(ask(&g, "warm.example.").await, Ok(tag(1)));
        tokio::time::sleep(expire * 2).await;
        assert_eq!(g.target(SERVICE).metrics.connections.get(), 0);

        // B's node dies, and kube-proxy still sends new connections there: twice, then to A.
        b.kill();
        dnat.script(&[1, 1, 0]);
        let start = Instant::now();
        assert_eq!(ask(&g, "x.example.").await, Ok(tag(1)));
        // Hedged at the timeout, on a new connection, to B again: still connecting one timeout
        // later, so hedged again; the third connection, to A, answers at two timeouts.
        assert_eq!(start.elapsed(), MIN_HEDGE * 2);
        assert_eq!(dnat.dials(), [a.addr, b.addr, b.addr, a.addr]);
        assert_eq!(g.target(SERVICE).metrics.hedges.get(), 2);
        // The connection that answered is pooled; the two stuck connects were dropped.
        assert_eq!(ask(&g, "y.example.").await, Ok(tag(1)));
        assert_eq!(dnat.dials().len(), 4);
    }

    /// An upstream that holds the names starting with `slow` until released, and a group that
    /// has measured one (instant) reply from it.
    async fn slow_on_some_names() -> (Upstream, Group<Memory>) {
        let up = Upstream::start(Mode::HoldSlow, 1).await;
        let g = group(Config {
            max_fails: 0,
            timeout: Duration::from_secs(5),
            ..config(&[up.addr])
        });
        assert_eq!(ask(&g, "warm.example.").await, Ok(tag(1)));
        (up, g)
    }

    #[tokio::test(start_paused = true)]
    async fn hedging_stops_once_a_connection_that_answered_meanwhile_is_silent_too() {
        let (up, g) = slow_on_some_names().await;
        let start = Instant::now();
        let (slow, fast) = tokio::join!(
            async {
                let answer = ask(&g, "slow.example.").await;
                (answer, start.elapsed())
            },
            async {
                tokio::time::sleep(Duration::from_millis(10)).await;
                let fast = ask(&g, "fast.example.").await;
                // Long after every hedge could have gone.
                tokio::time::sleep(Duration::from_secs(1)).await;
                up.release(2);
                fast
            }
        );
        assert_eq!(fast, Ok(tag(1)));
        // The server is slow on this name: one hedge, on the connection that answered `fast`,
        // held as well; then the query waits, and gets the first answer.
        assert_eq!(slow, (Ok(tag(1)), Duration::from_millis(1010)));
        assert_eq!(g.target(up.addr).metrics.hedges.get(), 1);
        assert_eq!(
            up.stats().tcp_queries.load(SeqCst),
            4,
            "warm, slow twice, fast"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_answer_with_no_other_traffic_costs_one_duplicate_at_most() {
        let (up, g) = slow_on_some_names().await;
        let start = Instant::now();
        let (slow, ()) = tokio::join!(ask(&g, "slow.example."), async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            up.release(2);
        });
        assert_eq!(
            (slow, start.elapsed()),
            (Ok(tag(1)), Duration::from_secs(1))
        );
        // Hedged once, on a new connection, which connected (the server is there) and stayed
        // silent: the server is slow on it, no further hedge.
        assert_eq!(g.target(up.addr).metrics.hedges.get(), 1);
        assert_eq!(up.stats().tcp_queries.load(SeqCst), 3, "warm, slow twice");
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_upstream_that_answers_nothing_becomes_silent_and_is_no_longer_hedged() {
        let up = Upstream::start(Mode::Silent, 1).await;
        let g = group(Config {
            max_fails: 0,
            timeout: Config::default().timeout,
            ..config(&[up.addr])
        });
        let deadline = g.config().timeout;
        let mut queries = 0;
        while g.healthy() {
            let start = Instant::now();
            assert_eq!(ask(&g, "a.example.").await, Err(Error::Timeout));
            assert!(start.elapsed() <= deadline);
            queries += 1;
            // Each query finds its first exchange and that one's hedge silent.
            assert!(
                queries <= u64::from(SILENT) / 2,
                "still healthy after {queries} silent queries"
            );
        }
        assert!(g.target(up.addr).health.is_silent());
        let m = &g.target(up.addr).metrics;
        let (hedges, sent) = (m.hedges.get(), up.stats().tcp_queries.load(SeqCst));
        assert!(
            hedges <= u64::from(MAX_HEDGES) * queries,
            "{hedges} hedges in {queries} queries"
        );
        // Silent as a whole: no hedge; an exchange per read timeout, within the passes, until
        // the deadline.
        let start = Instant::now();
        assert_eq!(ask(&g, "b.example.").await, Err(Error::Timeout));
        assert_eq!(start.elapsed(), deadline);
        assert_eq!(m.hedges.get(), hedges);
        assert_eq!(up.stats().tcp_queries.load(SeqCst) - sent, PASSES);
        // One reply clears it.
        up.set_mode(Mode::Answer);
        assert_eq!(ask(&g, "c.example.").await, Ok(tag(1)));
        assert!(g.healthy());
    }

    #[tokio::test(start_paused = true)]
    async fn an_exchange_silent_for_read_timeout_has_failed_and_its_connection_is_closed() {
        let up = Upstream::start(Mode::Silent, 1).await;
        let read_timeout = Duration::from_millis(300);
        let g = group(Config {
            max_fails: 0,
            read_timeout,
            timeout: Duration::from_secs(1),
            ..config(&[up.addr])
        });
        let start = Instant::now();
        let (answer, ()) = tokio::join!(ask(&g, "a.example."), async {
            up.until("the first connection closed", |s| {
                s.client_closed.load(SeqCst) == 1
            })
            .await;
            assert_eq!(start.elapsed(), read_timeout);
        });
        assert_eq!(answer, Err(Error::Timeout));
        // Exchanges at 0, 200 ms (its hedge), 300 and 500 ms (replacing the first two, which
        // uses up the passes), 700 ms (the hedge of the newest): the deadline comes first.
        assert_eq!(start.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_endpoint_behind_a_clusterip_costs_no_query_and_never_marks_it_down() {
        let a = Upstream::start(Mode::Answer, 1).await;
        let b = Upstream::start(Mode::Answer, 2).await;
        let dnat = Dnat::new(SERVICE, &[a.addr, b.addr]);
        let g = Arc::new(behind(
            &dnat,
            Config {
                max_fails: 2,
                health_check: Duration::from_millis(500),
                timeout: Config::default().timeout,
                ..config(&[SERVICE])
            },
        ));
        // A few connections to each endpoint.
        let mut warm = JoinSet::new();
        for i in 0..8 {
            let g = g.clone();
            warm.spawn(async move { ask(&g, &format!("w{i}.example.")).await });
        }
        while let Some(done) = warm.join_next().await {
            assert_eq!(done.unwrap().map(|ip| ip.is_some()), Ok(true));
        }
        // B dies; kube-proxy takes it out a second later. Meanwhile and after, a query every
        // 5 ms, four at a time: each answered within 250 ms, and the Service is never down.
        b.kill();
        let mut down = g.target(SERVICE).health.subscribe();
        let mut queries = JoinSet::new();
        for tick in 0..400 {
            if tick == 200 {
                dnat.set_endpoints(&[a.addr]);
            }
            for i in 0..4 {
                let g = g.clone();
                queries.spawn(async move {
                    let start = Instant::now();
                    let answer = ask(&g, &format!("q{tick}-{i}.example.")).await;
                    (answer, start.elapsed())
                });
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let mut worst = Duration::ZERO;
        while let Some(done) = queries.join_next().await {
            let (answer, took) = done.unwrap();
            assert_eq!(answer, Ok(tag(1)));
            worst = worst.max(took);
        }
        assert!(worst <= Duration::from_millis(250), "worst {worst:?}");
        assert!(!down.has_changed().unwrap() && !*down.borrow_and_update());
        assert!(g.healthy());
        assert!(g.target(SERVICE).metrics.hedges.get() > 0);
    }

    #[tokio::test]
    async fn the_tcp_dialer_reaches_a_real_upstream() {
        let up = Upstream::start(Mode::CloseAfter(2), 1).await;
        let metrics = Metrics::register(&mut Registry::default());
        let g = Group::new(config(&[up.addr]), &metrics).expect("valid config");
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        up.until("the server closed the connection", |s| {
            s.open.load(SeqCst) == 0
        })
        .await;
        assert_eq!(ask(&g, "c.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
        assert_eq!(g.target(up.addr).metrics.connects.get(), 2);
        assert!(!g.target(up.addr).health.is_down());
    }
}
