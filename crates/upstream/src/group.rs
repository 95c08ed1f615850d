//! A forward target set: selection, deadlines, retries, failover, admission, health checking.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rand::seq::SliceRandom;
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::{Instant, sleep};

use crate::health::Health;
use crate::metrics::{self, Held};
use crate::msg::{self, Check};
use crate::pool::{self, Fault, Pool};
use crate::{Config, ConfigError, Error, Metrics, Selection, Transport, udp};

/// How many times one query may go through its address list. Attempts that fail fast (refused,
/// reset) start the next pass at once; a few passes ride out a CoreDNS pod going away behind a
/// Service without spinning on an upstream that refuses everything.
const PASSES: usize = 3;

/// One upstream address: its pool, health and metric handles.
#[derive(Debug)]
struct Target {
    addr: SocketAddr,
    pool: Pool,
    health: Health,
    metrics: Arc<metrics::Target>,
}

/// One `forward` target set: its upstream addresses with a connection pool each, the selection
/// policy, health tracking and the deadline of every query. Cheap to share (hold it in an `Arc`);
/// dropping it stops its background tasks and closes its connections.
#[derive(Debug)]
pub struct Group {
    config: Config,
    targets: Box<[Arc<Target>]>,
    /// Round-robin position.
    robin: AtomicUsize,
    /// Queries in flight (`max_concurrent`).
    in_flight: AtomicUsize,
    metrics: Metrics,
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

impl Group {
    /// Validates the config (every bad field reported at once) and builds the pools. Must be
    /// called inside a tokio runtime: it spawns one idle reaper per address and, unless
    /// `max_fails` is 0, one health checker per address.
    ///
    /// An address listed twice is kept once (CoreDNS would just query it twice as often).
    pub fn new(mut config: Config, metrics: &Metrics) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut seen = Vec::with_capacity(config.addrs.len());
        config.addrs.retain(|a| {
            let new = !seen.contains(a);
            seen.push(*a);
            new
        });
        let targets: Box<[Arc<Target>]> = config
            .addrs
            .iter()
            .map(|&addr| {
                let handles = Arc::new(metrics.target(addr));
                Arc::new(Target {
                    addr,
                    pool: Pool::new(addr, config.max_connections, config.expire, handles.clone()),
                    health: Health::new(config.max_fails),
                    metrics: handles,
                })
            })
            .collect();
        let mut tasks = Vec::new();
        for target in targets.iter() {
            let t = target.clone();
            tasks.push(tokio::spawn(async move { t.pool.reap().await }).abort_handle());
            if config.max_fails > 0 {
                let t = target.clone();
                let (transport, every, timeout) =
                    (config.transport, config.health_check, config.timeout);
                tasks.push(
                    tokio::spawn(async move { check_health(t, transport, every, timeout).await })
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
            tasks,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Whether at least one upstream is not marked down.
    pub fn healthy(&self) -> bool {
        self.targets.iter().any(|t| !t.health.is_down())
    }

    /// Probes every upstream once (`. IN NS`; any reply counts as alive, and marks it up) and
    /// returns true as soon as one answered, false if none did within `timeout`. Used by
    /// readiness at start.
    pub async fn probe(&self) -> bool {
        let mut probes = JoinSet::new();
        for target in self.targets.iter() {
            let target = target.clone();
            let (transport, deadline) =
                (self.config.transport, Instant::now() + self.config.timeout);
            probes.spawn(async move {
                let alive = probe(target.addr, transport, deadline).await;
                if alive {
                    target.health.success();
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
    /// attempt) and returns the validated reply bytes with the caller's ID restored.
    ///
    /// The whole query, every retry and failover included, ends within `timeout`. Each attempt
    /// gets the remaining time divided by the addresses not yet tried in this pass, so a silent
    /// upstream cannot eat the deadline of the next one. Dropping the future mid-query is safe:
    /// the connection it was using is closed, never pooled.
    pub async fn query(&self, query: &[u8]) -> Result<Vec<u8>, Error> {
        if !msg::forwardable(query) {
            return Err(Error::BadQuery);
        }
        let _admitted = self.admit()?;
        let deadline = Instant::now() + self.config.timeout;
        let order = self.order();
        let (mut timed_out, mut bad_reply, mut retry) = (false, false, false);
        for _ in 0..PASSES {
            for (i, &index) in order.iter().enumerate() {
                let now = Instant::now();
                if now >= deadline {
                    return Err(Error::Timeout);
                }
                // `order` holds at most MAX_ADDRS (15) entries.
                let untried = (order.len() - i) as u32;
                let attempt_deadline = now + (deadline - now) / untried;
                let target = &self.targets[index];
                match self.attempt(target, query, attempt_deadline, retry).await {
                    Ok(mut reply) => {
                        msg::set_id(&mut reply, msg::id(query));
                        return Ok(reply);
                    }
                    Err(Fault::Timeout | Fault::Busy) => timed_out = true,
                    Err(Fault::BadReply) => bad_reply = true,
                    Err(Fault::Refused | Fault::Closed) => {}
                }
                retry = true;
            }
        }
        Err(if Instant::now() >= deadline {
            Error::Timeout
        } else if bad_reply {
            Error::BadReply
        } else if timed_out {
            Error::Timeout
        } else {
            Error::Unreachable
        })
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

    /// The addresses to try, in order: those not marked down, arranged by the selection policy.
    /// If all are down, all of them: health checking itself may be what is broken (CoreDNS does
    /// the same, and counts it in `coredns_forward_healthcheck_broken_total`).
    fn order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.targets.len())
            .filter(|&i| !self.targets[i].health.is_down())
            .collect();
        if order.is_empty() {
            self.metrics.healthcheck_broken.inc();
            order.extend(0..self.targets.len());
        }
        match self.config.selection {
            Selection::Random => order.shuffle(&mut rand::rng()),
            Selection::RoundRobin => {
                let first = self.robin.fetch_add(1, Ordering::Relaxed) % order.len();
                order.rotate_left(first);
            }
            Selection::Sequential => {}
        }
        order
    }

    /// One exchange with one address, ending by `deadline`; updates its health and metrics.
    async fn attempt(
        &self,
        target: &Target,
        query: &[u8],
        deadline: Instant,
        retry: bool,
    ) -> Result<Vec<u8>, Fault> {
        let m = &target.metrics;
        let _in_flight = Held::new(&m.in_flight);
        m.requests.inc();
        if retry {
            m.retries.inc();
        }
        let start = Instant::now();
        let result = match self.config.transport {
            Transport::Tcp => tcp(target, query, deadline).await,
            Transport::PreferUdp => {
                m.udp_misses.inc();
                match udp::exchange(target.addr, query, Check::Answer(query), deadline).await {
                    Ok(reply) if msg::truncated(&reply) => {
                        // The answer does not fit a datagram: ask again over TCP, same address.
                        m.requests.inc();
                        m.retries.inc();
                        tcp(target, query, deadline).await
                    }
                    other => other,
                }
            }
        };
        match &result {
            Ok(reply) => {
                m.reply(msg::rcode(reply), start.elapsed());
                if target.health.success() {
                    tracing::info!(upstream = %target.addr, "upstream answered again, marked up");
                }
            }
            Err(fault) if fault.counts_against_upstream() => {
                if target.health.failure() {
                    tracing::warn!(upstream = %target.addr, ?fault, "upstream marked down");
                }
            }
            Err(fault) => tracing::debug!(upstream = %target.addr, ?fault, "exchange failed"),
        }
        result
    }

    #[cfg(test)]
    fn target(&self, addr: SocketAddr) -> &Target {
        self.targets
            .iter()
            .find(|t| t.addr == addr)
            .expect("address in the group")
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// One exchange over a pooled TCP connection.
async fn tcp(target: &Target, query: &[u8], deadline: Instant) -> Result<Vec<u8>, Fault> {
    let mut lease = target.pool.acquire(deadline).await?;
    let reply = lease.exchange(query, deadline).await?;
    lease.release();
    Ok(reply)
}

/// Sends `. IN NS` to `addr`; any reply before `deadline` means it is alive.
async fn probe(addr: SocketAddr, transport: Transport, deadline: Instant) -> bool {
    let query = msg::probe(0);
    match transport {
        Transport::Tcp => pool::exchange_once(addr, &query, Check::Alive, deadline).await,
        Transport::PreferUdp => udp::exchange(addr, &query, Check::Alive, deadline).await,
    }
    .is_ok()
}

/// While the address is marked down, probes it every `every` until it answers. Runs until aborted.
async fn check_health(
    target: Arc<Target>,
    transport: Transport,
    every: Duration,
    timeout: Duration,
) {
    let mut down = target.health.subscribe();
    loop {
        if down.wait_for(|down| *down).await.is_err() {
            return;
        }
        while target.health.is_down() {
            sleep(every).await;
            if !target.health.is_down() {
                // A query reached it meanwhile.
                break;
            }
            if probe(target.addr, transport, Instant::now() + timeout).await {
                target.health.success();
                tracing::info!(upstream = %target.addr, "health check answered, marked up");
            } else {
                target.metrics.healthcheck_failures.inc();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::sync::atomic::Ordering::SeqCst;

    use prometheus_client::registry::Registry;

    use super::*;
    use crate::scripted::{Mode, Upstream, query, read_reply, refusing_addr};

    fn config(addrs: &[SocketAddr]) -> Config {
        Config {
            addrs: addrs.to_vec(),
            selection: Selection::Sequential,
            timeout: Duration::from_millis(500),
            health_check: Duration::from_millis(20),
            ..Config::default()
        }
    }

    fn group(config: Config) -> Group {
        Group::new(config, &Metrics::register(&mut Registry::default())).expect("valid config")
    }

    fn tag(n: u8) -> Option<Ipv4Addr> {
        Some(Ipv4Addr::new(192, 0, 2, n))
    }

    /// Asks for `name` with ID 0x4242 and checks the reply answers it with that ID.
    async fn ask(group: &Group, name: &str) -> Result<Option<Ipv4Addr>, Error> {
        let reply = group.query(&query(name, 0x4242)).await?;
        let (id, ip, qname) = read_reply(&reply);
        assert_eq!(id, 0x4242, "the caller's ID is restored");
        assert_eq!(qname, name, "the reply answers the question asked");
        Ok(ip)
    }

    #[tokio::test]
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
        assert_eq!(m.retries.get(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrency_grows_the_pool_up_to_max_connections_and_no_further() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let g = Arc::new(group(Config {
            max_connections: 8,
            timeout: Duration::from_secs(3),
            ..config(&[up.addr])
        }));
        let mut queries = JoinSet::new();
        for i in 0..200 {
            let g = g.clone();
            queries.spawn(async move { ask(&g, &format!("c{i}.example.")).await });
        }
        while let Some(done) = queries.join_next().await {
            assert_eq!(done.expect("no panic"), Ok(tag(1)));
        }
        let stats = up.stats();
        assert!(stats.max_open.load(SeqCst) <= 8, "{stats:?}");
        assert!(stats.accepted.load(SeqCst) <= 8, "{stats:?}");
        assert!(
            stats.accepted.load(SeqCst) > 1,
            "concurrency opened more connections: {stats:?}"
        );
        assert!(g.target(up.addr).metrics.connections.get() <= 8);
    }

    #[tokio::test]
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

    #[tokio::test]
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

    #[tokio::test]
    async fn a_reset_mid_flight_is_retried_on_the_other_address() {
        let bad = Upstream::start(Mode::Reset, 1).await;
        let good = Upstream::start(Mode::Answer, 2).await;
        let g = group(config(&[bad.addr, good.addr]));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));
        assert_eq!(bad.stats().tcp_queries.load(SeqCst), 1);
        assert_eq!(g.target(bad.addr).metrics.resets.get(), 1);
        assert_eq!(g.target(good.addr).metrics.retries.get(), 1);
    }

    #[tokio::test]
    async fn a_reset_on_the_only_address_is_retried_on_a_new_connection() {
        let up = Upstream::start(Mode::ResetFirst(1), 1).await;
        let g = group(config(&[up.addr]));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
        let m = &g.target(up.addr).metrics;
        assert_eq!((m.resets.get(), m.retries.get()), (1, 1));
    }

    #[tokio::test]
    async fn a_silent_upstream_times_out_within_the_deadline() {
        let up = Upstream::start(Mode::Silent, 1).await;
        let g = group(Config {
            timeout: Duration::from_millis(200),
            ..config(&[up.addr])
        });
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Err(Error::Timeout));
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(195),
            "gave up early: {took:?}"
        );
        assert!(
            took < Duration::from_millis(350),
            "overran the deadline: {took:?}"
        );
        assert_eq!(
            g.target(up.addr).metrics.connections.get(),
            0,
            "the silent connection is closed"
        );
    }

    #[tokio::test]
    async fn a_silent_upstream_fails_over_to_the_second_address_in_time() {
        let silent = Upstream::start(Mode::Silent, 1).await;
        let good = Upstream::start(Mode::Answer, 2).await;
        let g = group(Config {
            timeout: Duration::from_millis(400),
            ..config(&[silent.addr, good.addr])
        });
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));
        let took = start.elapsed();
        // The silent one gets half the deadline, the second one the rest.
        assert!(took >= Duration::from_millis(195), "{took:?}");
        assert!(took < Duration::from_millis(400), "{took:?}");
    }

    #[tokio::test]
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

    #[tokio::test]
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

    #[tokio::test]
    async fn a_silent_udp_upstream_times_out() {
        let up = Upstream::start(Mode::Silent, 1).await;
        let g = group(Config {
            transport: Transport::PreferUdp,
            timeout: Duration::from_millis(100),
            ..config(&[up.addr])
        });
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Err(Error::Timeout));
        assert!(start.elapsed() >= Duration::from_millis(95));
    }

    #[tokio::test]
    async fn a_refused_connection_fails_over() {
        let refused = refusing_addr().await;
        let good = Upstream::start(Mode::Answer, 2).await;
        let g = group(config(&[refused, good.addr]));
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));

        let g = group(config(&[refused]));
        let start = Instant::now();
        assert_eq!(ask(&g, "a.example.").await, Err(Error::Unreachable));
        assert!(
            start.elapsed() < Duration::from_millis(400),
            "refusal fails fast"
        );
    }

    #[tokio::test]
    async fn max_fails_marks_down_and_the_health_check_marks_up_again() {
        let flaky = Upstream::start(Mode::Reset, 1).await;
        let good = Upstream::start(Mode::Answer, 2).await;
        let g = group(Config {
            max_fails: 2,
            ..config(&[flaky.addr, good.addr])
        });
        let t = g.target(flaky.addr);
        let mut down = t.health.subscribe();
        assert_eq!(ask(&g, "a.example.").await, Ok(tag(2)));
        assert!(!t.health.is_down(), "one failure is not max_fails");
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(2)));
        assert!(t.health.is_down());
        assert!(g.healthy(), "the other address is up");

        // Down: queries skip it (the good one gets a first attempt, not a retry).
        let retries = g.target(good.addr).metrics.retries.get();
        assert_eq!(ask(&g, "c.example.").await, Ok(tag(2)));
        assert_eq!(g.target(good.addr).metrics.retries.get(), retries);

        // The checker probes it (and fails) until it answers again.
        flaky
            .until("a health check", |s| s.tcp_queries.load(SeqCst) >= 3)
            .await;
        flaky.set_mode(Mode::Answer);
        tokio::time::timeout(Duration::from_secs(5), down.wait_for(|d| !*d))
            .await
            .expect("marked up in time")
            .expect("health alive");
        assert!(t.metrics.healthcheck_failures.get() >= 1);
        assert_eq!(
            ask(&g, "d.example.").await,
            Ok(tag(1)),
            "back in first place"
        );
    }

    #[tokio::test]
    async fn when_every_address_is_down_they_are_tried_anyway() {
        let up = Upstream::start(Mode::Reset, 1).await;
        let metrics = Metrics::register(&mut Registry::default());
        let g = Group::new(
            Config {
                max_fails: 1,
                health_check: Duration::from_secs(3600),
                ..config(&[up.addr])
            },
            &metrics,
        )
        .unwrap();
        assert_eq!(ask(&g, "a.example.").await, Err(Error::Unreachable));
        assert!(!g.healthy());
        up.set_mode(Mode::Answer);
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        assert_eq!(metrics.healthcheck_broken.get(), 1);
        assert!(g.healthy(), "the reply marked it up");
    }

    #[tokio::test]
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

    #[tokio::test]
    async fn beyond_max_concurrent_a_query_fails_at_once() {
        let up = Upstream::start(Mode::Hold, 1).await;
        let metrics = Metrics::register(&mut Registry::default());
        let g = Group::new(
            Config {
                max_concurrent: 2,
                timeout: Duration::from_secs(5),
                ..config(&[up.addr])
            },
            &metrics,
        )
        .unwrap();
        let held = async { tokio::join!(ask(&g, "a.example."), ask(&g, "b.example.")) };
        let extra = async {
            up.until("two held queries", |s| s.tcp_queries.load(SeqCst) == 2)
                .await;
            let start = Instant::now();
            let third = ask(&g, "c.example.").await;
            assert!(
                start.elapsed() < Duration::from_millis(100),
                "rejected at once"
            );
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

    #[tokio::test]
    async fn idle_connections_are_closed_after_expire() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let expire = Duration::from_millis(100);
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
        assert!(idle_since.elapsed() >= expire - Duration::from_millis(5));
        let t = g.target(up.addr);
        assert_eq!((t.pool.idle_count(), t.metrics.connections.get()), (0, 0));
        assert_eq!(ask(&g, "b.example.").await, Ok(tag(1)));
        assert_eq!(up.stats().accepted.load(SeqCst), 2);
    }

    #[tokio::test]
    async fn a_trickle_of_queries_keeps_the_newest_connection_and_lets_the_rest_expire() {
        let up = Upstream::start(Mode::Hold, 1).await;
        let g = group(Config {
            expire: Duration::from_millis(100),
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
        // Sequential queries reuse the newest; the two others age out meanwhile.
        let deadline = Instant::now() + Duration::from_secs(5);
        while up.stats().client_closed.load(SeqCst) < 2 {
            assert!(Instant::now() < deadline, "idle connections never expired");
            assert_eq!(ask(&g, "t.example.").await, Ok(tag(1)));
        }
        assert_eq!(
            up.stats().accepted.load(SeqCst),
            3,
            "no new connection was needed"
        );
        assert_eq!(up.stats().open.load(SeqCst), 1);
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

    #[tokio::test]
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

    #[tokio::test]
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

    #[tokio::test]
    async fn probe_is_true_when_any_upstream_answers() {
        let refused = refusing_addr().await;
        let up = Upstream::start(Mode::Answer, 1).await;
        assert!(group(config(&[refused, up.addr])).probe().await);
        assert!(!group(config(&[refused])).probe().await);
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

    #[tokio::test]
    async fn a_malformed_query_is_not_sent() {
        let up = Upstream::start(Mode::Answer, 1).await;
        let g = group(config(&[up.addr]));
        assert_eq!(g.query(&[0u8; 5]).await, Err(Error::BadQuery));
        let mut response = query("a.example.", 1);
        response[2] |= 0x80;
        assert_eq!(g.query(&response).await, Err(Error::BadQuery));
        assert_eq!(up.stats().accepted.load(SeqCst), 0);
    }

    #[tokio::test]
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
}
