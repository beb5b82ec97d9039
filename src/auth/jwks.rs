//! A JWKS read into verifying keys: from `auth.jwks_file` at start-up, or from the identity
//! provider's `auth.jwks_url` on every refresh (`remote`). The same rules for both: Ed25519
//! (`OKP`, EdDSA), P-256 (`EC`, ES256) and RSA of 2048 bits or more (`RSA`, RS256 or PS256 as
//! its `alg` says, RS256 when it names none), each key with a `kid`, each verifying with its
//! own algorithm only.

use std::collections::HashMap;
use std::path::Path;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey};

use crate::config::ConfigError;

/// Verifying keys by `kid`, each with the one algorithm it may verify.
#[derive(Default)]
pub struct KeySet {
    keys: HashMap<String, (Algorithm, DecodingKey)>,
}

impl KeySet {
    /// The keys of a JWKS document; `key` names where it came from in every error.
    pub fn parse(text: &str, key: &'static str) -> Result<Self, ConfigError> {
        super::install_crypto();
        let set: JwkSet = serde_json::from_str(text)
            .map_err(|e| ConfigError::invalid(key, format!("not a JWKS: {e}")))?;
        let mut keys = HashMap::new();
        for jwk in &set.keys {
            let kid = jwk
                .common
                .key_id
                .clone()
                .ok_or_else(|| ConfigError::invalid(key, "every key needs a `kid`"))?;
            let alg = match &jwk.algorithm {
                AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
                    Algorithm::EdDSA
                }
                AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => {
                    Algorithm::ES256
                }
                AlgorithmParameters::RSA(p) => {
                    rsa_algorithm(key, &kid, jwk.common.key_algorithm, &p.n)?
                }
                _ => {
                    return Err(ConfigError::invalid(
                        key,
                        format!(
                            "key `{kid}`: only Ed25519 (EdDSA), P-256 (ES256) and RSA (RS256, \
                             PS256) keys verify buyer tokens"
                        ),
                    ))
                }
            };
            let decoding = DecodingKey::from_jwk(jwk)
                .map_err(|e| ConfigError::invalid(key, format!("key `{kid}`: {e}")))?;
            if keys.insert(kid.clone(), (alg, decoding)).is_some() {
                return Err(ConfigError::invalid(
                    key,
                    format!("key `{kid}` appears twice"),
                ));
            }
        }
        Ok(Self { keys })
    }

    /// The keys of the JWKS file `path` (`auth.jwks_file`).
    pub fn load_file(path: &Path) -> Result<Self, ConfigError> {
        const KEY: &str = "auth.jwks_file";
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::invalid(KEY, format!("cannot read {}: {e}", path.display()))
        })?;
        Self::parse(&text, KEY)
            .map_err(|e| ConfigError::invalid(KEY, format!("{}: {e}", path.display())))
    }

    /// The key a token's `kid` names, with its algorithm.
    pub fn get(&self, kid: &str) -> Option<&(Algorithm, DecodingKey)> {
        self.keys.get(kid)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The `kid`s, sorted: what a refresh logs as added and dropped.
    pub fn kids(&self) -> Vec<&str> {
        let mut kids: Vec<&str> = self.keys.keys().map(String::as_str).collect();
        kids.sort_unstable();
        kids
    }
}

/// The one algorithm an RSA key verifies: its `alg` (RS256 or PS256; RS256 when it names
/// none, as the identity providers that sign RS256 by default publish), and only for a
/// modulus of 2048 bits or more.
fn rsa_algorithm(
    key: &'static str,
    kid: &str,
    alg: Option<jsonwebtoken::jwk::KeyAlgorithm>,
    n: &str,
) -> Result<Algorithm, ConfigError> {
    use base64::Engine;
    use jsonwebtoken::jwk::KeyAlgorithm;
    let modulus = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(n.trim_end_matches('='))
        .map_err(|e| ConfigError::invalid(key, format!("key `{kid}`: modulus: {e}")))?;
    let bits = modulus.iter().skip_while(|b| **b == 0).count() * 8;
    if bits < 2048 {
        return Err(ConfigError::invalid(
            key,
            format!("key `{kid}`: an RSA key of {bits} bits; 2048 at least"),
        ));
    }
    match alg {
        None | Some(KeyAlgorithm::RS256) => Ok(Algorithm::RS256),
        Some(KeyAlgorithm::PS256) => Ok(Algorithm::PS256),
        Some(other) => Err(ConfigError::invalid(
            key,
            format!("key `{kid}`: {other:?}; RSA keys verify RS256 or PS256"),
        )),
    }
}
