//! TLS to PostgreSQL and Redis (docs/architecture/security.md#secrets): rustls, the server's
//! certificate checked against a CA file (or the system's roots) and its name against the host
//! the URL names.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};

/// A CA file or TLS set-up that does not work, named by the configuration key that gave it
/// (a leaf error: the configuration turns it into its own).
#[derive(Debug, thiserror::Error)]
#[error("config key `{key}`: {reason}")]
pub struct TlsError {
    pub key: &'static str,
    pub reason: String,
}

impl TlsError {
    fn new(key: &'static str, reason: impl Into<String>) -> Self {
        Self {
            key,
            reason: reason.into(),
        }
    }
}

/// One crypto provider for the process, whichever library asks first (the Redis client builds
/// its TLS config from the process default).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

/// The certificates of the PEM file `path` (config key `key`), each a trust anchor.
pub fn read_ca(path: &str, key: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| TlsError::new(key, format!("cannot read {path}: {e}")))?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::new(key, format!("{path} is not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::new(key, format!("{path} holds no certificate")));
    }
    Ok(certs)
}

/// A client config trusting the CAs of `ca_file`, or the system's roots when it is empty.
pub fn client_config(ca_file: &str, key: &'static str) -> Result<ClientConfig, TlsError> {
    install_crypto_provider();
    let mut roots = RootCertStore::empty();
    if ca_file.is_empty() {
        let native = rustls_native_certs::load_native_certs();
        for cert in native.certs {
            let _ = roots.add(cert);
        }
        if roots.is_empty() {
            return Err(TlsError::new(
                key,
                "no CA file given and no system root certificates found",
            ));
        }
    } else {
        for cert in read_ca(ca_file, key)? {
            roots
                .add(cert)
                .map_err(|e| TlsError::new(key, format!("{ca_file}: {e}")))?;
        }
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::new(key, e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}
