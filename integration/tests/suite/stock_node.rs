//! A node as node-local-dns sees it, for the configuration black-box tests: nodedns started with
//! the stock DaemonSet's arguments, the stock Corefile mounted the way the kubelet mounts a
//! ConfigMap (`..data` symlink swaps), the kube-dns ConfigMap, the node's resolv.conf, and real
//! Knot servers at the addresses a cluster gives them, all inside one network namespace:
//!
//! | address | what |
//! | --- | --- |
//! | 169.254.20.10, 10.96.0.10 | nodedns (`-localip`): the link-local address and the kube-dns ClusterIP |
//! | 10.96.0.11:53 | the cluster DNS behind `kube-dns-upstream` (Knot: `cluster.local.`, `96.10.in-addr.arpa.`) |
//! | 10.0.0.2:53 | the node's resolver, named by its resolv.conf (Knot: `*.example.` → 192.0.2.1) |
//! | 10.0.0.3:53 | the server of the kube-dns stub domain `acme.local` (Knot) |
//! | 10.0.0.4:53 | a second resolver, for reloads to switch to (Knot: `*.example.` → 192.0.2.4) |
//!
//! Why a namespace: nodedns refuses a resolv.conf that names a loopback address (a local stub),
//! so the node's resolver needs an ordinary address, and only a namespace of the test's own may
//! have one. Every address sits on the namespace's loopback. The test's clients enter the
//! namespace from threads of their own ([`in_netns`], `setns`), so they are real UDP/TCP clients
//! of nodedns, like a pod. nodedns does no host setup (`-setupinterface=false
//! -setupiptables=false`): the addresses are already there, and the rules are not the subject.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use nix::sched::CloneFlags;
use nodedns_integration::knot::{Knot, Options, Zone};
use nodedns_integration::netns::{self, Netns};
use nodedns_integration::{Process, TempDir, client, nodedns_bin};

pub const LOCAL: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);
pub const KUBE_DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const KUBE_DNS_UPSTREAM: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
pub const NODE_RESOLVER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
pub const STUB: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 3);
pub const SPARE_RESOLVER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 4);
/// What the node resolver answers for `*.example.`.
pub const FROM_NODE_RESOLVER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// What the spare resolver answers for `*.example.`.
pub const FROM_SPARE_RESOLVER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 4);
/// `prometheus :9253` in the stock Corefile: every address of the namespace.
pub const METRICS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9253);
/// `health __PILLAR__LOCAL__DNS__:8080` in the stock Corefile.
pub const HEALTH: SocketAddr = SocketAddr::new(IpAddr::V4(LOCAL), 8080);

/// The stock Corefile (`Corefile` key of the node-local-dns ConfigMap), verbatim.
const STOCK_COREFILE: &str =
    include_str!("../../../crates/agent/src/config/testdata/Corefile.base");
/// The stock DaemonSet's `args:`, verbatim.
const STOCK_ARGS: &str =
    include_str!("../../../crates/agent/src/config/testdata/daemonset-args.json");

/// The stock Corefile after the manifest's documented install step (iptables mode): the domain,
/// the local address and the kube-dns ClusterIP filled in. nodedns fills the rest
/// (`__PILLAR__CLUSTER__DNS__`, `__PILLAR__UPSTREAM__SERVERS__`), as node-cache does.
pub fn stock_corefile() -> String {
    STOCK_COREFILE
        .replace("__PILLAR__DNS__DOMAIN__", "cluster.local")
        .replace("__PILLAR__LOCAL__DNS__", &LOCAL.to_string())
        .replace("__PILLAR__DNS__SERVER__", &KUBE_DNS.to_string())
}

/// Tools the node needs; `None` when everything is there.
pub fn unavailable() -> Option<String> {
    netns::unavailable(&["ip", "knotd", "knotc", "kdig"])
}

/// Runs `f` on a thread inside network namespace `ns`: its sockets live there.
pub fn in_netns<T: Send>(ns: &Netns, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                enter(ns);
                f()
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Starts `f` on a thread inside network namespace `ns`.
pub fn spawn_in_netns<T: Send + 'static>(
    ns: &Netns,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    let path = netns_path(ns);
    std::thread::spawn(move || {
        enter_path(&path);
        f()
    })
}

fn netns_path(ns: &Netns) -> PathBuf {
    Path::new("/run/netns").join(ns.name())
}

fn enter(ns: &Netns) {
    enter_path(&netns_path(ns));
}

/// Moves the calling thread (only it) into the namespace at `path`.
fn enter_path(path: &Path) {
    let file = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    nix::sched::setns(&file, CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns {}: {e}", path.display()));
}

/// A directory laid out as the kubelet mounts a ConfigMap: each key is a symlink through
/// `..data`, which points at a versioned directory; an update writes a new version and swaps
/// `..data` atomically (a new symlink renamed over the old one).
#[derive(Debug)]
pub struct ConfigMap {
    dir: PathBuf,
    version: u32,
}

impl ConfigMap {
    pub fn create(dir: PathBuf, files: &[(&str, &str)]) -> anyhow::Result<ConfigMap> {
        std::fs::create_dir_all(&dir)?;
        let mut map = ConfigMap { dir, version: 0 };
        map.update(files)?;
        Ok(map)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    /// Publishes a new version holding `files`.
    pub fn update(&mut self, files: &[(&str, &str)]) -> anyhow::Result<()> {
        self.version += 1;
        let version = format!("..v{}", self.version);
        let data = self.dir.join(&version);
        std::fs::create_dir_all(&data)?;
        for (key, text) in files {
            std::fs::write(data.join(key), text)?;
            let link = self.dir.join(key);
            if std::fs::symlink_metadata(&link).is_err() {
                symlink(Path::new("..data").join(key), &link)?;
            }
        }
        let tmp = self.dir.join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        symlink(&version, &tmp)?;
        std::fs::rename(&tmp, self.dir.join("..data")).context("swap ..data")?;
        Ok(())
    }
}

/// The node. Fields drop in declaration order: nodedns and the servers stop before their
/// directories and the namespace go.
#[derive(Debug)]
pub struct StockNode {
    agent: Process,
    /// The cluster DNS (kube-dns-upstream).
    pub cluster: Knot,
    /// UDP queries the cluster DNS had received before nodedns started (the harness's own
    /// start-up checks).
    pub cluster_udp_before: u64,
    /// The node's resolver (its resolv.conf).
    pub resolver: Knot,
    /// The kube-dns stub domain's server.
    pub stub: Knot,
    /// A resolver nothing uses until a test reloads to it.
    pub spare: Knot,
    /// The node-local-dns ConfigMap (`Corefile.base`).
    pub corefile: ConfigMap,
    /// Where node-cache writes the rendered Corefile (`-conf`).
    pub rendered: PathBuf,
    /// Where the above live: held only to be removed on drop.
    _dir: TempDir,
    pub ns: Netns,
}

fn zone(origin: &str, body: &str) -> Zone {
    Zone {
        origin: origin.to_owned(),
        body: body.to_owned(),
    }
}

fn knot(ns: &Netns, addr: Ipv4Addr, zones: Vec<Zone>) -> anyhow::Result<Knot> {
    Knot::start(Options {
        listen: vec![SocketAddr::new(addr.into(), 53)],
        netns: Some(ns.name().to_owned()),
        zones,
    })
}

/// The stock DaemonSet's arguments with the container's paths moved into `dir`.
fn daemonset_args(dir: &Path, rendered: &Path) -> Vec<String> {
    // A JSON list of plain strings: every other piece between quotes is one.
    let args: Vec<&str> = STOCK_ARGS.split('"').skip(1).step_by(2).collect();
    assert_eq!(args.len(), 8, "stock DaemonSet args changed: {STOCK_ARGS}");
    args.iter()
        .map(|arg| match *arg {
            "__PILLAR__LOCAL__DNS__,__PILLAR__DNS__SERVER__" => format!("{LOCAL},{KUBE_DNS}"),
            "/etc/Corefile" => rendered.display().to_string(),
            "/tmp/node-cache.pid" => dir.join("node-cache.pid").display().to_string(),
            other => other.to_owned(),
        })
        .collect()
}

impl StockNode {
    /// Builds the node and starts nodedns with `corefile` as the ConfigMap's `Corefile`; returns
    /// once nodedns answers on both local addresses.
    pub fn start(corefile: &str) -> anyhow::Result<StockNode> {
        StockNode::start_with(corefile, &[])
    }

    /// [`StockNode::start`] with `extra` after the DaemonSet's arguments.
    pub fn start_with(corefile: &str, extra: &[&str]) -> anyhow::Result<StockNode> {
        let ns = Netns::create(&format!("{}-cfg", netns::unique_prefix()))?;
        for ip in [
            LOCAL,
            KUBE_DNS,
            KUBE_DNS_UPSTREAM,
            NODE_RESOLVER,
            STUB,
            SPARE_RESOLVER,
        ] {
            ns.run("ip", &["addr", "add", &format!("{ip}/32"), "dev", "lo"])?;
        }
        let fixture = |name: &str| -> anyhow::Result<String> {
            let path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("testdata/config")
                .join(name);
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
        };
        let cluster = knot(
            &ns,
            KUBE_DNS_UPSTREAM,
            vec![
                Knot::cluster_local(),
                zone("96.10.in-addr.arpa.", &fixture("96.10.in-addr.arpa.zone")?),
            ],
        )?;
        let cluster_udp_before = udp_queries(&cluster);
        let resolver = knot(
            &ns,
            NODE_RESOLVER,
            vec![zone(".", &fixture("node-resolver.zone")?)],
        )?;
        let stub = knot(
            &ns,
            STUB,
            vec![zone("acme.local.", &fixture("acme.local.zone")?)],
        )?;
        let spare = knot(
            &ns,
            SPARE_RESOLVER,
            vec![zone(".", &fixture("spare-resolver.zone")?)],
        )?;

        let dir = TempDir::new("nodedns-stock")?;
        let corefile =
            ConfigMap::create(dir.path().join("coredns"), &[("Corefile.base", corefile)])?;
        let kube_dns = ConfigMap::create(
            dir.path().join("kube-dns"),
            &[("stubDomains", &fixture("stubDomains")?)],
        )?;
        let resolv_conf = dir.path().join("resolv.conf");
        std::fs::write(&resolv_conf, format!("nameserver {NODE_RESOLVER}\n"))?;
        let rendered = dir.path().join("Corefile");

        let mut command = ns.command(&nodedns_bin().display().to_string());
        command
            .args(daemonset_args(dir.path(), &rendered))
            .arg("-basecorefile")
            .arg(corefile.path("Corefile.base"))
            .arg("-kubednscm")
            .arg(kube_dns.dir())
            .arg("--resolv-conf")
            .arg(&resolv_conf)
            .args(["-setupinterface=false", "-setupiptables=false"])
            .args(extra)
            .env(
                "KUBE_DNS_UPSTREAM_SERVICE_HOST",
                KUBE_DNS_UPSTREAM.to_string(),
            )
            .env("KUBE_DNS_UPSTREAM_SERVICE_PORT", "53")
            .env_remove("NODEDNS_HANDOFF_DIR")
            .env("RUST_BACKTRACE", "1");
        let agent = Process::spawn("nodedns", command).context("spawn nodedns")?;
        let mut node = StockNode {
            agent,
            cluster,
            cluster_udp_before,
            resolver,
            stub,
            spare,
            corefile,
            rendered,
            _dir: dir,
            ns,
        };
        node.wait_serving()
            .with_context(|| format!("nodedns output:\n{}", node.output()))?;
        Ok(node)
    }

    /// Waits until nodedns answers on both local addresses (a TXT query: no test counts those).
    fn wait_serving(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.agent.exited() {
                bail!("nodedns exited during start-up: {status}");
            }
            let answering = [LOCAL, KUBE_DNS].iter().all(|ip| {
                self.ask(IpAddr::V4(*ip), "up.example.", RecordType::TXT)
                    .is_ok_and(|r| r.metadata.response_code == ResponseCode::NoError)
            });
            if answering {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("nodedns does not answer after 20 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// One UDP query to `server`:53 from inside the node (2 s, a stub resolver's patience).
    pub fn ask(&self, server: IpAddr, name: &str, rtype: RecordType) -> anyhow::Result<Message> {
        let query = client::query(name, rtype);
        in_netns(&self.ns, || {
            client::udp_blocking(SocketAddr::new(server, 53), &query, Duration::from_secs(2))
        })
    }

    /// `GET path` over HTTP/1.0 from inside the node; the body of a 200 answer.
    pub fn http_get(&self, addr: SocketAddr, path: &str) -> anyhow::Result<String> {
        let response = in_netns(&self.ns, || -> anyhow::Result<String> {
            let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
            stream.set_read_timeout(Some(Duration::from_secs(5)))?;
            write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            Ok(response)
        })?;
        match response.split_once("\r\n\r\n") {
            Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
                Ok(body.to_owned())
            }
            _ => bail!("GET {path} from {addr}: {response}"),
        }
    }

    /// The value of the series `series` (`name` or `name{labels}`, exactly as exposed) in
    /// `/metrics`; `None` when it is not there.
    pub fn metric(&self, series: &str) -> anyhow::Result<Option<f64>> {
        let text = self.http_get(METRICS, "/metrics")?;
        Ok(text.lines().find_map(|line| {
            let value = line.strip_prefix(series)?.strip_prefix(' ')?;
            value.split_whitespace().next()?.parse().ok()
        }))
    }

    /// Polls `metric(series)` until `want` holds or `limit` passes; returns the last value.
    pub fn wait_metric(
        &self,
        series: &str,
        limit: Duration,
        want: impl Fn(f64) -> bool,
    ) -> anyhow::Result<f64> {
        let deadline = Instant::now() + limit;
        loop {
            let value = self.metric(series)?.unwrap_or(f64::NAN);
            if want(value) || Instant::now() >= deadline {
                return Ok(value);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Polls nodedns's output until it contains `fragment` or `limit` passes.
    pub fn wait_output(&self, fragment: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while !self.output().contains(fragment) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// Everything nodedns wrote so far.
    pub fn output(&self) -> String {
        self.agent.output()
    }

    /// Whether nodedns still runs.
    pub fn alive(&mut self) -> bool {
        self.agent.exited().is_none()
    }

    /// Publishes `text` as the ConfigMap's new `Corefile`.
    pub fn write_corefile(&mut self, text: &str) -> anyhow::Result<()> {
        self.corefile.update(&[("Corefile.base", text)])
    }
}

/// Queries of type `rtype` `knot` has received.
pub fn queries(knot: &Knot, rtype: &str) -> u64 {
    knot.queries_of_type(rtype).expect("knotc stats")
}

/// Queries `knot` has received over UDP.
pub fn udp_queries(knot: &Knot) -> u64 {
    knot.queries().expect("knotc stats") - knot.tcp_queries().expect("knotc stats")
}

/// The IPv4 addresses of `reply`'s answer, or why it is not a NOERROR answer with some.
pub fn a_answer(reply: &anyhow::Result<Message>) -> Result<Vec<Ipv4Addr>, String> {
    match reply {
        Err(e) => Err(format!("{e:#}")),
        Ok(m) if m.metadata.response_code != ResponseCode::NoError => {
            Err(format!("{}", m.metadata.response_code))
        }
        Ok(m) => match client::a_addrs(m) {
            addrs if addrs.is_empty() => Err("NOERROR without an A record".to_owned()),
            addrs => Ok(addrs),
        },
    }
}
