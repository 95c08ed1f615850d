//! The Kubernetes manifests against the binary they deploy, so that they can never drift from
//! what it accepts.
//!
//! For each rendered mode (`manifests/<mode>/nodedns.yaml`) and for the stock
//! `nodelocaldns.yaml` (`manifests/testdata/`, filled with the `sed` of the Kubernetes docs), the
//! pod's filesystem is laid out in a temp dir the way the kubelet would mount it (ConfigMaps with
//! their `items`, the optional kube-dns ConfigMap as an empty directory, emptyDirs, hostPath
//! files, the node's resolv.conf for `dnsPolicy: Default`), the Service environment variables the
//! kubelet sets are set, and the DaemonSet's own `args`, with each absolute path moved under that
//! directory, are run as `nodedns <args> --check-config`: the same load as in a pod.
//!
//! Then what the binary says it serves is held against the rest of the manifest: the probes hit
//! the addresses where /health and /ready are served, the metrics Service and the scrape
//! annotation name the port of /metrics, Cilium's redirect names the ports DNS is served on.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

use yaml_rust2::{Yaml, YamlLoader};

/// The values the committed manifests are rendered with (scripts/render-manifests' defaults;
/// ci/manifests.sh fails when the committed files differ from a fresh render).
const LOCAL_DNS: &str = "169.254.20.10";
const KUBE_DNS: &str = "10.96.0.10";
const DOMAIN: &str = "cluster.local";

/// The ClusterIP the test gives every Service that has one (Kubernetes hands it to the pod as
/// `<NAME>_SERVICE_HOST`).
const SERVICE_IP: &str = "10.96.7.7";
/// The only nameserver of the node's resolv.conf (TEST-NET-1: nothing is ever sent to it).
const NODE_NAMESERVER: &str = "192.0.2.53";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("nodedns-manifests-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn str_of<'a>(y: &'a Yaml, what: &str) -> &'a str {
    y.as_str()
        .unwrap_or_else(|| panic!("{what}: not a string: {y:?}"))
}

fn vec_of(y: &Yaml) -> &[Yaml] {
    y.as_vec().map(Vec::as_slice).unwrap_or_default()
}

/// An integer, or a string holding one (Kubernetes accepts both for ports and annotations).
fn port_of(y: &Yaml, what: &str) -> u16 {
    match y {
        Yaml::Integer(n) => u16::try_from(*n).ok(),
        Yaml::String(s) => s.parse().ok(),
        _ => None,
    }
    .unwrap_or_else(|| panic!("{what}: not a port number: {y:?}"))
}

/// One manifest file: its objects.
struct Manifest {
    name: String,
    docs: Vec<Yaml>,
}

impl Manifest {
    fn parse(name: &str, text: &str) -> Manifest {
        let docs = YamlLoader::load_from_str(text)
            .unwrap_or_else(|e| panic!("{name}: not YAML: {e}"))
            .into_iter()
            .filter(|d| !d.is_null())
            .collect();
        Manifest {
            name: name.to_owned(),
            docs,
        }
    }

    fn mode(mode: &str) -> Manifest {
        let path = repo().join("manifests").join(mode).join("nodedns.yaml");
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Manifest::parse(&format!("manifests/{mode}/nodedns.yaml"), &text)
    }

    fn objects<'a>(&'a self, kind: &str) -> impl Iterator<Item = &'a Yaml> + use<'a> {
        let kind = kind.to_owned();
        self.docs
            .iter()
            .filter(move |d| d["kind"].as_str() == Some(kind.as_str()))
    }

    fn object(&self, kind: &str, name: &str) -> Option<&Yaml> {
        self.objects(kind)
            .find(|d| d["metadata"]["name"].as_str() == Some(name))
    }

    fn daemonset(&self) -> &Yaml {
        let all: Vec<&Yaml> = self.objects("DaemonSet").collect();
        assert_eq!(all.len(), 1, "{}: one DaemonSet expected", self.name);
        all[0]
    }

    fn pod(&self) -> &Yaml {
        &self.daemonset()["spec"]["template"]["spec"]
    }

    fn container(&self) -> &Yaml {
        let containers = vec_of(&self.pod()["containers"]);
        assert_eq!(containers.len(), 1, "{}: one container expected", self.name);
        &containers[0]
    }

    fn args(&self) -> Vec<String> {
        vec_of(&self.container()["args"])
            .iter()
            .map(|a| str_of(a, "args").to_owned())
            .collect()
    }

    /// The environment the kubelet gives the pod for the Services of its namespace that have a
    /// ClusterIP (`enableServiceLinks`, on by default).
    fn service_env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        for svc in self.objects("Service") {
            if svc["spec"]["clusterIP"].as_str() == Some("None") {
                continue;
            }
            let name = str_of(&svc["metadata"]["name"], "Service name")
                .replace('-', "_")
                .to_ascii_uppercase();
            env.insert(format!("{name}_SERVICE_HOST"), SERVICE_IP.to_owned());
            if let Some(port) = vec_of(&svc["spec"]["ports"]).first() {
                env.insert(
                    format!("{name}_SERVICE_PORT"),
                    port_of(&port["port"], "Service port").to_string(),
                );
            }
        }
        env
    }
}

/// The pod's filesystem as the kubelet would mount it, under a temp dir.
struct Pod {
    dir: TempDir,
    /// Extra ConfigMaps that exist in the cluster but not in the manifest (the kube-dns one).
    cluster_configmaps: BTreeMap<String, BTreeMap<String, String>>,
}

impl Pod {
    fn new() -> Pod {
        Pod {
            dir: TempDir::new(),
            cluster_configmaps: BTreeMap::new(),
        }
    }

    fn root(&self) -> &Path {
        &self.dir.0
    }

    /// `path` inside the pod → the same path under the temp dir.
    fn host_path(&self, path: &str) -> PathBuf {
        self.root().join(path.trim_start_matches('/'))
    }

    /// Lays out every volume the container mounts, and the files the image and the kubelet
    /// provide.
    fn mount(&self, m: &Manifest) {
        let pod = m.pod();
        let volumes: BTreeMap<&str, &Yaml> = vec_of(&pod["volumes"])
            .iter()
            .map(|v| (str_of(&v["name"], "volume name"), v))
            .collect();
        for mount in vec_of(&m.container()["volumeMounts"]) {
            let name = str_of(&mount["name"], "volumeMount name");
            let at = self.host_path(str_of(&mount["mountPath"], "mountPath"));
            let volume = volumes
                .get(name)
                .unwrap_or_else(|| panic!("{}: no volume {name}", m.name));
            if let Some(cm) = volume["configMap"].as_hash().map(|_| &volume["configMap"]) {
                let cm_name = str_of(&cm["name"], "configMap name");
                let data: BTreeMap<String, String> = match m.object("ConfigMap", cm_name) {
                    Some(obj) => obj["data"]
                        .as_hash()
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| {
                            (
                                str_of(k, "data key").to_owned(),
                                str_of(v, "data value").to_owned(),
                            )
                        })
                        .collect(),
                    None => match self.cluster_configmaps.get(cm_name) {
                        Some(data) => data.clone(),
                        None => {
                            assert_eq!(
                                cm["optional"].as_bool(),
                                Some(true),
                                "{}: ConfigMap {cm_name} is neither in the manifest nor optional",
                                m.name
                            );
                            BTreeMap::new()
                        }
                    },
                };
                std::fs::create_dir_all(&at).unwrap();
                match cm["items"].as_vec() {
                    Some(items) => {
                        for item in items {
                            let key = str_of(&item["key"], "item key");
                            let text = data.get(key).unwrap_or_else(|| {
                                panic!("{}: ConfigMap {cm_name} has no key {key}", m.name)
                            });
                            std::fs::write(at.join(str_of(&item["path"], "item path")), text)
                                .unwrap();
                        }
                    }
                    None => {
                        for (key, text) in &data {
                            std::fs::write(at.join(key), text).unwrap();
                        }
                    }
                }
            } else if !volume["emptyDir"].is_badvalue() {
                std::fs::create_dir_all(&at).unwrap();
            } else if let Some(kind) = volume["hostPath"]["type"].as_str() {
                std::fs::create_dir_all(at.parent().unwrap()).unwrap();
                match kind {
                    "FileOrCreate" | "File" => std::fs::write(&at, "").unwrap(),
                    _ => std::fs::create_dir_all(&at).unwrap(),
                }
            } else {
                panic!(
                    "{}: volume {name} is of a kind this test does not lay out",
                    m.name
                );
            }
        }
        // From the image: /tmp and /etc (Dockerfile). From the kubelet: the node's resolv.conf
        // (dnsPolicy: Default).
        assert_eq!(pod["dnsPolicy"].as_str(), Some("Default"), "{}", m.name);
        std::fs::create_dir_all(self.host_path("/tmp")).unwrap();
        std::fs::create_dir_all(self.host_path("/etc")).unwrap();
        std::fs::write(
            self.host_path("/etc/resolv.conf"),
            format!("nameserver {NODE_NAMESERVER}\n"),
        )
        .unwrap();
    }

    /// The container's args with every absolute path moved under the temp dir, plus the one path
    /// the pod never names: the resolv.conf. `--flag=/path` and `-flag /path` are both rewritten.
    fn args(&self, args: &[String]) -> Vec<String> {
        let mut out: Vec<String> = args
            .iter()
            .map(|a| match a.split_once("=/") {
                Some((flag, path)) if a.starts_with('-') => {
                    format!("{flag}={}", self.host_path(&format!("/{path}")).display())
                }
                _ if a.starts_with('/') => self.host_path(a).display().to_string(),
                _ => a.clone(),
            })
            .collect();
        out.push(format!(
            "--resolv-conf={}",
            self.host_path("/etc/resolv.conf").display()
        ));
        out
    }
}

/// What `--check-config` printed, read back.
#[derive(Debug, Default)]
struct Summary {
    /// zone → (listen addresses, upstream addresses)
    blocks: BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)>,
    health: Option<String>,
    ready: Option<String>,
    metrics: Option<String>,
    /// node-cache's `-metrics-listen-address`, served beside `prometheus`.
    node_cache_metrics: Option<String>,
}

impl Summary {
    /// Lines like `cluster.local. on 169.254.20.10:53 10.96.0.10:53: forward Tcp to
    /// 10.96.7.7:53; cache 10223616 bytes`, `health on 169.254.20.10:8080`; the indented lines
    /// of the warnings and differences that follow are not read.
    fn parse(text: &str) -> Summary {
        let mut s = Summary::default();
        for line in text.lines().filter(|l| !l.starts_with(' ')) {
            if let Some((zone, rest)) = line.split_once(" on ") {
                match zone {
                    "health" => s.health = Some(rest.to_owned()),
                    "ready" => s.ready = Some(rest.to_owned()),
                    "metrics" => s.metrics = Some(rest.to_owned()),
                    "node-cache metrics" => s.node_cache_metrics = Some(rest.to_owned()),
                    _ => {
                        let (listen, rest) = rest.split_once(": ").unwrap_or((rest, ""));
                        let upstreams = rest
                            .split_once(" to ")
                            .map(|(_, to)| to.split(';').next().unwrap_or_default())
                            .unwrap_or_default();
                        s.blocks.insert(
                            zone.to_owned(),
                            (
                                listen.split_whitespace().map(str::to_owned).collect(),
                                upstreams.split_whitespace().map(str::to_owned).collect(),
                            ),
                        );
                    }
                }
            }
        }
        s
    }
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Runs `nodedns <args> --check-config` with exactly `env` as its environment.
fn check_config(args: &[String], env: &BTreeMap<String, String>) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nodedns"))
        .args(args)
        .arg("--check-config")
        .env_clear()
        .envs(env)
        .output()
        .expect("run nodedns")
}

/// Loads `m` as its pod would and returns what the binary says it serves; panics with the
/// binary's own errors when the load fails.
fn load(m: &Manifest, pod: &Pod, extra_args: &[String]) -> Summary {
    pod.mount(m);
    let mut args = pod.args(&m.args());
    args.extend_from_slice(extra_args);
    let out = check_config(&args, &m.service_env());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{}: nodedns {} --check-config failed ({}):\n{stderr}",
        m.name,
        args.join(" "),
        out.status
    );
    Summary::parse(&stdout)
}

/// The zones of nodelocaldns's Corefile, in the form the summary prints them.
fn zones() -> BTreeSet<String> {
    set(&[&format!("{DOMAIN}."), "in-addr.arpa.", "ip6.arpa.", "."])
}

/// Asserts that every block listens on `listen` and that the cluster zones go to `cluster_dns`,
/// everything else to the node's resolvers.
fn assert_serves(name: &str, s: &Summary, listen: &[&str], cluster_dns: &str) {
    assert_eq!(
        s.blocks.keys().cloned().collect::<BTreeSet<_>>(),
        zones(),
        "{name}: {s:?}"
    );
    for (zone, (addrs, upstreams)) in &s.blocks {
        assert_eq!(addrs, &set(listen), "{name}: {zone} listens on");
        let want = if zone == "." {
            format!("{NODE_NAMESERVER}:53")
        } else {
            format!("{cluster_dns}:53")
        };
        assert_eq!(upstreams, &set(&[&want]), "{name}: {zone} forwards to");
    }
}

/// Asserts that a probe reaches the address the binary serves it on: the same port, and the
/// probe's host (the pod IP when it names none) among the addresses served.
fn assert_probe_reaches(name: &str, probe: &Yaml, path: &str, served: Option<&str>) {
    let served = served.unwrap_or_else(|| panic!("{name}: nothing serves {path}"));
    let get = &probe["httpGet"];
    assert_eq!(get["path"].as_str(), Some(path), "{name}");
    let port = port_of(&get["port"], "probe port");
    let (host, served_port) = served.rsplit_once(':').expect("ADDR:PORT");
    assert_eq!(
        served_port,
        port.to_string(),
        "{name}: {path} is served on {served}, probed on port {port}"
    );
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match get["host"].as_str() {
        Some(probed) => assert_eq!(
            probed, host,
            "{name}: {path} is served on {served}, probed on {probed}"
        ),
        // The kubelet probes the pod IP: only an unspecified address answers there.
        None => assert!(
            host == "0.0.0.0" || host == "::",
            "{name}: {path} is served on {served} only, probed on the pod IP"
        ),
    }
}

/// Asserts that Prometheus finds /metrics where it is served.
fn assert_metrics_scraped(m: &Manifest, s: &Summary) {
    let served = s
        .metrics
        .as_deref()
        .unwrap_or_else(|| panic!("{}: no /metrics", m.name));
    let port = served.rsplit_once(':').unwrap().1;
    let svc = m
        .object("Service", "node-local-dns")
        .expect("metrics Service");
    let target = port_of(
        &vec_of(&svc["spec"]["ports"])[0]["targetPort"],
        "targetPort",
    );
    assert_eq!(
        target.to_string(),
        port,
        "{}: metrics Service targets {target}, /metrics on {served}",
        m.name
    );
    let annotation = port_of(
        &m.daemonset()["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"],
        "prometheus.io/port",
    );
    assert_eq!(
        annotation.to_string(),
        port,
        "{}: scrape annotation",
        m.name
    );
}

/// The rendered Corefile nodedns writes to `--conf` for operators: complete, no variable left.
fn assert_rendered_corefile(m: &Manifest, pod: &Pod) {
    let conf = m
        .args()
        .iter()
        .find_map(|a| a.strip_prefix("--conf=").map(str::to_owned))
        .unwrap_or_else(|| panic!("{}: no --conf", m.name));
    let written = std::fs::read_to_string(pod.host_path(&conf))
        .unwrap_or_else(|e| panic!("{}: rendered Corefile {conf}: {e}", m.name));
    assert!(!written.contains("__PILLAR__"), "{}: {written}", m.name);
    assert!(
        written.contains(&format!("{DOMAIN}:53")),
        "{}: {written}",
        m.name
    );
}

fn assert_mode(mode: &str, listen: &[&str], cluster_dns: &str) {
    let m = Manifest::mode(mode);
    let pod = Pod::new();
    let s = load(&m, &pod, &[]);
    assert_serves(&m.name, &s, listen, cluster_dns);
    assert_probe_reaches(
        &m.name,
        &m.container()["livenessProbe"],
        "/health",
        s.health.as_deref(),
    );
    assert_probe_reaches(
        &m.name,
        &m.container()["readinessProbe"],
        "/ready",
        s.ready.as_deref(),
    );
    assert_metrics_scraped(&m, &s);
    assert_rendered_corefile(&m, &pod);
}

#[test]
fn iptables_mode_serves_the_local_address_and_the_kube_dns_clusterip_from_kube_dns_upstream() {
    assert_mode(
        "iptables",
        &[&format!("{LOCAL_DNS}:53"), &format!("{KUBE_DNS}:53")],
        SERVICE_IP,
    );
}

#[test]
fn nftables_mode_serves_the_local_address_and_the_kube_dns_clusterip_from_kube_dns_upstream() {
    assert_mode(
        "nftables",
        &[&format!("{LOCAL_DNS}:53"), &format!("{KUBE_DNS}:53")],
        SERVICE_IP,
    );
}

#[test]
fn ipvs_mode_serves_only_the_local_address_and_forwards_to_the_kube_dns_clusterip() {
    assert_mode("ipvs", &[&format!("{LOCAL_DNS}:53")], KUBE_DNS);
}

#[test]
fn cilium_mode_serves_on_the_pod_address_from_kube_dns_upstream() {
    assert_mode("cilium", &["0.0.0.0:53"], SERVICE_IP);
}

#[test]
fn cilium_redirect_targets_the_ports_dns_is_served_on() {
    let m = Manifest::mode("cilium");
    let s = load(&m, &Pod::new(), &[]);
    let dns_ports: BTreeSet<u16> = s
        .blocks
        .values()
        .flat_map(|(listen, _)| {
            listen
                .iter()
                .map(|a| a.rsplit_once(':').unwrap().1.parse::<u16>().unwrap())
        })
        .collect();
    let lrp = m
        .object("CiliumLocalRedirectPolicy", "node-local-dns")
        .expect("the redirect policy");
    let container_ports: BTreeMap<&str, u16> = vec_of(&m.container()["ports"])
        .iter()
        .map(|p| {
            (
                str_of(&p["name"], "port name"),
                port_of(&p["containerPort"], "containerPort"),
            )
        })
        .collect();
    let backend = vec_of(&lrp["spec"]["redirectBackend"]["toPorts"]);
    assert!(!backend.is_empty());
    for p in backend {
        let port = port_of(&p["port"], "toPorts port");
        assert!(
            dns_ports.contains(&port),
            "redirect to port {port}, DNS served on {dns_ports:?}"
        );
        assert_eq!(
            container_ports.get(str_of(&p["name"], "toPorts name")),
            Some(&port),
            "{p:?}"
        );
    }
}

#[test]
fn without_the_kube_dns_upstream_service_the_pod_refuses_to_start() {
    // The negative control: the manifests' loads above fail when the pod lacks what the manifest
    // provides. Here, the kube-dns-upstream Service (its ClusterIP variable).
    for mode in ["iptables", "nftables", "cilium"] {
        let m = Manifest::mode(mode);
        let pod = Pod::new();
        pod.mount(&m);
        let mut env = m.service_env();
        assert!(
            env.remove("KUBE_DNS_UPSTREAM_SERVICE_HOST").is_some(),
            "{mode}: the Service is in the manifest"
        );
        let out = check_config(&pod.args(&m.args()), &env);
        assert_eq!(out.status.code(), Some(64), "{mode}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("KUBE_DNS_UPSTREAM_SERVICE_HOST"),
            "{mode}: {stderr}"
        );
    }
}

#[test]
fn ipvs_mode_needs_no_upstream_service() {
    let m = Manifest::mode("ipvs");
    assert!(m.object("Service", "kube-dns-upstream").is_none());
    let pod = Pod::new();
    pod.mount(&m);
    let out = check_config(&pod.args(&m.args()), &BTreeMap::new());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_kube_dns_configmap_is_read_where_the_manifest_mounts_it() {
    // With the optional kube-dns ConfigMap present, its upstreamNameservers replace the node's
    // resolvers for `.`: the mount path and --kubednscm agree.
    for mode in ["iptables", "nftables", "ipvs", "cilium"] {
        let m = Manifest::mode(mode);
        let mut pod = Pod::new();
        pod.cluster_configmaps.insert(
            "kube-dns".to_owned(),
            BTreeMap::from([(
                "upstreamNameservers".to_owned(),
                r#"["198.51.100.1"]"#.to_owned(),
            )]),
        );
        let s = load(&m, &pod, &[]);
        let (_, upstreams) = s.blocks.get(".").expect("the . block");
        assert_eq!(upstreams, &set(&["198.51.100.1:53"]), "{mode}: {s:?}");
    }
}

/// The stock manifest, with its variables filled by the Kubernetes docs' `sed` for `mode`.
fn stock(mode: &str) -> Manifest {
    let path = repo().join("manifests/testdata/nodelocaldns.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let filled = match mode {
        // sed "s/__PILLAR__LOCAL__DNS__/$localdns/g; s/__PILLAR__DNS__DOMAIN__/$domain/g;
        //      s/__PILLAR__DNS__SERVER__/$kubedns/g"
        "iptables" => text
            .replace("__PILLAR__LOCAL__DNS__", LOCAL_DNS)
            .replace("__PILLAR__DNS__DOMAIN__", DOMAIN)
            .replace("__PILLAR__DNS__SERVER__", KUBE_DNS),
        // sed "s/__PILLAR__LOCAL__DNS__/$localdns/g; s/__PILLAR__DNS__DOMAIN__/$domain/g;
        //      s/,__PILLAR__DNS__SERVER__//g; s/__PILLAR__CLUSTER__DNS__/$kubedns/g"
        "ipvs" => text
            .replace("__PILLAR__LOCAL__DNS__", LOCAL_DNS)
            .replace("__PILLAR__DNS__DOMAIN__", DOMAIN)
            .replace(",__PILLAR__DNS__SERVER__", "")
            .replace("__PILLAR__CLUSTER__DNS__", KUBE_DNS),
        _ => unreachable!(),
    };
    Manifest::parse(&format!("nodelocaldns.yaml ({mode} sed)"), &filled)
}

/// node-cache reads its template from `-basecorefile`, by default /etc/coredns/Corefile.base,
/// where the stock DaemonSet mounts the ConfigMap; the stock args leave it implicit, so the test
/// names it (under the temp dir) explicitly.
fn stock_extra_args(pod: &Pod) -> Vec<String> {
    vec![format!(
        "-basecorefile={}",
        pod.host_path("/etc/coredns/Corefile.base").display()
    )]
}

#[test]
fn stock_nodelocaldns_yaml_in_iptables_mode_loads_unchanged() {
    let m = stock("iptables");
    let pod = Pod::new();
    let s = load(&m, &pod, &stock_extra_args(&pod));
    assert_serves(
        &m.name,
        &s,
        &[&format!("{LOCAL_DNS}:53"), &format!("{KUBE_DNS}:53")],
        SERVICE_IP,
    );
    assert_probe_reaches(
        &m.name,
        &m.container()["livenessProbe"],
        "/health",
        s.health.as_deref(),
    );
    assert_metrics_scraped(&m, &s);
    // node-cache's own metrics port, where Gardener scrapes: served too.
    assert_eq!(
        s.node_cache_metrics.as_deref(),
        Some("0.0.0.0:9353"),
        "{}",
        m.name
    );
    // node-cache writes the filled-in template to -conf; so does nodedns.
    let written = std::fs::read_to_string(pod.host_path("/etc/Corefile"))
        .expect("-conf /etc/Corefile written");
    assert!(!written.contains("__PILLAR__"), "{written}");
}

#[test]
fn stock_nodelocaldns_yaml_in_ipvs_mode_loads_unchanged() {
    let m = stock("ipvs");
    let pod = Pod::new();
    let s = load(&m, &pod, &stock_extra_args(&pod));
    assert_serves(&m.name, &s, &[&format!("{LOCAL_DNS}:53")], KUBE_DNS);
    assert_probe_reaches(
        &m.name,
        &m.container()["livenessProbe"],
        "/health",
        s.health.as_deref(),
    );
    assert_metrics_scraped(&m, &s);
}
