//! DNS over TLS (RFC 7858) to `forward tls://` upstreams: what is trusted, which name the
//! certificate must carry, and the client certificate, loaded once per configuration.
//!
//! The meanings are CoreDNS's (`plugin/pkg/tls`, `plugin/forward`):
//! - the upstream's certificate must chain to the CA file `tls CA` (or `tls CERT KEY CA`) names,
//!   or to the system's CAs when none is named (`tls`, `tls CERT KEY`, or no `tls` at all);
//! - it must be valid now and name `tls_servername` (sent as SNI too), or, without
//!   `tls_servername`, carry the upstream's IP address (an IP SAN; no SNI is sent for an address);
//! - `tls CERT KEY [CA]` presents a client certificate to upstreams that ask for one;
//! - TLS 1.2 and 1.3 only.
//!
//! Verification fails closed: a certificate that fails any check fails the handshake, and the
//! connection is never used; there is no fallback to plain DNS and no option to skip the checks.
//! Everything that can be wrong with the files is found by [`Settings::load`], so a bad
//! configuration is refused before it replaces a good one.
//!
//! The system's CAs are read where Go (CoreDNS) reads them on Linux: `$SSL_CERT_FILE` or the
//! first of the distributions' bundle files that exists, then every file of `$SSL_CERT_DIR` or
//! of `/etc/ssl/certs` and `/etc/pki/tls/certs`.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};

/// The bundle files Go looks for on Linux (`crypto/x509/root_linux.go`), in its order: the first
/// one that can be read is used.
const SYSTEM_FILES: [&str; 6] = [
    "/etc/ssl/certs/ca-certificates.crt", // Debian, Ubuntu, Gentoo, Arch
    "/etc/pki/tls/certs/ca-bundle.crt",   // Fedora, RHEL 6
    "/etc/ssl/ca-bundle.pem",             // openSUSE
    "/etc/pki/tls/cacert.pem",            // OpenELEC
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", // CentOS, RHEL 7
    "/etc/ssl/cert.pem",                  // Alpine
];

/// The directories Go reads every certificate file of.
const SYSTEM_DIRS: [&str; 2] = ["/etc/ssl/certs", "/etc/pki/tls/certs"];

/// What a forward's `tls` option names, as written. Relative paths are relative to the working
/// directory, as in CoreDNS without a `root` directive.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Files {
    /// `tls CA`, `tls CERT KEY CA`: the CAs the upstream's certificate must chain to. `None`: the
    /// system's.
    pub ca: Option<PathBuf>,
    /// `tls CERT KEY [CA]`: the client certificate (a PEM chain, leaf first) and its private key,
    /// for upstreams that authenticate their clients.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// How a group's `tls://` upstreams are reached: which addresses, the verifier, the name checked,
/// the client certificate. Built by [`Settings::load`]; cheap to clone.
///
/// Two settings are equal when they name the same addresses and server name and were loaded
/// from the same certificates and key (byte for byte), so a reload that reads rotated files
/// builds new connections, and one that reads the same files keeps the pools.
#[derive(Clone)]
pub struct Settings {
    /// The upstream addresses (each also in [`crate::Config::addrs`]) spoken to over TLS.
    pub addrs: Vec<SocketAddr>,
    /// `tls_servername`; `None`: each upstream's own address.
    server_name: Option<ServerName<'static>>,
    /// What `client` was built from, for equality.
    material: Arc<Material>,
    /// Shared by every connection of the group: its session cache lets a new connection resume
    /// an earlier session (an abbreviated handshake) instead of verifying the chain again.
    client: Arc<ClientConfig>,
}

#[derive(Debug, PartialEq, Eq)]
struct Material {
    roots: Vec<CertificateDer<'static>>,
    identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
}

/// Why [`Settings::load`] failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read the {what} {}: {source}", .path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the {what} {} is not PEM: {source}", .path.display())]
    Pem {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: pem::Error,
    },
    #[error("the {what} {} holds no {wanted}", .path.display())]
    Empty {
        what: &'static str,
        path: PathBuf,
        wanted: &'static str,
    },
    #[error(
        "no system CA certificates found (read $SSL_CERT_FILE or {}, and $SSL_CERT_DIR or {}); name a CA file: `tls CA`",
        SYSTEM_FILES.join(", "), SYSTEM_DIRS.join(", ")
    )]
    NoSystemRoots,
    #[error("tls_servername `{0}` is neither a DNS name nor an IP address")]
    ServerName(String),
    #[error("the client certificate and key cannot be used: {0}")]
    Client(#[source] rustls::Error),
}

impl Settings {
    /// Reads and checks everything `files` names (the system's CAs when it names no CA file),
    /// for the upstreams at `addrs`, whose certificates must name `server_name` (or, without it,
    /// their address).
    pub fn load(
        addrs: Vec<SocketAddr>,
        server_name: Option<&str>,
        files: &Files,
    ) -> Result<Settings, LoadError> {
        let server_name = server_name.map(parse_name).transpose()?;
        let roots = match &files.ca {
            Some(path) => {
                let pem = read("CA file", path)?;
                certificates("CA file", path, &pem, "certificate")?
            }
            None => system_roots()?,
        };
        let identity = match &files.client {
            Some((cert, key)) => {
                let chain = certificates(
                    "certificate",
                    cert,
                    &read("certificate", cert)?,
                    "certificate",
                )?;
                let key_pem = read("key", key)?;
                let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
                    pem::Error::NoItemsFound => LoadError::Empty {
                        what: "key",
                        path: key.clone(),
                        wanted: "private key",
                    },
                    source => LoadError::Pem {
                        what: "key",
                        path: key.clone(),
                        source,
                    },
                })?;
                Some((chain, key_der))
            }
            None => None,
        };
        Settings::new(addrs, server_name, roots, identity, files.ca.as_deref())
    }

    /// [`Settings::load`] from certificates already in memory: `roots` trusted, `identity` the
    /// client's chain and key.
    fn new(
        addrs: Vec<SocketAddr>,
        server_name: Option<ServerName<'static>>,
        roots: Vec<CertificateDer<'static>>,
        identity: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
        ca: Option<&Path>,
    ) -> Result<Settings, LoadError> {
        let mut store = RootCertStore::empty();
        let (added, _unusable) = store.add_parsable_certificates(roots.iter().cloned());
        if added == 0 {
            return Err(match ca {
                Some(path) => LoadError::Empty {
                    what: "CA file",
                    path: path.to_path_buf(),
                    wanted: "usable CA certificate",
                },
                None => LoadError::NoSystemRoots,
            });
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(LoadError::Client)?
            .with_root_certificates(store);
        // The builder's defaults are kept: an in-memory session cache (resumption), no early
        // data, no ALPN (RFC 7858 asks for none; CoreDNS sends none).
        let client = match &identity {
            Some((chain, key)) => builder
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(LoadError::Client)?,
            None => builder.with_no_client_auth(),
        };
        Ok(Settings {
            addrs,
            server_name,
            material: Arc::new(Material { roots, identity }),
            client: Arc::new(client),
        })
    }

    /// The rustls configuration every connection of the group shares.
    pub(crate) fn client(&self) -> Arc<ClientConfig> {
        self.client.clone()
    }

    /// The name `addr`'s certificate must carry.
    pub(crate) fn name_for(&self, addr: SocketAddr) -> ServerName<'static> {
        match &self.server_name {
            Some(name) => name.clone(),
            None => ServerName::IpAddress(addr.ip().into()),
        }
    }
}

impl PartialEq for Settings {
    fn eq(&self, other: &Self) -> bool {
        self.addrs == other.addrs
            && self.server_name == other.server_name
            && self.material == other.material
    }
}

impl Eq for Settings {}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("addrs", &self.addrs)
            .field("server_name", &self.server_name)
            .field("roots", &self.material.roots.len())
            .field("client_certificate", &self.material.identity.is_some())
            .finish_non_exhaustive()
    }
}

fn parse_name(name: &str) -> Result<ServerName<'static>, LoadError> {
    ServerName::try_from(name.to_owned()).map_err(|_| LoadError::ServerName(name.to_owned()))
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|source| LoadError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// Every certificate of a PEM file; at least one.
fn certificates(
    what: &'static str,
    path: &Path,
    pem: &[u8],
    wanted: &'static str,
) -> Result<Vec<CertificateDer<'static>>, LoadError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| LoadError::Pem {
            what,
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(LoadError::Empty {
            what,
            path: path.to_path_buf(),
            wanted,
        });
    }
    Ok(certs)
}

/// The system's CAs, read as Go reads them on Linux (see the module's documentation).
fn system_roots() -> Result<Vec<CertificateDer<'static>>, LoadError> {
    let file = std::env::var_os("SSL_CERT_FILE").map(PathBuf::from);
    let dirs: Vec<PathBuf> = match std::env::var_os("SSL_CERT_DIR") {
        Some(dirs) => std::env::split_paths(&dirs).collect(),
        None => SYSTEM_DIRS.iter().map(PathBuf::from).collect(),
    };
    let files: Vec<PathBuf> = match file {
        Some(file) => vec![file],
        None => SYSTEM_FILES.iter().map(PathBuf::from).collect(),
    };
    Ok(roots_from(&files, &dirs))
}

/// The certificates of the first readable file of `files`, then of every file in `dirs`, each
/// kept once. Unreadable files and blocks that are not certificates are skipped, as Go skips
/// them.
fn roots_from(files: &[PathBuf], dirs: &[PathBuf]) -> Vec<CertificateDer<'static>> {
    let mut roots = Vec::new();
    let mut add = |pem: &[u8]| {
        for cert in CertificateDer::pem_slice_iter(pem).flatten() {
            if !roots.contains(&cert) {
                roots.push(cert);
            }
        }
    };
    if let Some(pem) = files.iter().find_map(|f| std::fs::read(f).ok()) {
        add(&pem);
    }
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        for path in paths {
            if path.is_file() {
                if let Ok(pem) = std::fs::read(&path) {
                    add(&pem);
                }
            }
        }
    }
    roots
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testpki::{Ca, Dir, Validity};

    fn addrs() -> Vec<SocketAddr> {
        vec!["192.0.2.53:853".parse().unwrap()]
    }

    #[test]
    fn a_missing_ca_file_is_named() {
        let files = Files {
            ca: Some(PathBuf::from("/nonexistent/ca.pem")),
            client: None,
        };
        let err = Settings::load(addrs(), None, &files).unwrap_err();
        assert!(
            matches!(
                err,
                LoadError::Read {
                    what: "CA file",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let (dir, ca) = (Dir::new(), Ca::new("test CA"));
        let key_only = dir.write("key.pem", ca.server(&["a.example"], Validity::Now).key);
        for ca in [key_only, dir.write("empty.pem", "")] {
            let files = Files {
                ca: Some(ca.clone()),
                client: None,
            };
            let err = Settings::load(addrs(), None, &files).unwrap_err();
            assert!(matches!(err, LoadError::Empty { .. }), "{ca:?}: {err:?}");
        }
        let garbage = dir.write("garbage.pem", "-----BEGIN CERTIFICATE-----\n%%%\n");
        let files = Files {
            ca: Some(garbage),
            client: None,
        };
        let err = Settings::load(addrs(), None, &files).unwrap_err();
        assert!(matches!(err, LoadError::Pem { .. }), "{err:?}");
    }

    #[test]
    fn a_client_key_that_is_not_the_certificates_is_refused() {
        let (dir, ca) = (Dir::new(), Ca::new("test CA"));
        let (one, other) = (ca.client("one.example"), ca.client("other.example"));
        let files = Files {
            ca: Some(dir.write("ca.pem", ca.pem())),
            client: Some((
                dir.write("c.pem", &one.cert),
                dir.write("k.pem", &other.key),
            )),
        };
        let err = Settings::load(addrs(), None, &files).unwrap_err();
        assert!(matches!(err, LoadError::Client(_)), "{err:?}");
        let files = Files {
            client: Some((dir.write("c.pem", &one.cert), dir.write("k.pem", ""))),
            ..files
        };
        let err = Settings::load(addrs(), None, &files).unwrap_err();
        assert!(
            matches!(err, LoadError::Empty { what: "key", .. }),
            "{err:?}"
        );
    }

    #[test]
    fn a_server_name_must_be_a_dns_name_or_an_address() {
        let (dir, ca) = (Dir::new(), Ca::new("test CA"));
        let files = dir.trust(&ca);
        let err = Settings::load(addrs(), Some("not a name"), &files).unwrap_err();
        assert!(matches!(err, LoadError::ServerName(_)), "{err:?}");
        let by_ip = Settings::load(addrs(), Some("192.0.2.1"), &files).unwrap();
        assert_eq!(
            by_ip.name_for(addrs()[0]),
            ServerName::IpAddress("192.0.2.1".parse::<std::net::IpAddr>().unwrap().into())
        );
        let own = Settings::load(addrs(), None, &files).unwrap();
        assert_eq!(
            own.name_for(addrs()[0]),
            ServerName::IpAddress(addrs()[0].ip().into())
        );
    }

    #[test]
    fn settings_are_equal_when_loaded_from_the_same_bytes() {
        let (dir, ca) = (Dir::new(), Ca::new("test CA"));
        let client = ca.client("node.example");
        let files = dir.trust_with_client(&ca, &client);
        let a = Settings::load(addrs(), Some("dns.example"), &files).unwrap();
        let b = Settings::load(addrs(), Some("dns.example"), &files).unwrap();
        assert_eq!(a, b, "a reload of the same files keeps the pools");
        assert_ne!(
            a,
            Settings::load(addrs(), Some("other.example"), &files).unwrap()
        );
        // The client certificate rotated under the same path.
        let rotated = ca.client("node.example");
        std::fs::write(files.client.as_ref().unwrap().0.clone(), &rotated.cert).unwrap();
        std::fs::write(files.client.as_ref().unwrap().1.clone(), &rotated.key).unwrap();
        assert_ne!(
            a,
            Settings::load(addrs(), Some("dns.example"), &files).unwrap()
        );
    }

    #[test]
    fn the_private_key_never_shows_in_debug_output() {
        let (dir, ca) = (Dir::new(), Ca::new("test CA"));
        let client = ca.client("node.example");
        let settings = Settings::load(addrs(), None, &dir.trust_with_client(&ca, &client)).unwrap();
        let text = format!("{settings:?}");
        assert!(text.contains("client_certificate: true"), "{text}");
        let key = PrivateKeyDer::from_pem_slice(client.key.as_bytes()).unwrap();
        let bytes = format!("{:?}", key.secret_der());
        assert!(!text.contains(&bytes[1..40]), "{text}");
    }

    #[test]
    fn system_roots_are_the_first_readable_bundle_and_the_directories_each_once() {
        let dir = Dir::new();
        let (a, b, c) = (Ca::new("a"), Ca::new("b"), Ca::new("c"));
        let bundle = dir.write("bundle.pem", format!("{}{}", a.pem(), b.pem()));
        let second = dir.write("second.pem", c.pem());
        let certs = dir.path().join("certs");
        std::fs::create_dir(&certs).unwrap();
        std::fs::write(certs.join("b.pem"), b.pem()).unwrap();
        std::fs::write(certs.join("c.pem"), c.pem()).unwrap();
        std::fs::write(certs.join("README"), "not a certificate").unwrap();
        let missing = dir.path().join("missing.pem");

        let roots = roots_from(&[missing.clone(), bundle, second], &[certs, missing]);
        let der = |ca: &Ca| CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap();
        assert_eq!(roots, [der(&a), der(&b), der(&c)]);
    }

    #[test]
    fn no_system_roots_is_an_error_that_says_what_to_do() {
        assert!(roots_from(&[], &[]).is_empty());
        let err = Settings::new(addrs(), None, Vec::new(), None, None).unwrap_err();
        assert!(matches!(err, LoadError::NoSystemRoots), "{err:?}");
        assert!(err.to_string().contains("tls CA"), "{err}");
    }

    #[test]
    fn this_machines_system_roots_load() {
        // Debian's ca-certificates bundle, which CI installs and the image carries.
        let settings = Settings::load(addrs(), Some("dns.example"), &Files::default()).unwrap();
        assert!(settings.material.roots.len() > 10, "{settings:?}");
    }
}
