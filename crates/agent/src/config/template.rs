//! node-cache's template step: the `__PILLAR__` variables of the Corefile, filled the way
//! node-cache fills them (plain text replacement over the whole file, so a variable may expand
//! to several words), and the node's resolv.conf.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

use super::Problem;

pub(crate) const LOCAL_DNS: &str = "__PILLAR__LOCAL__DNS__";
pub(crate) const DNS_SERVER: &str = "__PILLAR__DNS__SERVER__";
pub(crate) const CLUSTER_DNS: &str = "__PILLAR__CLUSTER__DNS__";
pub(crate) const UPSTREAM_SERVERS: &str = "__PILLAR__UPSTREAM__SERVERS__";

/// What the pillars are filled from.
pub(crate) struct Fill<'a> {
    pub local_ips: &'a [IpAddr],
    pub upstream_service: &'a str,
    pub env: &'a HashMap<String, String>,
    /// Path of the node's resolv.conf: what `__PILLAR__UPSTREAM__SERVERS__` becomes without
    /// kube-dns `upstreamNameservers` (node-cache writes the path; `forward` reads the file).
    pub resolv_conf_path: &'a Path,
    /// kube-dns `upstreamNameservers`, when the ConfigMap sets them.
    pub upstream_nameservers: Option<&'a [SocketAddr]>,
}

/// The rendered Corefile, and the lines where `__PILLAR__UPSTREAM__SERVERS__` stood (their
/// `forward` switches to UDP when kube-dns upstreams fill it, as in node-cache).
#[derive(Debug)]
pub(crate) struct Rendered {
    pub text: String,
    pub upstream_lines: BTreeSet<usize>,
}

/// The environment variable Kubernetes sets to a Service's ClusterIP in every pod created after
/// the Service: `kube-dns-upstream` → `KUBE_DNS_UPSTREAM_SERVICE_HOST`.
pub(crate) fn service_host_var(service: &str) -> String {
    format!(
        "{}_SERVICE_HOST",
        service.replace('-', "_").to_ascii_uppercase()
    )
}

fn lines_of(text: &str, needle: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.contains(needle))
        .map(|(i, _)| i + 1)
        .collect()
}

/// Fills the pillars of `text` (from `file`). Every problem is collected; the text is returned
/// only when there is none.
pub(crate) fn render(file: &str, text: &str, fill: &Fill<'_>) -> Result<Rendered, Vec<Problem>> {
    let mut problems = Vec::new();
    let mut out = text.to_owned();
    let upstream_lines: BTreeSet<usize> = lines_of(text, UPSTREAM_SERVERS).into_iter().collect();

    let local = lines_of(text, LOCAL_DNS);
    if !local.is_empty() {
        if fill.local_ips.is_empty() {
            for line in &local {
                problems.push(Problem::at(
                    file,
                    *line,
                    format!(
                        "{LOCAL_DNS} needs the node-local addresses: pass -localip \
                         (as the nodelocaldns.yaml DaemonSet does)"
                    ),
                ));
            }
        } else {
            let ips: Vec<String> = fill.local_ips.iter().map(IpAddr::to_string).collect();
            out = out.replace(LOCAL_DNS, &ips.join(" "));
        }
    }
    // node-cache: every listen address is already in __PILLAR__LOCAL__DNS__ (from -localip).
    out = out.replace(DNS_SERVER, "");

    let cluster = lines_of(text, CLUSTER_DNS);
    if !cluster.is_empty() {
        let var = service_host_var(fill.upstream_service);
        let value = fill.env.get(&var).map(|v| v.trim());
        match value.map(str::parse::<IpAddr>) {
            Some(Ok(ip)) => out = out.replace(CLUSTER_DNS, &ip.to_string()),
            Some(Err(_)) => problems.push(Problem::at(
                file,
                cluster[0],
                format!(
                    "{CLUSTER_DNS} is filled from {var}, which is {:?}, not an IP address",
                    value.unwrap_or_default()
                ),
            )),
            None => problems.push(Problem::at(
                file,
                cluster[0],
                format!(
                    "{CLUSTER_DNS} needs the ClusterIP of Service `{svc}`, from the environment \
                     variable {var}, which is not set. Kubernetes sets it only in pods created \
                     after the Service: create Service `{svc}` in the pod's namespace (it is in \
                     nodelocaldns.yaml) and restart the pods, or pass -upstreamsvc with the name \
                     of an existing Service that selects the cluster DNS pods",
                    svc = fill.upstream_service
                ),
            )),
        }
    }

    if !upstream_lines.is_empty() {
        let servers = match fill.upstream_nameservers {
            Some(addrs) => addrs
                .iter()
                .map(SocketAddr::to_string)
                .collect::<Vec<_>>()
                .join(" "),
            None => fill.resolv_conf_path.display().to_string(),
        };
        out = out.replace(UPSTREAM_SERVERS, &servers);
    }

    // Whatever is left is not node-cache's to fill: say who fills it.
    for (i, line) in out.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("__PILLAR__") {
            let tail = &rest[at + "__PILLAR__".len()..];
            let len = tail
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            let name = &rest[at..at + "__PILLAR__".len() + len];
            rest = &tail[len..];
            if name == LOCAL_DNS || name == CLUSTER_DNS {
                continue; // already reported above
            }
            let hint = if name == "__PILLAR__DNS__DOMAIN__" {
                " with the cluster domain (such as cluster.local)"
            } else {
                ""
            };
            problems.push(Problem::at(
                file,
                i + 1,
                format!(
                    "{name} is not filled by node-cache or nodedns: the nodelocaldns.yaml install \
                     step replaces it (sed) before deploying; replace it{hint}"
                ),
            ));
        }
    }

    if problems.is_empty() {
        Ok(Rendered {
            text: out,
            upstream_lines,
        })
    } else {
        Err(problems)
    }
}

/// The `nameserver` entries of a resolv.conf (resolv.conf(5)): one address per line, `#` and
/// `;` start comments, a zone suffix (`fe80::1%eth0`) is not usable here and is reported.
pub(crate) fn resolv_nameservers(file: &str, text: &str) -> Result<Vec<IpAddr>, Vec<Problem>> {
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split(['#', ';']).next().unwrap_or_default();
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        match words.next().map(str::parse::<IpAddr>) {
            Some(Ok(ip)) => out.push(ip),
            Some(Err(_)) | None => problems.push(Problem::at(
                file,
                i + 1,
                format!("`{}` does not name an IP address", line.trim()),
            )),
        }
    }
    if out.is_empty() && problems.is_empty() {
        problems.push(Problem::in_file(
            file,
            "lists no nameserver, so there is nothing to forward to: point --resolv-conf at the \
             file with the node's upstream resolvers, or name upstreams"
                .to_owned(),
        ));
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

/// The node's resolvers as upstreams (port 53), refusing loopback addresses: a resolv.conf that
/// names a stub on the node itself (systemd-resolved's 127.0.0.53, a local dnsmasq) hands
/// nodedns's queries to a resolver that may itself forward to the cluster DNS or to nodedns, and
/// in any case is not the upstream node-cache's users mean.
pub(crate) fn node_resolvers(
    file: &str,
    text: Option<&str>,
) -> Result<Vec<SocketAddr>, Vec<Problem>> {
    let Some(text) = text else {
        return Err(vec![Problem::in_file(
            file,
            "does not exist: the upstream servers are taken from it here. Mount the node's \
             resolv.conf there (dnsPolicy: Default does), point --resolv-conf at it, or name the \
             upstreams (--upstream, or the Corefile's forward)"
                .to_owned(),
        )]);
    };
    let ips = resolv_nameservers(file, text)?;
    let stubs: Vec<String> = ips
        .iter()
        .filter(|ip| ip.is_loopback())
        .map(IpAddr::to_string)
        .collect();
    if !stubs.is_empty() {
        return Err(vec![Problem::in_file(
            file,
            format!(
                "names {}, a resolver on this node's loopback (a local stub such as \
                 systemd-resolved's): forwarding there can loop back into nodedns. Point \
                 --resolv-conf at the file with the real upstream servers (with systemd-resolved: \
                 /run/systemd/resolve/resolv.conf, which kubelet's --resolv-conf also uses), or set \
                 upstreamNameservers in the kube-dns ConfigMap",
                stubs.join(", ")
            ),
        )]);
    }
    Ok(ips.into_iter().map(|ip| SocketAddr::new(ip, 53)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn fill<'a>(ips: &'a [IpAddr], env: &'a HashMap<String, String>, path: &'a Path) -> Fill<'a> {
        Fill {
            local_ips: ips,
            upstream_service: "kube-dns-upstream",
            env,
            resolv_conf_path: path,
            upstream_nameservers: None,
        }
    }

    #[test]
    fn pillars_are_filled_as_node_cache_fills_them() {
        let ips = [
            "169.254.20.10".parse().unwrap(),
            "10.96.0.10".parse().unwrap(),
        ];
        let env = env(&[("KUBE_DNS_UPSTREAM_SERVICE_HOST", "10.96.0.11")]);
        let path = PathBuf::from("/etc/resolv.conf");
        let text = "a {\n bind __PILLAR__LOCAL__DNS__ __PILLAR__DNS__SERVER__\n \
                    forward . __PILLAR__CLUSTER__DNS__\n forward . __PILLAR__UPSTREAM__SERVERS__\n}\n";
        let r = render("Corefile", text, &fill(&ips, &env, &path)).unwrap();
        assert_eq!(
            r.text,
            "a {\n bind 169.254.20.10 10.96.0.10 \n forward . 10.96.0.11\n forward . /etc/resolv.conf\n}\n"
        );
        assert_eq!(r.upstream_lines, BTreeSet::from([4]));
    }

    #[test]
    fn kube_dns_upstream_nameservers_fill_the_upstream_pillar() {
        let env = HashMap::new();
        let path = PathBuf::from("/etc/resolv.conf");
        let ups = [
            "1.1.1.1:53".parse().unwrap(),
            "8.8.8.8:5353".parse().unwrap(),
        ];
        let mut f = fill(&[], &env, &path);
        f.upstream_nameservers = Some(&ups);
        let r = render("C", "forward . __PILLAR__UPSTREAM__SERVERS__\n", &f).unwrap();
        assert_eq!(r.text, "forward . 1.1.1.1:53 8.8.8.8:5353\n");
    }

    #[test]
    fn a_missing_upstream_service_variable_is_a_clear_error() {
        let env = HashMap::new();
        let path = PathBuf::from("/etc/resolv.conf");
        let errs = render(
            "Corefile",
            "x\nforward . __PILLAR__CLUSTER__DNS__\n",
            &fill(&[], &env, &path),
        )
        .unwrap_err();
        assert_eq!(errs.len(), 1);
        let msg = errs[0].to_string();
        assert!(
            msg.starts_with("Corefile:2: __PILLAR__CLUSTER__DNS__ needs the ClusterIP"),
            "{msg}"
        );
        assert!(msg.contains("KUBE_DNS_UPSTREAM_SERVICE_HOST"), "{msg}");
        assert!(msg.contains("-upstreamsvc"), "{msg}");
    }

    #[test]
    fn a_service_variable_that_is_not_an_ip_is_an_error() {
        let env = env(&[("MY_DNS_SERVICE_HOST", "nope")]);
        let path = PathBuf::from("/r");
        let mut f = fill(&[], &env, &path);
        f.upstream_service = "my-dns";
        let errs = render("C", "forward . __PILLAR__CLUSTER__DNS__\n", &f).unwrap_err();
        assert!(
            errs[0].to_string().contains("MY_DNS_SERVICE_HOST"),
            "{errs:?}"
        );
    }

    #[test]
    fn local_dns_without_localip_is_an_error_per_line() {
        let env = HashMap::new();
        let path = PathBuf::from("/r");
        let errs = render(
            "C",
            "bind __PILLAR__LOCAL__DNS__\nhealth __PILLAR__LOCAL__DNS__:8080\n",
            &fill(&[], &env, &path),
        )
        .unwrap_err();
        let lines: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(lines.len(), 2);
        assert!(
            lines[0].starts_with("C:1: __PILLAR__LOCAL__DNS__ needs"),
            "{lines:?}"
        );
        assert!(lines[1].starts_with("C:2:"), "{lines:?}");
    }

    #[test]
    fn pillars_node_cache_does_not_fill_are_reported_with_who_fills_them() {
        let env = HashMap::new();
        let path = PathBuf::from("/r");
        let errs = render(
            "C",
            "__PILLAR__DNS__DOMAIN__:53 {\n}\n",
            &fill(&[], &env, &path),
        )
        .unwrap_err();
        let msg = errs[0].to_string();
        assert!(
            msg.starts_with("C:1: __PILLAR__DNS__DOMAIN__ is not filled"),
            "{msg}"
        );
        assert!(msg.contains("cluster domain"), "{msg}");
    }

    #[test]
    fn service_host_variable_names_follow_kubernetes() {
        assert_eq!(
            service_host_var("kube-dns-upstream"),
            "KUBE_DNS_UPSTREAM_SERVICE_HOST"
        );
        assert_eq!(service_host_var("kube-dns"), "KUBE_DNS_SERVICE_HOST");
    }

    #[test]
    fn resolv_conf_nameservers_with_comments() {
        let ns = resolv_nameservers(
            "/etc/resolv.conf",
            "# generated\nsearch example.com\nnameserver 10.0.0.2\nnameserver fd00::2 ; v6\noptions ndots:5\n",
        )
        .unwrap();
        assert_eq!(
            ns,
            [
                "10.0.0.2".parse::<IpAddr>().unwrap(),
                "fd00::2".parse().unwrap()
            ]
        );
    }

    #[test]
    fn resolv_conf_without_nameservers_or_with_bad_ones_is_an_error() {
        let errs = resolv_nameservers("/r", "search x\n").unwrap_err();
        assert!(
            errs[0].to_string().starts_with("/r: lists no nameserver"),
            "{errs:?}"
        );
        let errs = resolv_nameservers("/r", "nameserver\nnameserver fe80::1%eth0\n").unwrap_err();
        assert_eq!(errs.len(), 2);
        assert!(errs[1].to_string().starts_with("/r:2:"), "{errs:?}");
    }
    #[test]
    fn a_resolv_conf_naming_a_local_stub_is_refused_with_what_to_fix() {
        let errs = node_resolvers(
            "/etc/resolv.conf",
            Some("nameserver 127.0.0.53\noptions edns0\n"),
        )
        .unwrap_err();
        let msg = errs[0].to_string();
        assert!(
            msg.starts_with("/etc/resolv.conf: names 127.0.0.53"),
            "{msg}"
        );
        assert!(msg.contains("/run/systemd/resolve/resolv.conf"), "{msg}");
        let ok = node_resolvers("/r", Some("nameserver 10.0.0.2\n")).unwrap();
        assert_eq!(ok, ["10.0.0.2:53".parse::<SocketAddr>().unwrap()]);
    }
}
