//! Buyer identity from a verified token (docs/ARCHITECTURE.md#security-model).
//!
//! The shop's login (or its gateway) signs a JWT for the buyer: EdDSA, ES256, RS256 or PS256
//! with a private key only it holds (RSA keys of 2048 bits at least); the API verifies with the public keys of a JWKS file, chosen by the
//! token's `kid`, so keys rotate by publishing the new key beside the old one. HS256 with a
//! shared secret is for development only (`seckill token mint`) and refused in `PROD`.
//! The buyer is the token's `sub`, a positive integer.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use axum::http::HeaderMap;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use crate::config::{AuthSettings, ConfigError};

/// Why a request carries no usable buyer identity. The caller sees only `UNAUTHENTICATED`;
/// the kind goes to the `auth_failures_total` metric, never the detail of the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `Authorization: Bearer` header.
    Missing,
    /// Not a JWT, unknown key, bad signature, wrong algorithm, audience or issuer, bad `sub`.
    Invalid,
    /// `exp` passed or `nbf` not reached (beyond the leeway).
    Expired,
}

impl AuthFailure {
    pub fn label(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing",
            AuthFailure::Invalid => "invalid",
            AuthFailure::Expired => "expired",
        }
    }
}

/// The claims a buyer token carries.
#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    aud: String,
    exp: u64,
    nbf: u64,
    iat: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    iss: Option<String>,
}

/// Verifies buyer tokens; built once at start-up, shared by every request.
pub struct BuyerAuth {
    /// JWKS keys by `kid`, each with the one algorithm it may verify.
    keys: HashMap<String, (Algorithm, DecodingKey)>,
    /// The development HS256 key (`auth.dev_hs256_secret`), outside PROD only.
    dev: Option<DecodingKey>,
    audience: String,
    issuer: Option<String>,
    leeway_secs: u64,
}

impl BuyerAuth {
    /// Loads `auth.jwks_file` and the development secret. A file that cannot be read or holds
    /// a key this API does not verify with fails start-up naming the key.
    pub fn from_settings(s: &AuthSettings) -> Result<Self, ConfigError> {
        let keys = if s.jwks_file.is_empty() {
            HashMap::new()
        } else {
            load_jwks(Path::new(&s.jwks_file))?
        };
        let secret = s.dev_hs256_secret.expose_secret();
        let dev = (!secret.is_empty())
            .then(|| DecodingKey::from_secret(secret.as_bytes()))
            .transpose()
            .map_err(|e| ConfigError::invalid("auth.dev_hs256_secret", e.to_string()))?;
        if keys.is_empty() && dev.is_none() {
            return Err(ConfigError::invalid(
                "auth.jwks_file",
                "no key to verify buyer tokens with (set auth.jwks_file, or \
                 auth.dev_hs256_secret outside PROD)",
            ));
        }
        Ok(Self {
            keys,
            dev,
            audience: s.audience.clone(),
            issuer: (!s.issuer.is_empty()).then(|| s.issuer.clone()),
            leeway_secs: s.leeway_secs,
        })
    }

    /// The buyer of a request: the verified `sub` of its bearer token.
    pub fn buyer(&self, headers: &HeaderMap) -> Result<i64, AuthFailure> {
        let token = bearer(headers).ok_or(AuthFailure::Missing)?;
        self.verify(token)
    }

    /// Verifies a token and returns its buyer.
    pub fn verify(&self, token: &str) -> Result<i64, AuthFailure> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| AuthFailure::Invalid)?;
        let (alg, key) = match header.alg {
            Algorithm::HS256 => (Algorithm::HS256, self.dev.as_ref()),
            alg => {
                let kid = header.kid.as_deref().ok_or(AuthFailure::Invalid)?;
                match self.keys.get(kid) {
                    // A key verifies with its own algorithm only: a token naming another one
                    // (an ES256 key used as an HMAC secret, say) is refused.
                    Some((key_alg, key)) if *key_alg == alg => (alg, Some(key)),
                    _ => (alg, None),
                }
            }
        };
        let key = key.ok_or(AuthFailure::Invalid)?;
        let mut v = Validation::new(alg);
        v.leeway = self.leeway_secs;
        v.validate_nbf = true;
        v.set_audience(&[&self.audience]);
        // A configured issuer is required, not only checked when present: a token of the
        // shop's key that omits `iss` is refused like one naming another issuer.
        match &self.issuer {
            Some(iss) => {
                v.set_issuer(&[iss]);
                v.set_required_spec_claims(&["exp", "nbf", "aud", "sub", "iss"]);
            }
            None => v.set_required_spec_claims(&["exp", "nbf", "aud", "sub"]),
        }
        let data = jsonwebtoken::decode::<Claims>(token, key, &v).map_err(|e| {
            use jsonwebtoken::errors::ErrorKind;
            match e.kind() {
                ErrorKind::ExpiredSignature | ErrorKind::ImmatureSignature => AuthFailure::Expired,
                _ => AuthFailure::Invalid,
            }
        })?;
        parse_buyer(&data.claims.sub).ok_or(AuthFailure::Invalid)
    }
}

/// The token of `Authorization: Bearer <token>`.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    super::bearer_token(
        headers
            .get(axum::http::header::AUTHORIZATION)?
            .to_str()
            .ok()?,
    )
}

/// A buyer id: canonical decimal, positive, fits in i64.
fn parse_buyer(sub: &str) -> Option<i64> {
    crate::domain::request::parse_path_id(sub, "sub").ok()
}

/// The JWKS file's keys: Ed25519 (`OKP`, EdDSA), P-256 (`EC`, ES256) and RSA (`RSA`, RS256 or
/// PS256 as its `alg` says), each with a `kid`.
fn load_jwks(path: &Path) -> Result<HashMap<String, (Algorithm, DecodingKey)>, ConfigError> {
    const KEY: &str = "auth.jwks_file";
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::invalid(KEY, format!("cannot read {}: {e}", path.display())))?;
    let set: JwkSet = serde_json::from_str(&text)
        .map_err(|e| ConfigError::invalid(KEY, format!("{} is not a JWKS: {e}", path.display())))?;
    let mut keys = HashMap::new();
    for jwk in &set.keys {
        let kid = jwk
            .common
            .key_id
            .clone()
            .ok_or_else(|| ConfigError::invalid(KEY, "every key needs a `kid`"))?;
        let alg = match &jwk.algorithm {
            AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
                Algorithm::EdDSA
            }
            AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => {
                Algorithm::ES256
            }
            AlgorithmParameters::RSA(p) => rsa_algorithm(&kid, jwk.common.key_algorithm, &p.n)?,
            _ => {
                return Err(ConfigError::invalid(
                    KEY,
                    format!(
                    "key `{kid}`: only Ed25519 (EdDSA), P-256 (ES256) and RSA (RS256, PS256) keys verify buyer tokens"
                ),
                ))
            }
        };
        let key = DecodingKey::from_jwk(jwk)
            .map_err(|e| ConfigError::invalid(KEY, format!("key `{kid}`: {e}")))?;
        if keys.insert(kid.clone(), (alg, key)).is_some() {
            return Err(ConfigError::invalid(
                KEY,
                format!("key `{kid}` appears twice"),
            ));
        }
    }
    Ok(keys)
}

/// The one algorithm an RSA key of the JWKS verifies: its `alg` (RS256 or PS256; RS256 when
/// it names none, as the identity providers that sign RS256 by default publish), and only for
/// a modulus of 2048 bits or more.
fn rsa_algorithm(
    kid: &str,
    alg: Option<jsonwebtoken::jwk::KeyAlgorithm>,
    n: &str,
) -> Result<Algorithm, ConfigError> {
    use base64::Engine;
    use jsonwebtoken::jwk::KeyAlgorithm;
    const KEY: &str = "auth.jwks_file";
    let modulus = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(n.trim_end_matches('='))
        .map_err(|e| ConfigError::invalid(KEY, format!("key `{kid}`: modulus: {e}")))?;
    let bits = modulus.iter().skip_while(|b| **b == 0).count() * 8;
    if bits < 2048 {
        return Err(ConfigError::invalid(
            KEY,
            format!("key `{kid}`: an RSA key of {bits} bits; 2048 at least"),
        ));
    }
    match alg {
        None | Some(KeyAlgorithm::RS256) => Ok(Algorithm::RS256),
        Some(KeyAlgorithm::PS256) => Ok(Algorithm::PS256),
        Some(other) => Err(ConfigError::invalid(
            KEY,
            format!("key `{kid}`: {other:?}; RSA keys verify RS256 or PS256"),
        )),
    }
}

/// What a token says, to sign one.
pub struct TokenSpec<'a> {
    pub user_id: i64,
    pub ttl: Duration,
    pub audience: &'a str,
    pub issuer: &'a str,
}

fn claims(spec: &TokenSpec<'_>) -> Claims {
    let now = jsonwebtoken::get_current_timestamp();
    Claims {
        sub: spec.user_id.to_string(),
        aud: spec.audience.to_string(),
        iat: now,
        nbf: now,
        exp: now + spec.ttl.as_secs(),
        iss: (!spec.issuer.is_empty()).then(|| spec.issuer.to_string()),
    }
}

/// A development token signed with the HS256 secret (`seckill token mint`).
pub fn mint_dev(secret: &SecretString, spec: &TokenSpec<'_>) -> anyhow::Result<String> {
    let key = EncodingKey::from_secret(secret.expose_secret().as_bytes())?;
    Ok(jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims(spec),
        &key,
    )?)
}

/// A token signed with a private key (PKCS#8 PEM; `EdDSA` for Ed25519, `ES256` for P-256,
/// `RS256` or `PS256` for RSA)
/// under `kid`, the way a shop's login signs them; the tests use it with fixture keys.
pub fn mint_with_key(
    alg: Algorithm,
    pem: &[u8],
    kid: &str,
    spec: &TokenSpec<'_>,
) -> anyhow::Result<String> {
    let key = match alg {
        Algorithm::EdDSA => EncodingKey::from_ed_pem(pem)?,
        Algorithm::ES256 => EncodingKey::from_ec_pem(pem)?,
        Algorithm::RS256 | Algorithm::PS256 => EncodingKey::from_rsa_pem(pem)?,
        other => anyhow::bail!("{other:?}: buyer tokens are EdDSA, ES256, RS256 or PS256"),
    };
    let mut header = Header::new(alg);
    header.kid = Some(kid.to_string());
    Ok(jsonwebtoken::encode(&header, &claims(spec), &key)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(secret: &str) -> AuthSettings {
        AuthSettings {
            buyers: crate::config::BuyerIdentity::Token,
            jwks_file: String::new(),
            audience: "seckill".into(),
            issuer: String::new(),
            leeway_secs: 5,
            dev_hs256_secret: SecretString::from(secret.to_string()),
        }
    }

    fn spec(ttl: u64) -> TokenSpec<'static> {
        TokenSpec {
            user_id: 42,
            ttl: Duration::from_secs(ttl),
            audience: "seckill",
            issuer: "",
        }
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    fn with_jwks(path: &Path) -> Result<BuyerAuth, ConfigError> {
        BuyerAuth::from_settings(&AuthSettings {
            jwks_file: path.display().to_string(),
            ..settings("")
        })
    }

    #[test]
    fn rsa_tokens_verify_with_the_algorithm_their_key_names_only() {
        let auth = with_jwks(&fixture("buyer-jwks.json")).unwrap();
        let pem = std::fs::read(fixture("buyer-signer-d.pem")).unwrap();
        let token = |alg, kid| mint_with_key(alg, &pem, kid, &spec(60)).unwrap();
        assert_eq!(auth.verify(&token(Algorithm::RS256, "test-d")), Ok(42));
        assert_eq!(auth.verify(&token(Algorithm::PS256, "test-e")), Ok(42));
        // The same RSA key under a kid that names the other padding, or an EC key's kid.
        for (alg, kid) in [
            (Algorithm::PS256, "test-d"),
            (Algorithm::RS256, "test-e"),
            (Algorithm::RS256, "test-c"),
        ] {
            assert_eq!(
                auth.verify(&token(alg, kid)),
                Err(AuthFailure::Invalid),
                "{alg:?} {kid}"
            );
        }
    }

    #[test]
    fn a_short_or_unknown_rsa_key_fails_at_start_naming_the_key() {
        let dir = std::env::temp_dir().join(format!("seckill-jwks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let jwks = dir.join("jwks.json");
        let modulus = |bytes: usize| {
            use base64::Engine;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(vec![0xC5u8; bytes])
        };
        let write = |alg: &str, n: String| {
            let key =
                serde_json::json!({"kty": "RSA", "kid": "k", "alg": alg, "n": n, "e": "AQAB"});
            std::fs::write(&jwks, serde_json::json!({"keys": [key]}).to_string()).unwrap();
        };
        write("RS256", modulus(128));
        let e = with_jwks(&jwks).err().expect("a 1024-bit key is refused");
        assert!(
            e.to_string().contains("auth.jwks_file") && e.to_string().contains("1024 bits"),
            "{e}"
        );
        write("RS512", modulus(256));
        let e = with_jwks(&jwks).err().expect("RS512 is not accepted");
        assert!(e.to_string().contains("RS256 or PS256"), "{e}");
        write("RS256", modulus(256));
        assert!(with_jwks(&jwks).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_dev_token_names_its_buyer_and_a_forged_one_is_refused() {
        let secret = "a-development-secret-of-32-bytes!";
        let auth = BuyerAuth::from_settings(&settings(secret)).unwrap();
        let good = mint_dev(&SecretString::from(secret.to_string()), &spec(60)).unwrap();
        assert_eq!(auth.verify(&good), Ok(42));
        let forged = mint_dev(
            &SecretString::from("another-secret-of-32-bytes-long!".to_string()),
            &spec(60),
        )
        .unwrap();
        assert_eq!(auth.verify(&forged), Err(AuthFailure::Invalid));
        assert_eq!(auth.verify("not.a.jwt"), Err(AuthFailure::Invalid));
        let mut headers = HeaderMap::new();
        assert_eq!(auth.buyer(&headers), Err(AuthFailure::Missing));
        headers.insert("authorization", format!("Basic {good}").parse().unwrap());
        assert_eq!(auth.buyer(&headers), Err(AuthFailure::Missing));
        headers.insert("authorization", format!("bearer {good}").parse().unwrap());
        assert_eq!(auth.buyer(&headers), Ok(42));
    }

    #[test]
    fn a_configured_issuer_is_required_not_only_checked() {
        let secret = "a-development-secret-of-32-bytes!";
        let mut s = settings(secret);
        s.issuer = "https://login.shop.example".into();
        let auth = BuyerAuth::from_settings(&s).unwrap();
        let key = SecretString::from(secret.to_string());
        let with = |issuer| {
            let spec = TokenSpec { issuer, ..spec(60) };
            mint_dev(&key, &spec).unwrap()
        };
        assert_eq!(auth.verify(&with("https://login.shop.example")), Ok(42));
        assert_eq!(
            auth.verify(&with("https://other.example")),
            Err(AuthFailure::Invalid)
        );
        // No `iss` at all (an empty issuer leaves the claim out).
        assert_eq!(auth.verify(&with("")), Err(AuthFailure::Invalid));
    }

    #[test]
    fn no_key_at_all_fails_naming_the_key() {
        let e = BuyerAuth::from_settings(&settings("")).err().unwrap();
        assert!(e.to_string().contains("auth.jwks_file"), "{e}");
    }

    #[test]
    fn buyer_ids_are_canonical_positive_integers() {
        assert_eq!(parse_buyer("42"), Some(42));
        for bad in ["0", "-1", "042", "+4", "4x", "", "99999999999999999999"] {
            assert_eq!(parse_buyer(bad), None, "{bad}");
        }
    }
}
