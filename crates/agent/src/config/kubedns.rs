//! The kube-dns ConfigMap as node-cache reads it: a mounted directory with the keys
//! `stubDomains` (JSON object: domain → list of nameservers) and `upstreamNameservers` (JSON list
//! of nameservers), each `IP[:PORT]`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use super::{Problem, values};

/// The kube-dns ConfigMap's keys, as read from its mounted directory (`None`: key absent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeDns {
    /// The directory, for messages.
    pub dir: PathBuf,
    pub stub_domains: Option<String>,
    pub upstream_nameservers: Option<String>,
}

/// File names of the ConfigMap keys in the mounted directory.
pub(crate) const STUB_DOMAINS: &str = "stubDomains";
pub(crate) const UPSTREAM_NAMESERVERS: &str = "upstreamNameservers";
/// kube-dns's limit on `upstreamNameservers`.
const MAX_UPSTREAM_NAMESERVERS: usize = 3;

/// The ConfigMap's meaning.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Parsed {
    /// Canonical domain → its nameservers, sorted by domain.
    pub stub_domains: Vec<(String, Vec<SocketAddr>)>,
    /// Replace the upstreams of `.` when set and not empty.
    pub upstreams: Option<Vec<SocketAddr>>,
}

/// The line of `text` where `needle` first appears (1 when it does not).
fn line_of(text: &str, needle: &str) -> usize {
    text.lines()
        .position(|l| l.contains(needle))
        .map_or(1, |i| i + 1)
}

fn nameservers(
    file: &str,
    text: &str,
    servers: &[String],
    what: &str,
    problems: &mut Vec<Problem>,
) -> Vec<SocketAddr> {
    let mut out = Vec::new();
    for s in servers {
        match values::host_port(s.trim(), 53) {
            Ok(a) => out.push(a),
            Err(_) => problems.push(Problem::at(
                file,
                line_of(text, &format!("\"{s}\"")),
                format!("{what}: `{s}` is not an IP address with an optional port"),
            )),
        }
    }
    out
}

/// Reads both keys; every invalid entry is a problem.
pub(crate) fn interpret(k: &KubeDns, problems: &mut Vec<Problem>) -> Parsed {
    let mut parsed = Parsed::default();
    if let Some(text) = k.stub_domains.as_deref().filter(|t| !t.trim().is_empty()) {
        let file = k.dir.join(STUB_DOMAINS).display().to_string();
        match serde_json::from_str::<BTreeMap<String, Vec<String>>>(text) {
            Err(e) => problems.push(Problem::at(
                &file,
                e.line(),
                format!("expected a JSON object of domain → [\"IP[:PORT]\", ...]: {e}"),
            )),
            Ok(map) => {
                for (domain, servers) in map {
                    let line = line_of(text, &format!("\"{domain}\""));
                    let zone = match values::canonical_name(&domain) {
                        Ok(z) if z == "." => {
                            problems.push(Problem::at(
                                &file,
                                line,
                                "the root `.` is not a stub domain: set upstreamNameservers"
                                    .to_owned(),
                            ));
                            continue;
                        }
                        Ok(z) => z,
                        Err(e) => {
                            problems.push(Problem::at(&file, line, format!("stub domain {e}")));
                            continue;
                        }
                    };
                    if servers.is_empty() {
                        problems.push(Problem::at(
                            &file,
                            line,
                            format!("stub domain `{domain}` lists no nameserver"),
                        ));
                        continue;
                    }
                    let what = format!("stub domain `{domain}`");
                    let addrs = nameservers(&file, text, &servers, &what, problems);
                    if addrs.len() == servers.len() {
                        parsed.stub_domains.push((zone, addrs));
                    }
                }
            }
        }
    }
    if let Some(text) = k
        .upstream_nameservers
        .as_deref()
        .filter(|t| !t.trim().is_empty())
    {
        let file = k.dir.join(UPSTREAM_NAMESERVERS).display().to_string();
        match serde_json::from_str::<Vec<String>>(text) {
            Err(e) => problems.push(Problem::at(
                &file,
                e.line(),
                format!("expected a JSON list [\"IP[:PORT]\", ...]: {e}"),
            )),
            Ok(list) => {
                if list.len() > MAX_UPSTREAM_NAMESERVERS {
                    problems.push(Problem::in_file(
                        &file,
                        format!(
                            "lists {} nameservers; kube-dns allows at most {MAX_UPSTREAM_NAMESERVERS}",
                            list.len()
                        ),
                    ));
                }
                let addrs = nameservers(&file, text, &list, "upstream nameserver", problems);
                if !addrs.is_empty() && addrs.len() == list.len() {
                    parsed.upstreams = Some(addrs);
                }
            }
        }
    }
    parsed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kube(stub: Option<&str>, up: Option<&str>) -> KubeDns {
        KubeDns {
            dir: PathBuf::from("/etc/kube-dns"),
            stub_domains: stub.map(str::to_owned),
            upstream_nameservers: up.map(str::to_owned),
        }
    }

    #[test]
    fn stub_domains_and_upstream_nameservers_are_read() {
        let mut problems = Vec::new();
        let p = interpret(
            &kube(
                Some(
                    r#"{"Acme.local": ["1.2.3.4"], "corp.example": ["10.0.0.1:5353", "fd00::1"]}"#,
                ),
                Some(r#"["8.8.8.8", "8.8.4.4:53"]"#),
            ),
            &mut problems,
        );
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            p.stub_domains,
            [
                (
                    "acme.local.".to_owned(),
                    vec!["1.2.3.4:53".parse().unwrap()]
                ),
                (
                    "corp.example.".to_owned(),
                    vec![
                        "10.0.0.1:5353".parse().unwrap(),
                        "[fd00::1]:53".parse().unwrap()
                    ]
                ),
            ]
        );
        assert_eq!(
            p.upstreams,
            Some(vec![
                "8.8.8.8:53".parse().unwrap(),
                "8.8.4.4:53".parse().unwrap()
            ])
        );
    }

    #[test]
    fn absent_or_empty_keys_change_nothing() {
        let mut problems = Vec::new();
        assert_eq!(
            interpret(&kube(None, Some("[]")), &mut problems),
            Parsed::default()
        );
        assert_eq!(
            interpret(&kube(Some("  \n"), None), &mut problems),
            Parsed::default()
        );
        assert!(problems.is_empty());
    }

    #[test]
    fn every_invalid_entry_is_reported_with_its_file_and_line() {
        let mut problems = Vec::new();
        interpret(
            &kube(
                Some(
                    "{\n  \"ok.example\": [\"1.1.1.1\"],\n  \"bad..name\": [\"1.1.1.1\"],\n  \"empty.example\": [],\n  \"host.example\": [\"ns1.example.com\"]\n}",
                ),
                Some("[\"1.1.1.1\", \"2.2.2.2\", \"3.3.3.3\", \"nope\"]"),
            ),
            &mut problems,
        );
        let msgs: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(msgs.len(), 5, "{msgs:#?}");
        assert!(
            msgs[0].starts_with("/etc/kube-dns/stubDomains:3: stub domain `bad..name`"),
            "{msgs:#?}"
        );
        assert!(
            msgs[1]
                .starts_with("/etc/kube-dns/stubDomains:4: stub domain `empty.example` lists no"),
            "{msgs:#?}"
        );
        assert!(
            msgs[2].starts_with(
                "/etc/kube-dns/stubDomains:5: stub domain `host.example`: `ns1.example.com`"
            ),
            "{msgs:#?}"
        );
        assert!(
            msgs[3].starts_with("/etc/kube-dns/upstreamNameservers: lists 4 nameservers"),
            "{msgs:#?}"
        );
        assert!(msgs[4].contains("`nope` is not an IP"), "{msgs:#?}");
    }

    #[test]
    fn malformed_json_names_its_line() {
        let mut problems = Vec::new();
        interpret(
            &kube(
                Some("{\n\"a.example\": [\"1.1.1.1\"\n}"),
                Some("\"8.8.8.8\""),
            ),
            &mut problems,
        );
        let msgs: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(msgs.len(), 2, "{msgs:#?}");
        assert!(
            msgs[0].starts_with("/etc/kube-dns/stubDomains:3: expected a JSON object"),
            "{msgs:#?}"
        );
        assert!(
            msgs[1].starts_with("/etc/kube-dns/upstreamNameservers:1: expected a JSON list"),
            "{msgs:#?}"
        );
    }
}
