//! `nodedns top`: a live view of a running agent, read from its `/metrics`.
//!
//! Every `--interval` it scrapes the endpoint and shows what changed since the previous scrape:
//! queries per second (by transport), the cache hit ratio, the share of each RCODE (NXDOMAIN is
//! the ndots cascade), the top query types, and per upstream address the request rate, latency
//! quantiles and pool state; then the heaviest clients (queries per second, NXDOMAIN and
//! search-path shares, hit ratio, long and random-looking names, distinct names per minute under
//! their busiest zone) and the most asked names with who asks them. It reads CoreDNS's names, so
//! it also works against node-cache or CoreDNS (without the `nodedns_*` panels).
//!
//! The pieces are pure functions ([`parse`], [`View::between`], [`View::render`]) so tests feed
//! them text; only [`scrape`] does I/O (HTTP/1.0 over a plain TCP connection).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use crate::config;

/// `nodedns top`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Address of the agent's admin endpoint serving /metrics.
    #[arg(long, default_value = "127.0.0.1:9253", value_name = "ADDR:PORT")]
    pub metrics: SocketAddr,

    /// Time between refreshes.
    #[arg(long, default_value = "1s", value_parser = config::go_duration)]
    pub interval: Duration,

    /// Print one view (two scrapes, --interval apart) and exit, without clearing the screen.
    #[arg(long)]
    pub once: bool,
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot reach {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("reading http://{addr}/metrics: {source}")]
    Read {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("http://{addr}/metrics answered {status:?}")]
    Status { addr: SocketAddr, status: String },
    #[error("http://{addr}/metrics: not an HTTP response")]
    Malformed { addr: SocketAddr },
}

/// Runs the view until interrupted (or once).
pub fn run(args: &Args) -> ExitCode {
    let interval = args.interval.max(Duration::from_millis(100));
    let mut previous = match scrape(args.metrics) {
        Ok(first) => first,
        Err(err) => {
            eprintln!("nodedns top: {err}");
            return ExitCode::FAILURE;
        }
    };
    loop {
        std::thread::sleep(interval);
        match scrape(args.metrics) {
            Ok(current) => {
                let view = View::between(&previous, &current);
                let text = view.render(args.metrics, interval);
                if args.once {
                    print!("{text}");
                    return ExitCode::SUCCESS;
                }
                // Clear the screen and home the cursor, then draw.
                print!("\x1b[2J\x1b[H{text}");
                let _ = std::io::stdout().flush();
                previous = current;
            }
            Err(err) => {
                if args.once {
                    eprintln!("nodedns top: {err}");
                    return ExitCode::FAILURE;
                }
                println!("\x1b[2J\x1b[Hnodedns top: {err} (retrying)");
                let _ = std::io::stdout().flush();
            }
        }
    }
}

/// One sample line of the exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The samples of one scrape, and when it was taken.
#[derive(Debug, Clone)]
pub struct Scrape {
    pub at: Instant,
    pub samples: Vec<Sample>,
}

impl Scrape {
    /// Sum of `name`'s samples grouped by the values of `labels` (missing labels are "").
    fn by(&self, name: &str, labels: &[&str]) -> BTreeMap<Vec<String>, f64> {
        let mut out = BTreeMap::new();
        for s in self.samples.iter().filter(|s| s.name == name) {
            let key = labels
                .iter()
                .map(|l| s.label(l).unwrap_or_default().to_owned())
                .collect();
            *out.entry(key).or_insert(0.0) += s.value;
        }
        out
    }

    fn total(&self, name: &str) -> f64 {
        sum(self
            .samples
            .iter()
            .filter(|s| s.name == name)
            .map(|s| s.value))
    }
}

/// Reads `http://addr/metrics`.
pub fn scrape(addr: SocketAddr) -> Result<Scrape, Error> {
    let timeout = Duration::from_secs(5);
    let mut stream = TcpStream::connect_timeout(&addr, timeout)
        .map_err(|source| Error::Connect { addr, source })?;
    let read = |source| Error::Read { addr, source };
    stream.set_read_timeout(Some(timeout)).map_err(read)?;
    stream.set_write_timeout(Some(timeout)).map_err(read)?;
    // HTTP/1.0: the server closes after the body and never chunks it.
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nAccept: text/plain;version=0.0.4\r\n\r\n"
    )
    .map_err(read)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(read)?;
    let at = Instant::now();
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or(Error::Malformed { addr })?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(Error::Status {
            addr,
            status: status.to_owned(),
        });
    }
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body).ok_or(Error::Malformed { addr })?
    } else {
        body.to_owned()
    };
    Ok(Scrape {
        at,
        samples: parse(&body),
    })
}

/// Decodes a chunked body (RFC 9112 §7.1), for servers that chunk even HTTP/1.0 answers.
fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size..)?.strip_prefix("\r\n")?;
    }
}

/// Parses the Prometheus text format (0.0.4): every sample line; comments, blank lines and
/// lines that do not parse are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = after;
        loop {
            rest = rest.trim_start_matches([',', ' ']);
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after) = rest.split_once('=')?;
            let mut chars = after.strip_prefix('"')?.char_indices();
            let mut value = String::new();
            let end = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.push((key.trim().to_owned(), value));
            rest = &after[1 + end + 1..];
        }
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        "NaN" => f64::NAN,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// One upstream address's row.
#[derive(Debug, Clone, PartialEq)]
pub struct Upstream {
    pub to: String,
    pub requests_per_s: f64,
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    pub connections: Option<f64>,
    pub in_flight: Option<f64>,
    pub resets_per_s: f64,
    pub retries_per_s: f64,
    pub failed_checks: f64,
}

/// One client's row (`nodedns_client_*`).
#[derive(Debug, Clone, PartialEq)]
pub struct ClientRow {
    /// The address, or `other` for every client outside the top K.
    pub client: String,
    pub qps: f64,
    /// Shares of its answers; `None` without answers in the interval.
    pub nxdomain: Option<f64>,
    pub search_path: Option<f64>,
    pub hit_ratio: Option<f64>,
    pub long_per_s: f64,
    pub random_per_s: f64,
    /// Distinct names per minute under its busiest zone, and the zone.
    pub distinct: Option<(f64, String)>,
}

/// One row of the names panel.
#[derive(Debug, Clone, PartialEq)]
pub struct NameRow {
    pub name: String,
    pub client: String,
    pub qps: f64,
}

/// Rows of the clients and names panels at most.
const PANEL_ROWS: usize = 10;

/// What one refresh shows: rates over the interval between two scrapes, gauges from the later.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub seconds: f64,
    pub qps: f64,
    pub udp_qps: f64,
    pub tcp_qps: f64,
    /// Hits / cache requests over the interval; `None` without cache requests.
    pub hit_ratio: Option<f64>,
    pub hits_per_s: f64,
    pub misses_per_s: f64,
    pub stale_per_s: f64,
    pub prefetch_per_s: f64,
    pub entries: f64,
    pub cache_bytes: Option<f64>,
    pub cache_capacity: Option<f64>,
    pub waiters: Option<f64>,
    /// (RCODE, share of the interval's responses), largest first.
    pub rcodes: Vec<(String, f64)>,
    /// (type, share of the interval's requests), largest first, at most 6.
    pub types: Vec<(String, f64)>,
    pub upstreams: Vec<Upstream>,
    /// The heaviest clients first, `other` last.
    pub clients: Vec<ClientRow>,
    /// The most asked names first.
    pub names: Vec<NameRow>,
}

/// The sum of `values`, 0 when there are none. (`Iterator::sum` of no floats is -0.0, the
/// neutral element of IEEE addition, which prints as `-0.0/s`.)
fn sum(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |total, v| total + v)
}

/// `after - before` per key (counters; a reset counts from zero).
fn delta(
    before: &BTreeMap<Vec<String>, f64>,
    after: &BTreeMap<Vec<String>, f64>,
) -> BTreeMap<Vec<String>, f64> {
    after
        .iter()
        .map(|(k, v)| {
            let old = before.get(k).copied().unwrap_or(0.0);
            (k.clone(), if *v >= old { v - old } else { *v })
        })
        .collect()
}

/// Shares of each key of `counts` (a single label), largest first.
fn shares(counts: &BTreeMap<Vec<String>, f64>) -> Vec<(String, f64)> {
    let total = sum(counts.values().copied());
    if total <= 0.0 {
        return Vec::new();
    }
    let mut out: Vec<(String, f64)> = counts
        .iter()
        .filter(|(_, v)| **v > 0.0)
        .map(|(k, v)| (k.first().cloned().unwrap_or_default(), v / total))
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// The `q` quantile of a histogram given as (upper bound, cumulative count) pairs, by linear
/// interpolation inside the bucket (as PromQL's `histogram_quantile`).
pub fn quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let mut buckets = buckets.to_vec();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(upper, count) in &buckets {
        if count >= rank {
            if upper.is_infinite() {
                return Some(lower);
            }
            if count <= below {
                return Some(upper);
            }
            return Some(lower + (upper - lower) * (rank - below) / (count - below));
        }
        (lower, below) = (upper, count);
    }
    Some(lower)
}

impl View {
    /// The view of the interval from `before` to `after`.
    pub fn between(before: &Scrape, after: &Scrape) -> View {
        let seconds = after
            .at
            .saturating_duration_since(before.at)
            .as_secs_f64()
            .max(1e-3);
        let rate = |name: &str| {
            sum(delta(&before.by(name, &[]), &after.by(name, &[])).into_values()) / seconds
        };
        let per =
            |name: &str, labels: &[&str]| delta(&before.by(name, labels), &after.by(name, labels));

        let by_proto = per("coredns_dns_requests_total", &["proto"]);
        let proto = |p: &str| by_proto.get(&vec![p.to_owned()]).copied().unwrap_or(0.0) / seconds;
        let hits = rate("coredns_cache_hits_total");
        let requests = rate("coredns_cache_requests_total");

        // Entries: a cache shared by several listen addresses is reported once per address.
        let entries: f64 = {
            let mut per_cache: BTreeMap<(String, String), f64> = BTreeMap::new();
            for s in after
                .samples
                .iter()
                .filter(|s| s.name == "coredns_cache_entries")
            {
                let key = (
                    s.label("zones").unwrap_or_default().to_owned(),
                    s.label("type").unwrap_or_default().to_owned(),
                );
                let e = per_cache.entry(key).or_insert(0.0);
                *e = e.max(s.value);
            }
            sum(per_cache.into_values())
        };
        let has = |name: &str| after.samples.iter().any(|s| s.name == name);

        let mut types = shares(&per("coredns_dns_requests_total", &["type"]));
        types.truncate(6);

        let durations = per(
            "coredns_proxy_request_duration_seconds_bucket",
            &["to", "le"],
        );
        let counts = per("coredns_proxy_request_duration_seconds_count", &["to"]);
        let gauge = |name: &str| after.by(name, &["to"]);
        let (connections, in_flight) = (
            gauge("nodedns_upstream_connections"),
            gauge("nodedns_upstream_in_flight"),
        );
        let resets = per("nodedns_upstream_connection_resets_total", &["to"]);
        let retries = per("nodedns_upstream_retries_total", &["to"]);
        let failed = after.by("coredns_proxy_healthcheck_failures_total", &["to"]);
        let mut addresses: Vec<String> = counts
            .keys()
            .chain(connections.keys())
            .filter_map(|k| k.first().cloned())
            .collect();
        addresses.sort();
        addresses.dedup();
        let upstreams = addresses
            .into_iter()
            .map(|to| {
                let key = vec![to.clone()];
                let buckets: Vec<(f64, f64)> = durations
                    .iter()
                    .filter(|(k, _)| k.first() == Some(&to))
                    .filter_map(|(k, v)| {
                        let le = match k.get(1)?.as_str() {
                            "+Inf" => f64::INFINITY,
                            le => le.parse().ok()?,
                        };
                        Some((le, *v))
                    })
                    .collect();
                Upstream {
                    requests_per_s: counts.get(&key).copied().unwrap_or(0.0) / seconds,
                    p50: quantile(0.5, &buckets),
                    p99: quantile(0.99, &buckets),
                    connections: connections.get(&key).copied(),
                    in_flight: in_flight.get(&key).copied(),
                    resets_per_s: resets.get(&key).copied().unwrap_or(0.0) / seconds,
                    retries_per_s: retries.get(&key).copied().unwrap_or(0.0) / seconds,
                    failed_checks: failed.get(&key).copied().unwrap_or(0.0),
                    to,
                }
            })
            .collect();

        let (clients, names) = client_panels(before, after, seconds);
        View {
            clients,
            names,
            seconds,
            qps: rate("coredns_dns_requests_total"),
            udp_qps: proto("udp"),
            tcp_qps: proto("tcp"),
            hit_ratio: (requests > 0.0).then(|| hits / requests),
            hits_per_s: hits,
            misses_per_s: rate("coredns_cache_misses_total"),
            stale_per_s: rate("coredns_cache_served_stale_total"),
            prefetch_per_s: rate("coredns_cache_prefetch_total"),
            entries,
            cache_bytes: has("nodedns_cache_bytes").then(|| after.total("nodedns_cache_bytes")),
            cache_capacity: has("nodedns_cache_capacity_bytes")
                .then(|| after.total("nodedns_cache_capacity_bytes")),
            waiters: has("nodedns_singleflight_waiters")
                .then(|| after.total("nodedns_singleflight_waiters")),
            rcodes: shares(&per("coredns_dns_responses_total", &["rcode"])),
            types,
            upstreams,
        }
    }

    /// The view as text for a terminal.
    pub fn render(&self, addr: SocketAddr, interval: Duration) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let pct = |v: f64| format!("{:.1}%", v * 100.0);
        let list = |items: &[(String, f64)]| {
            if items.is_empty() {
                "-".to_owned()
            } else {
                items
                    .iter()
                    .map(|(k, v)| format!("{k} {}", pct(*v)))
                    .collect::<Vec<_>>()
                    .join("   ")
            }
        };
        let _ = writeln!(
            out,
            "nodedns top   http://{addr}/metrics   every {:.1}s   (Ctrl-C quits)\n",
            interval.as_secs_f64()
        );
        let _ = writeln!(
            out,
            "queries     {:.1}/s   udp {:.1}/s   tcp {:.1}/s",
            self.qps, self.udp_qps, self.tcp_qps
        );
        let _ = writeln!(
            out,
            "cache       hit ratio {}   hits {:.1}/s   misses {:.1}/s   served stale {:.1}/s   prefetch {:.1}/s",
            self.hit_ratio.map_or_else(|| "-".to_owned(), pct),
            self.hits_per_s,
            self.misses_per_s,
            self.stale_per_s,
            self.prefetch_per_s
        );
        let mut cache = format!("            entries {}", self.entries as u64);
        if let (Some(used), Some(capacity)) = (self.cache_bytes, self.cache_capacity) {
            let _ = write!(cache, "   {} of {}", mib(used), mib(capacity));
        }
        if let Some(waiters) = self.waiters {
            let _ = write!(cache, "   single-flight waiters {}", waiters as u64);
        }
        let _ = writeln!(out, "{cache}");
        let nxdomain = self
            .rcodes
            .iter()
            .find(|(r, _)| r == "NXDOMAIN")
            .map_or(0.0, |(_, v)| *v);
        let _ = writeln!(out, "NXDOMAIN    {} of responses", pct(nxdomain));
        let _ = writeln!(out, "rcodes      {}", list(&self.rcodes));
        let _ = writeln!(out, "types       {}", list(&self.types));
        let _ = writeln!(
            out,
            "\nupstream    {:<24} {:>9} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>13}",
            "to",
            "req/s",
            "p50",
            "p99",
            "conns",
            "in flight",
            "resets/s",
            "retries/s",
            "failed checks"
        );
        if self.upstreams.is_empty() {
            let _ = writeln!(out, "            (none)");
        }
        let ms = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |s| format!("{:.2}ms", s * 1e3));
        let share = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), pct);
        let n = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{}", v as u64));
        for u in &self.upstreams {
            let _ = writeln!(
                out,
                "            {:<24} {:>9.1} {:>9} {:>9} {:>6} {:>9} {:>9.1} {:>9.1} {:>13}",
                u.to,
                u.requests_per_s,
                ms(u.p50),
                ms(u.p99),
                n(u.connections),
                n(u.in_flight),
                u.resets_per_s,
                u.retries_per_s,
                u.failed_checks as u64
            );
        }
        let _ = writeln!(
            out,
            "\nclients     {:<40} {:>9} {:>9} {:>11} {:>9} {:>7} {:>9} {:>12}  zone",
            "client",
            "q/s",
            "NXDOMAIN",
            "search-path",
            "hit ratio",
            "long/s",
            "random/s",
            "distinct/min"
        );
        if self.clients.is_empty() {
            let _ = writeln!(out, "            (none)");
        }
        for c in &self.clients {
            let (distinct, zone) = c.distinct.as_ref().map_or(("-".to_owned(), ""), |(n, z)| {
                (format!("{}", *n as u64), z.as_str())
            });
            let _ = writeln!(
                out,
                "            {:<40} {:>9.1} {:>9} {:>11} {:>9} {:>7.1} {:>9.1} {:>12}  {zone}",
                c.client,
                c.qps,
                share(c.nxdomain),
                share(c.search_path),
                share(c.hit_ratio),
                c.long_per_s,
                c.random_per_s,
                distinct
            );
        }
        let _ = writeln!(
            out,
            "\nnames       {:<60} {:<40} {:>9}",
            "name", "client", "q/s"
        );
        if self.names.is_empty() {
            let _ = writeln!(out, "            (none)");
        }
        for n in &self.names {
            let _ = writeln!(
                out,
                "            {:<60} {:<40} {:>9.1}",
                n.name, n.client, n.qps
            );
        }
        out
    }
}

/// The clients and names panels of the interval.
fn client_panels(before: &Scrape, after: &Scrape, seconds: f64) -> (Vec<ClientRow>, Vec<NameRow>) {
    let per = |name: &str| delta(&before.by(name, &["client"]), &after.by(name, &["client"]));
    let queries = per("nodedns_client_queries_total");
    let figure = |name: &str| per(name);
    let (nx, search, hits, requests, long, random) = (
        figure("nodedns_client_nxdomain_total"),
        figure("nodedns_client_search_path_nxdomain_total"),
        figure("nodedns_client_cache_hits_total"),
        figure("nodedns_client_cache_requests_total"),
        figure("nodedns_client_long_names_total"),
        figure("nodedns_client_random_names_total"),
    );
    let distinct = after.by("nodedns_client_zone_distinct_names", &["client", "zone"]);
    let get = |m: &BTreeMap<Vec<String>, f64>, k: &Vec<String>| m.get(k).copied().unwrap_or(0.0);
    let share = |part: f64, whole: f64| (whole > 0.0).then(|| part / whole);
    let mut clients: Vec<ClientRow> = queries
        .iter()
        .filter(|(k, q)| **q > 0.0 || k.first().is_some_and(|c| c == "other"))
        .map(|(k, q)| {
            let client = k.first().cloned().unwrap_or_default();
            ClientRow {
                qps: q / seconds,
                nxdomain: share(get(&nx, k), *q),
                search_path: share(get(&search, k), *q),
                hit_ratio: share(get(&hits, k), get(&requests, k)),
                long_per_s: get(&long, k) / seconds,
                random_per_s: get(&random, k) / seconds,
                distinct: distinct
                    .iter()
                    .find(|(d, _)| {
                        d.first() == Some(&client) && d.get(1).is_some_and(|z| !z.is_empty())
                    })
                    .map(|(d, v)| (*v, d.get(1).cloned().unwrap_or_default())),
                client,
            }
        })
        .collect();
    // Heaviest first; `other` last, whatever its rate.
    clients.sort_by(|a, b| {
        (a.client == "other")
            .cmp(&(b.client == "other"))
            .then_with(|| b.qps.total_cmp(&a.qps))
            .then_with(|| a.client.cmp(&b.client))
    });
    if clients.len() > PANEL_ROWS + 1 {
        clients.drain(PANEL_ROWS..clients.len() - 1);
    }
    if clients.iter().all(|c| c.client == "other" && c.qps == 0.0) {
        clients.clear();
    }
    let asked = delta(
        &before.by("nodedns_client_name_queries_total", &["client", "name"]),
        &after.by("nodedns_client_name_queries_total", &["client", "name"]),
    );
    let mut names: Vec<NameRow> = asked
        .iter()
        .filter(|(_, v)| **v > 0.0)
        .map(|(k, v)| NameRow {
            client: k.first().cloned().unwrap_or_default(),
            name: k.get(1).cloned().unwrap_or_default(),
            qps: v / seconds,
        })
        .collect();
    names.sort_by(|a, b| {
        b.qps
            .total_cmp(&a.qps)
            .then_with(|| a.name.cmp(&b.name))
            .then_with(|| a.client.cmp(&b.client))
    });
    names.truncate(PANEL_ROWS);
    (clients, names)
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# HELP coredns_dns_requests_total Counter of DNS requests made per zone, protocol and family.
# TYPE coredns_dns_requests_total counter
coredns_dns_requests_total{server="dns://:53",zone=".",view="",proto="udp",family="1",type="A"} 100
coredns_dns_requests_total{server="dns://:53",zone=".",view="",proto="udp",family="1",type="AAAA"} 100
coredns_dns_responses_total{server="dns://:53",zone=".",view="",rcode="NOERROR",plugin="cache"} 150
coredns_dns_responses_total{server="dns://:53",zone=".",view="",rcode="NXDOMAIN",plugin="cache"} 50
coredns_cache_hits_total{server="dns://:53",type="success",zones=".",view=""} 100
coredns_cache_requests_total{server="dns://:53",zones=".",view=""} 200
coredns_proxy_request_duration_seconds_bucket{proxy_name="forward",to="10.0.0.1:53",rcode="NOERROR",le="0.001"} 10
coredns_proxy_request_duration_seconds_bucket{proxy_name="forward",to="10.0.0.1:53",rcode="NOERROR",le="0.002"} 20
coredns_proxy_request_duration_seconds_bucket{proxy_name="forward",to="10.0.0.1:53",rcode="NOERROR",le="+Inf"} 20
coredns_proxy_request_duration_seconds_count{proxy_name="forward",to="10.0.0.1:53",rcode="NOERROR"} 20
"#;

    const AFTER: &str = r#"coredns_dns_requests_total{server="dns://:53",zone=".",view="",proto="udp",family="1",type="A"} 400
coredns_dns_requests_total{server="dns://:53",zone=".",view="",proto="udp",family="1",type="AAAA"} 300
coredns_dns_requests_total{server="dns://:53",zone=".",view="",proto="tcp",family="1",type="SRV"} 100
coredns_dns_responses_total{server="dns://:53",zone=".",view="",rcode="NOERROR",plugin="cache"} 350
coredns_dns_responses_total{server="dns://:53",zone=".",view="",rcode="NXDOMAIN",plugin="cache"} 450
coredns_cache_hits_total{server="dns://:53",type="success",zones=".",view=""} 500
coredns_cache_hits_total{server="dns://:53",type="denial",zones=".",view=""} 100
coredns_cache_requests_total{server="dns://:53",zones=".",view=""} 1000
coredns_cache_entries{server="dns://169.254.20.10:53",type="success",zones=".",view=""} 7
coredns_cache_entries{server="dns://10.96.0.10:53",type="success",zones=".",view=""} 7
coredns_cache_entries{server="dns://10.96.0.10:53",type="denial",zones=".",view=""} 3
nodedns_cache_bytes{zones="."} 1048576
nodedns_cache_capacity_bytes{zones="."} 16777216
nodedns_singleflight_waiters{zones="."} 2
coredns_proxy_request_duration_seconds_bucket{proxy_name="forward",to="10.0.0.1:53",rcode="NOERROR",le="0.001"} 60
coredns_proxy_request_duration_seconds_bucket{proxy_name="forward",to="10.0.0.1:53",rcode="NOERROR",le="0.002"} 120
coredns_proxy_request_duration_seconds_bucket{proxy_name="forward",to="10.0.0.1:53",rcode="NOERROR",le="+Inf"} 120
coredns_proxy_request_duration_seconds_count{proxy_name="forward",to="10.0.0.1:53",rcode="NOERROR"} 120
nodedns_upstream_connections{to="10.0.0.1:53"} 3
nodedns_upstream_in_flight{to="10.0.0.1:53"} 1
nodedns_upstream_retries_total{to="10.0.0.1:53"} 4
"#;

    fn scrapes() -> (Scrape, Scrape) {
        let t0 = Instant::now();
        (
            Scrape {
                at: t0,
                samples: parse(BEFORE),
            },
            Scrape {
                at: t0 + Duration::from_secs(2),
                samples: parse(AFTER),
            },
        )
    }

    #[test]
    fn sample_lines_parse_with_escapes_and_special_values() {
        let s = parse(
            "# TYPE x counter\nx{a=\"q\\\"uo\\\\te\\n\",b=\"\"} 1.5e3\ny +Inf\nz{} NaN 1700000000\n\nbroken{a=\"x\n",
        );
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].name, "x");
        assert_eq!(
            s[0].labels,
            [
                ("a".to_owned(), "q\"uo\\te\n".to_owned()),
                ("b".to_owned(), String::new())
            ]
        );
        assert_eq!(s[0].value, 1500.0);
        assert_eq!(s[1].value, f64::INFINITY);
        assert!(s[2].value.is_nan());
    }

    #[test]
    fn chunked_bodies_are_decoded() {
        assert_eq!(
            dechunk("5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n").as_deref(),
            Some("hello world")
        );
        assert_eq!(dechunk("5\r\nhel"), None);
    }

    #[test]
    fn quantiles_interpolate_inside_the_bucket_like_promql() {
        let b = [(0.001, 50.0), (0.002, 100.0), (f64::INFINITY, 100.0)];
        assert_eq!(quantile(0.5, &b), Some(0.001));
        assert!((quantile(0.75, &b).unwrap() - 0.0015).abs() < 1e-12);
        assert_eq!(quantile(0.5, &[(0.001, 0.0), (f64::INFINITY, 0.0)]), None);
        // Beyond the last finite bound: that bound.
        assert_eq!(
            quantile(0.99, &[(0.001, 1.0), (f64::INFINITY, 10.0)]),
            Some(0.001)
        );
    }

    #[test]
    fn the_view_shows_rates_ratios_and_shares_over_the_interval() {
        let (before, after) = scrapes();
        let v = View::between(&before, &after);
        assert_eq!(v.seconds, 2.0);
        assert_eq!(v.qps, 300.0, "(800 - 200) / 2 s");
        assert_eq!((v.udp_qps, v.tcp_qps), (250.0, 50.0));
        assert_eq!(v.hit_ratio, Some(0.625), "500 hits of 800 cache requests");
        assert_eq!(
            v.rcodes,
            [
                ("NXDOMAIN".to_owned(), 400.0 / 600.0),
                ("NOERROR".to_owned(), 200.0 / 600.0)
            ]
        );
        assert_eq!(v.types[0], ("A".to_owned(), 0.5));
        assert_eq!(
            v.entries, 10.0,
            "one cache reported on two addresses counts once"
        );
        assert_eq!(v.cache_bytes, Some(1048576.0));
        assert_eq!(v.waiters, Some(2.0));
        let u = &v.upstreams[0];
        assert_eq!(u.to, "10.0.0.1:53");
        assert_eq!(u.requests_per_s, 50.0);
        assert!((u.p50.unwrap() - 0.001).abs() < 1e-12, "{:?}", u.p50);
        assert_eq!(u.connections, Some(3.0));
        assert_eq!(u.retries_per_s, 2.0);
        let text = v.render("127.0.0.1:9253".parse().unwrap(), Duration::from_secs(2));
        for part in [
            "queries     300.0/s",
            "hit ratio 62.5%",
            "NXDOMAIN    66.7% of responses",
            "A 50.0%",
            "10.0.0.1:53",
            "1.0 MiB of 16.0 MiB",
        ] {
            assert!(text.contains(part), "{part:?} missing from\n{text}");
        }
    }

    #[test]
    fn the_clients_panel_puts_the_heaviest_first_and_other_last() {
        let before = parse(
            r#"nodedns_client_queries_total{client="10.244.1.17"} 1000
nodedns_client_queries_total{client="10.244.2.5"} 100
nodedns_client_queries_total{client="other"} 50
nodedns_client_name_queries_total{client="10.244.1.17",name="api.example.com.default.svc.cluster.local."} 160
"#,
        );
        let after = parse(
            r#"nodedns_client_queries_total{client="10.244.1.17"} 1500
nodedns_client_queries_total{client="10.244.2.5"} 300
nodedns_client_queries_total{client="10.244.3.9"} 20
nodedns_client_queries_total{client="other"} 60
nodedns_client_nxdomain_total{client="10.244.1.17"} 375
nodedns_client_search_path_nxdomain_total{client="10.244.1.17"} 375
nodedns_client_cache_hits_total{client="10.244.1.17"} 450
nodedns_client_cache_requests_total{client="10.244.1.17"} 500
nodedns_client_random_names_total{client="10.244.2.5"} 10
nodedns_client_zone_distinct_names{client="10.244.2.5",zone="t.example.com."} 42
nodedns_client_zone_distinct_names{client="10.244.3.9",zone=""} 0
nodedns_client_name_queries_total{client="10.244.1.17",name="api.example.com.default.svc.cluster.local."} 320
nodedns_client_name_queries_total{client="10.244.2.5",name="x.t.example.com."} 16
"#,
        );
        let t0 = Instant::now();
        let v = View::between(
            &Scrape {
                at: t0,
                samples: before,
            },
            &Scrape {
                at: t0 + Duration::from_secs(2),
                samples: after,
            },
        );
        let order: Vec<&str> = v.clients.iter().map(|c| c.client.as_str()).collect();
        assert_eq!(order, ["10.244.1.17", "10.244.2.5", "10.244.3.9", "other"]);
        let heavy = &v.clients[0];
        assert_eq!(heavy.qps, 250.0);
        assert_eq!(heavy.nxdomain, Some(0.75));
        assert_eq!(heavy.search_path, Some(0.75));
        assert_eq!(heavy.hit_ratio, Some(0.9));
        assert_eq!(v.clients[1].random_per_s, 5.0);
        assert_eq!(
            v.clients[1].distinct,
            Some((42.0, "t.example.com.".to_owned()))
        );
        assert_eq!(v.clients[2].hit_ratio, None);
        assert_eq!(v.clients[2].distinct, None, "no watch: no zone");
        assert_eq!(v.names[0].qps, 80.0);
        assert_eq!(v.names[0].client, "10.244.1.17");
        let text = v.render("127.0.0.1:9253".parse().unwrap(), Duration::from_secs(2));
        for part in [
            "clients     client",
            "10.244.1.17                                  250.0     75.0%       75.0%     90.0%",
            "t.example.com.",
            "api.example.com.default.svc.cluster.local.",
        ] {
            assert!(text.contains(part), "{part:?} missing from\n{text}");
        }
    }

    #[test]
    fn an_idle_interval_shows_dashes_not_nan() {
        let (_, after) = scrapes();
        let later = Scrape {
            at: after.at + Duration::from_secs(1),
            samples: after.samples.clone(),
        };
        let v = View::between(&after, &later);
        assert_eq!(v.qps, 0.0);
        assert_eq!(v.hit_ratio, None);
        assert!(v.rcodes.is_empty());
        let text = v.render("127.0.0.1:9253".parse().unwrap(), Duration::from_secs(1));
        assert!(!text.contains("NaN"), "{text}");
    }

    #[test]
    fn rates_of_series_the_agent_has_not_written_are_zero_not_minus_zero() {
        let t0 = Instant::now();
        let empty = |at| Scrape {
            at,
            samples: Vec::new(),
        };
        let v = View::between(&empty(t0), &empty(t0 + Duration::from_secs(1)));
        for rate in [
            v.qps,
            v.hits_per_s,
            v.misses_per_s,
            v.stale_per_s,
            v.prefetch_per_s,
        ] {
            assert!(rate == 0.0 && rate.is_sign_positive(), "{rate}");
        }
        assert!(v.entries.is_sign_positive());
        let text = v.render("127.0.0.1:9253".parse().unwrap(), Duration::from_secs(1));
        assert!(!text.contains("-0.0"), "{text}");
        assert!(text.contains("served stale 0.0/s"), "{text}");
    }
}
