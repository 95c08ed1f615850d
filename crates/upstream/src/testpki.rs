//! Certificates made at test time (rcgen): a CA, servers and clients it signs, expired and
//! misnamed ones, the rustls server configurations the scripted upstream serves TLS with, and
//! files to load [`crate::tls::Settings`] from.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, date_time_ymd,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};

use crate::tls::Files;

pub(crate) struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, PEM.
pub(crate) struct Leaf {
    pub(crate) cert: String,
    pub(crate) key: String,
}

/// When a leaf is valid.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Validity {
    Now,
    /// From 1999 to 2000.
    Expired,
}

impl Ca {
    pub(crate) fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().unwrap();
        Ca {
            issuer: CertifiedIssuer::self_signed(params, key).unwrap(),
        }
    }

    pub(crate) fn pem(&self) -> String {
        self.issuer.pem()
    }

    fn leaf(&self, sans: &[&str], usage: ExtendedKeyUsagePurpose, validity: Validity) -> Leaf {
        let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
        let mut params = CertificateParams::new(sans).unwrap();
        params.extended_key_usages = vec![usage];
        if let Validity::Expired = validity {
            params.not_before = date_time_ymd(1999, 1, 1);
            params.not_after = date_time_ymd(2000, 1, 1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    /// A server certificate for `sans` (DNS names or IP addresses).
    pub(crate) fn server(&self, sans: &[&str], validity: Validity) -> Leaf {
        self.leaf(sans, ExtendedKeyUsagePurpose::ServerAuth, validity)
    }

    pub(crate) fn client(&self, name: &str) -> Leaf {
        self.leaf(&[name], ExtendedKeyUsagePurpose::ClientAuth, Validity::Now)
    }
}

/// A TLS server presenting `leaf`; with `clients`, it demands a client certificate that CA
/// signed.
pub(crate) fn server_config(leaf: &Leaf, clients: Option<&Ca>) -> Arc<ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match clients {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            roots.add(ca.issuer.der().clone()).unwrap();
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .unwrap();
            builder.with_client_cert_verifier(verifier)
        }
    };
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(leaf.cert.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(leaf.key.as_bytes()).unwrap();
    Arc::new(builder.with_single_cert(chain, key).unwrap())
}

/// A directory of test files, removed on drop.
pub(crate) struct Dir(PathBuf);

impl Dir {
    pub(crate) fn new() -> Dir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "nodedns-upstream-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        Dir(path)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    /// Writes `contents` to `name` in the directory and returns its path.
    pub(crate) fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    /// `tls CA`: trust `ca` only.
    pub(crate) fn trust(&self, ca: &Ca) -> Files {
        Files {
            ca: Some(self.write("ca.pem", ca.pem())),
            client: None,
        }
    }

    /// `tls CERT KEY CA`.
    pub(crate) fn trust_with_client(&self, ca: &Ca, client: &Leaf) -> Files {
        Files {
            ca: Some(self.write("ca.pem", ca.pem())),
            client: Some((
                self.write("client.pem", &client.cert),
                self.write("client.key", &client.key),
            )),
        }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
