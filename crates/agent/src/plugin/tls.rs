//! `tls CERT KEY [CA] { client_auth ... }`: the certificate a `tls://` block serves DNS over TLS
//! with (RFC 7858), or an `https://` block serves DNS over HTTPS with (RFC 8484), as CoreDNS's
//! `plugin/tls`. Without it CoreDNS serves such a block unencrypted: `tls://` as plain DNS over
//! TCP, `https://` as HTTP/1.1 in cleartext; so does nodedns.
//!
//! Unlike the other plugins' configuration halves, this one reads files: the certificate, the
//! key and the CA are read and checked when the configuration is loaded, so that a missing or
//! unusable file is a configuration problem with its line (a bad configuration never replaces a
//! good one), not a handshake that fails later.
//!
//! `client_auth` takes CoreDNS's values: `nocert` (the default), `verify_if_given` and
//! `require_and_verify` (both verify a client certificate against the CA argument, which they
//! need). `request` and `require` (a certificate asked for and not verified) are refused.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

use crate::config::corefile::Directive;
use crate::config::directives::Out;

/// Whether and how a client must present a certificate (`client_auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClientAuth {
    /// `nocert`: none is asked for.
    #[default]
    None,
    /// `verify_if_given`: one is asked for and, when given, must chain to the CA.
    VerifyIfGiven,
    /// `require_and_verify`: one must be given and chain to the CA.
    Require,
}

/// A block's `tls` directive, loaded: the rustls configuration its listener accepts with.
/// Two are equal when they were loaded from the same files with the same bytes and options.
#[derive(Clone)]
pub struct Settings {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: Option<PathBuf>,
    pub client_auth: ClientAuth,
    /// What `config` was built from, for equality (a reload that reads rotated files differs).
    material: Arc<Material>,
    pub config: Arc<ServerConfig>,
}

#[derive(PartialEq, Eq)]
struct Material {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    roots: Vec<CertificateDer<'static>>,
    alpn: Vec<Vec<u8>>,
}

impl PartialEq for Settings {
    fn eq(&self, other: &Self) -> bool {
        self.cert == other.cert
            && self.key == other.key
            && self.ca == other.ca
            && self.client_auth == other.client_auth
            && self.material == other.material
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("ca", &self.ca)
            .field("client_auth", &self.client_auth)
            .finish_non_exhaustive()
    }
}

/// The ALPN protocols a DNS-over-HTTPS listener offers (RFC 8484 §5.2: HTTP/2 is the minimum
/// recommended; HTTP/1.1 for clients that do not speak it).
pub const HTTPS_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// Reads a `tls` directive of a block that serves with `alpn` (none for DNS over TLS: RFC 7858
/// asks for none, CoreDNS offers none).
pub(crate) fn parse(d: &Directive, alpn: &[&[u8]], out: &mut Out<'_>) -> Option<Settings> {
    if !out.arity(d, "tls", 2, 3, "tls CERT KEY [CA]") {
        return None;
    }
    let path = |i: usize| d.args.get(i).map(|w| PathBuf::from(&w.text));
    let (cert, key, ca) = (path(0)?, path(1)?, path(2));
    let mut client_auth = ClientAuth::None;
    let mut ok = true;
    for o in &d.block {
        match (o.name.as_str(), o.args.as_slice()) {
            ("client_auth", [v]) => match v.text.as_str() {
                "nocert" => client_auth = ClientAuth::None,
                "verify_if_given" => client_auth = ClientAuth::VerifyIfGiven,
                "require_and_verify" => client_auth = ClientAuth::Require,
                "request" | "require" => {
                    ok = false;
                    out.err(
                        v.line,
                        format!(
                            "tls: client_auth {} asks for a client certificate and does not verify \
                             it; nodedns does not implement it (use verify_if_given or \
                             require_and_verify, with a CA)",
                            v.text
                        ),
                    );
                }
                other => {
                    ok = false;
                    out.err(
                        v.line,
                        format!(
                            "tls: unknown client_auth `{other}` (nocert, request, require, \
                             verify_if_given, require_and_verify)"
                        ),
                    );
                }
            },
            ("client_auth", _) => {
                ok = false;
                out.err(o.line, "tls: expected `client_auth VALUE`".to_owned());
            }
            (other, _) => {
                ok = false;
                out.err(o.line, format!("tls: unknown option `{other}`"));
            }
        }
    }
    if client_auth != ClientAuth::None && ca.is_none() {
        ok = false;
        out.err(
            d.line,
            "tls: client_auth that verifies client certificates needs the CA argument: \
             `tls CERT KEY CA`"
                .to_owned(),
        );
    }
    if !ok {
        return None;
    }
    match load(&cert, &key, ca.as_deref(), client_auth, alpn) {
        Ok(settings) => Some(settings),
        Err(message) => {
            out.err(d.line, format!("tls: {message}"));
            None
        }
    }
}

/// Reads and checks the files, and builds the server configuration.
pub fn load(
    cert: &Path,
    key: &Path,
    ca: Option<&Path>,
    client_auth: ClientAuth,
    alpn: &[&[u8]],
) -> Result<Settings, String> {
    let read = |what: &str, path: &Path| {
        std::fs::read(path).map_err(|e| format!("cannot read the {what} {}: {e}", path.display()))
    };
    let certificates = |what: &str, path: &Path| -> Result<Vec<CertificateDer<'static>>, String> {
        let certs = CertificateDer::pem_slice_iter(&read(what, path)?)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("the {what} {} is not PEM: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "the {what} {} holds no certificate",
                path.display()
            ));
        }
        Ok(certs)
    };
    let chain = certificates("certificate", cert)?;
    let key_der = PrivateKeyDer::from_pem_slice(&read("key", key)?).map_err(|e| match e {
        pem::Error::NoItemsFound => format!("the key {} holds no private key", key.display()),
        e => format!("the key {} is not PEM: {e}", key.display()),
    })?;
    let roots = match ca {
        Some(ca) => certificates("CA file", ca)?,
        None => Vec::new(),
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_auth {
        ClientAuth::None => builder.with_no_client_auth(),
        ClientAuth::VerifyIfGiven | ClientAuth::Require => {
            let mut store = rustls::RootCertStore::empty();
            let (added, _) = store.add_parsable_certificates(roots.iter().cloned());
            if added == 0 {
                return Err("the CA file holds no usable CA certificate".to_owned());
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(store), provider);
            let verifier = if client_auth == ClientAuth::VerifyIfGiven {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            builder.with_client_cert_verifier(verifier.build().map_err(|e| e.to_string())?)
        }
    };
    let mut config = builder
        .with_single_cert(chain.clone(), key_der.clone_key())
        .map_err(|e| {
            format!(
                "the certificate {} and the key {} cannot be used together: {e}",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Settings {
        cert: cert.to_path_buf(),
        key: key.to_path_buf(),
        ca: ca.map(Path::to_path_buf),
        client_auth,
        material: Arc::new(Material {
            chain,
            key: key_der,
            roots,
            alpn: config.alpn_protocols.clone(),
        }),
        config: Arc::new(config),
    })
}
