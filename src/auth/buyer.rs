//! Buyer identity from a verified token (docs/architecture/security.md#buyer-tokens).
//!
//! The shop's login (or its gateway) signs a JWT for the buyer: RS256, PS256, ES256 or EdDSA
//! with a private key only it holds; the API verifies with the public keys of a JWKS, from a
//! file (`auth.jwks_file`) or the identity provider's URL (`auth.jwks_url`, kept fresh by
//! `remote`), chosen by the token's `kid`, so keys rotate by publishing the new key beside the
//! old one. HS256 with a shared secret is for development only (`seckill token mint`) and
//! refused in `PROD`. The buyer is the token's `sub`, a positive integer.
//!
//! The checks, cheapest first: the verified-token cache (a digest of the whole token), the
//! header and its `kid`, the claims' times, and only then the signature with every claim.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::cache::{self, TokenCache};
use super::jwks::KeySet;
use super::remote::RemoteJwks;
use crate::config::{AuthSettings, ConfigError};

/// Why a request carries no usable buyer identity. The caller sees only `UNAUTHENTICATED`
/// (or 503 while no key could be fetched yet); the kind goes to the `auth_failures_total`
/// metric, never the detail of the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `Authorization: Bearer` header.
    Missing,
    /// Not a JWT, unknown key, bad signature, wrong algorithm, audience or issuer, bad `sub`.
    Invalid,
    /// `exp` passed or `nbf` not reached (beyond the leeway).
    Expired,
    /// The identity provider's keys have not been fetched yet: nothing can be verified.
    KeysUnavailable,
}

impl AuthFailure {
    pub fn label(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing",
            AuthFailure::Invalid => "invalid",
            AuthFailure::Expired => "expired",
            AuthFailure::KeysUnavailable => "keys_unavailable",
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

/// The claims' times alone, read before the signature is checked: an expired token is refused
/// without paying for a signature check (the full validation runs after it all the same).
#[derive(Deserialize)]
struct Times {
    exp: Option<u64>,
    nbf: Option<u64>,
}

/// The rules a token must meet whatever key signed it.
pub struct Verifier {
    /// The development HS256 key (`auth.dev_hs256_secret`), outside PROD only.
    dev: Option<DecodingKey>,
    audience: String,
    issuer: Option<String>,
    leeway_secs: u64,
}

/// What a token that verified says: its buyer and its `exp`.
struct Verified {
    buyer: i64,
    exp: u64,
}

impl Verifier {
    fn from_settings(s: &AuthSettings) -> Result<Self, ConfigError> {
        super::install_crypto();
        let secret = s.dev_hs256_secret.expose_secret();
        let dev = (!secret.is_empty())
            .then(|| DecodingKey::from_secret(secret.as_bytes()))
            .transpose()
            .map_err(|e| ConfigError::invalid("auth.dev_hs256_secret", e.to_string()))?;
        Ok(Self {
            dev,
            audience: s.audience.clone(),
            issuer: (!s.issuer.is_empty()).then(|| s.issuer.clone()),
            leeway_secs: s.leeway_secs,
        })
    }

    /// A verifier for audience `aud`, no issuer, no development key.
    #[cfg(test)]
    pub(crate) fn for_tests(aud: &str) -> Self {
        super::install_crypto();
        Self {
            dev: None,
            audience: aud.to_string(),
            issuer: None,
            leeway_secs: 0,
        }
    }

    /// Verifies a token against `keys`, returning its buyer.
    pub fn verify(&self, keys: &KeySet, token: &str) -> Result<i64, AuthFailure> {
        let header = jsonwebtoken::decode_header(token).map_err(|_| AuthFailure::Invalid)?;
        self.verify_with(keys, &header, token).map(|v| v.buyer)
    }

    fn verify_with(
        &self,
        keys: &KeySet,
        header: &Header,
        token: &str,
    ) -> Result<Verified, AuthFailure> {
        let key = match header.alg {
            Algorithm::HS256 => self.dev.as_ref(),
            alg => {
                let kid = header.kid.as_deref().ok_or(AuthFailure::Invalid)?;
                match keys.get(kid) {
                    // A key verifies with its own algorithm only: a token naming another one
                    // (an ES256 key used as an HMAC secret, say) is refused.
                    Some((key_alg, key)) if *key_alg == alg => Some(key),
                    _ => None,
                }
            }
        };
        let key = key.ok_or(AuthFailure::Invalid)?;
        self.check_times(token)?;
        let mut v = Validation::new(header.alg);
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
        let buyer = parse_buyer(&data.claims.sub).ok_or(AuthFailure::Invalid)?;
        Ok(Verified {
            buyer,
            exp: data.claims.exp,
        })
    }

    /// `exp` and `nbf` read unverified: a token out of its time is refused here, before its
    /// signature costs anything. A token that passes is still checked in full afterwards.
    fn check_times(&self, token: &str) -> Result<(), AuthFailure> {
        let Ok(times) = jsonwebtoken::dangerous::insecure_decode::<Times>(token) else {
            return Err(AuthFailure::Invalid);
        };
        let now = jsonwebtoken::get_current_timestamp();
        let (exp, nbf) = (times.claims.exp, times.claims.nbf);
        if exp.is_some_and(|exp| exp.saturating_add(self.leeway_secs) < now)
            || nbf.is_some_and(|nbf| nbf > now.saturating_add(self.leeway_secs))
        {
            return Err(AuthFailure::Expired);
        }
        Ok(())
    }
}

/// Verifies buyer tokens; built once at start-up, shared by every request.
pub struct BuyerAuth {
    verifier: Verifier,
    /// `auth.jwks_file`'s keys (fixed for the process's life).
    file: KeySet,
    /// The identity provider's keys (`auth.jwks_url`).
    remote: Option<Arc<RemoteJwks>>,
    /// Tokens that verified (`auth.token_cache_entries`; `None` when 0).
    cache: Option<Arc<TokenCache>>,
}

impl BuyerAuth {
    /// Loads `auth.jwks_file`, prepares `auth.jwks_url` (fetched by [`BuyerAuth::start`]) and
    /// the development secret. A file that cannot be read or holds a key this API does not
    /// verify with fails start-up naming the key.
    pub fn from_settings(s: &AuthSettings) -> Result<Self, ConfigError> {
        let file = if s.jwks_file.is_empty() {
            KeySet::default()
        } else {
            KeySet::load_file(Path::new(&s.jwks_file))?
        };
        let verifier = Verifier::from_settings(s)?;
        let cache =
            (s.token_cache_entries > 0).then(|| Arc::new(TokenCache::new(s.token_cache_entries)));
        let remote = if s.jwks_url.is_empty() {
            None
        } else {
            Some(Arc::new(RemoteJwks::new(s, cache.clone())?))
        };
        if file.is_empty() && remote.is_none() && verifier.dev.is_none() {
            return Err(ConfigError::invalid(
                "auth.jwks_file",
                "no key to verify buyer tokens with (set auth.jwks_file or auth.jwks_url, or \
                 auth.dev_hs256_secret outside PROD)",
            ));
        }
        Ok(Self {
            verifier,
            file,
            remote,
            cache,
        })
    }

    /// Starts fetching `auth.jwks_url`'s keys, when set, until `shutdown`.
    pub fn start(&self, shutdown: CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        self.remote.as_ref().map(|r| r.start(shutdown))
    }

    /// Whether tokens can be verified: false only while `auth.jwks_url` has never answered.
    pub fn has_keys(&self) -> bool {
        self.remote.as_ref().is_none_or(|r| r.loaded())
    }

    /// The buyer of a request: the verified `sub` of its bearer token.
    pub async fn buyer(&self, headers: &HeaderMap) -> Result<i64, AuthFailure> {
        let token = bearer(headers).ok_or(AuthFailure::Missing)?;
        self.verify(token).await
    }

    /// Verifies a token and returns its buyer: from the cache when these exact bytes verified
    /// before and are still within their `exp`, else in full (and remembered if they verify).
    pub async fn verify(&self, token: &str) -> Result<i64, AuthFailure> {
        let now = jsonwebtoken::get_current_timestamp();
        let digest = self.cache.as_ref().map(|c| (c, cache::digest(token)));
        if let Some((cache, digest)) = &digest {
            if let Some(buyer) = cache.get(digest, now) {
                return Ok(buyer);
            }
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| AuthFailure::Invalid)?;
        let keys = self.keys_for(&header).await?;
        let verified = self.verifier.verify_with(&keys, &header, token)?;
        if let Some((cache, digest)) = digest {
            let until = verified.exp.saturating_add(self.verifier.leeway_secs);
            cache.insert(digest, verified.buyer, until, now);
        }
        Ok(verified.buyer)
    }

    /// The key set that holds the token's `kid`: the file's, else the provider's (refreshed
    /// once when the kid is new to it).
    async fn keys_for(&self, header: &Header) -> Result<KeyRef<'_>, AuthFailure> {
        let kid = header.kid.as_deref().unwrap_or_default();
        let Some(remote) = &self.remote else {
            return Ok(KeyRef::File(&self.file));
        };
        if header.alg == Algorithm::HS256 || self.file.get(kid).is_some() {
            return Ok(KeyRef::File(&self.file));
        }
        if !remote.loaded() {
            return Err(AuthFailure::KeysUnavailable);
        }
        let keys = remote.keys();
        if keys.get(kid).is_none() && !kid.is_empty() {
            return Ok(KeyRef::Remote(remote.refresh_for(kid).await));
        }
        Ok(KeyRef::Remote(keys))
    }
}

/// A borrowed file set or a shared snapshot of the provider's.
enum KeyRef<'a> {
    File(&'a KeySet),
    Remote(Arc<KeySet>),
}

impl std::ops::Deref for KeyRef<'_> {
    type Target = KeySet;
    fn deref(&self) -> &KeySet {
        match self {
            KeyRef::File(k) => k,
            KeyRef::Remote(k) => k,
        }
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
    super::install_crypto();
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
    super::install_crypto();
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
            jwks_url: String::new(),
            jwks_ca_file: String::new(),
            jwks_refresh_secs: 300,
            jwks_min_refresh_secs: 10,
            jwks_timeout_ms: 2000,
            token_cache_entries: 1000,
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

    #[tokio::test]
    async fn rsa_tokens_verify_with_the_algorithm_their_key_names_only() {
        let auth = with_jwks(&fixture("buyer-jwks.json")).unwrap();
        let pem = std::fs::read(fixture("buyer-signer-d.pem")).unwrap();
        let token = |alg, kid| mint_with_key(alg, &pem, kid, &spec(60)).unwrap();
        assert_eq!(
            auth.verify(&token(Algorithm::RS256, "test-d")).await,
            Ok(42)
        );
        assert_eq!(
            auth.verify(&token(Algorithm::PS256, "test-e")).await,
            Ok(42)
        );
        // The same RSA key under a kid that names the other padding, or an EC key's kid.
        for (alg, kid) in [
            (Algorithm::PS256, "test-d"),
            (Algorithm::RS256, "test-e"),
            (Algorithm::RS256, "test-c"),
        ] {
            assert_eq!(
                auth.verify(&token(alg, kid)).await,
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

    #[tokio::test]
    async fn a_dev_token_names_its_buyer_and_a_forged_one_is_refused() {
        let secret = "a-development-secret-of-32-bytes!";
        let auth = BuyerAuth::from_settings(&settings(secret)).unwrap();
        let good = mint_dev(&SecretString::from(secret.to_string()), &spec(60)).unwrap();
        assert_eq!(auth.verify(&good).await, Ok(42));
        let forged = mint_dev(
            &SecretString::from("another-secret-of-32-bytes-long!".to_string()),
            &spec(60),
        )
        .unwrap();
        assert_eq!(auth.verify(&forged).await, Err(AuthFailure::Invalid));
        assert_eq!(auth.verify("not.a.jwt").await, Err(AuthFailure::Invalid));
        let mut headers = HeaderMap::new();
        assert_eq!(auth.buyer(&headers).await, Err(AuthFailure::Missing));
        headers.insert("authorization", format!("Basic {good}").parse().unwrap());
        assert_eq!(auth.buyer(&headers).await, Err(AuthFailure::Missing));
        headers.insert("authorization", format!("bearer {good}").parse().unwrap());
        assert_eq!(auth.buyer(&headers).await, Ok(42));
    }

    #[tokio::test]
    async fn a_configured_issuer_is_required_not_only_checked() {
        let secret = "a-development-secret-of-32-bytes!";
        let mut s = settings(secret);
        s.issuer = "https://login.shop.example".into();
        let auth = BuyerAuth::from_settings(&s).unwrap();
        let key = SecretString::from(secret.to_string());
        let with = |issuer| {
            let spec = TokenSpec { issuer, ..spec(60) };
            mint_dev(&key, &spec).unwrap()
        };
        assert_eq!(
            auth.verify(&with("https://login.shop.example")).await,
            Ok(42)
        );
        assert_eq!(
            auth.verify(&with("https://other.example")).await,
            Err(AuthFailure::Invalid)
        );
        // No `iss` at all (an empty issuer leaves the claim out).
        assert_eq!(auth.verify(&with("")).await, Err(AuthFailure::Invalid));
    }

    #[tokio::test]
    async fn only_tokens_that_verified_enter_the_cache_and_a_retry_is_served_from_it() {
        let secret = "a-development-secret-of-32-bytes!";
        let auth = BuyerAuth::from_settings(&settings(secret)).unwrap();
        let cache = auth.cache.clone().expect("cache on");
        let key = SecretString::from(secret.to_string());
        let good = mint_dev(&key, &spec(60)).unwrap();
        assert_eq!(auth.verify(&good).await, Ok(42));
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.get(&cache::digest(&good), now()), Some(42));
        // One bit of the signature changed: another digest, verified in full, refused, and
        // not stored; the good token's entry is untouched.
        let mut forged = good.clone().into_bytes();
        let last = forged.len() - 2;
        forged[last] = if forged[last] == b'A' { b'B' } else { b'A' };
        let forged = String::from_utf8(forged).unwrap();
        for _ in 0..3 {
            assert_eq!(auth.verify(&forged).await, Err(AuthFailure::Invalid));
        }
        // The same claims under another key, another audience, or already expired.
        let other = SecretString::from("another-secret-of-32-bytes-long!".to_string());
        let wrong_aud = TokenSpec {
            audience: "other",
            ..spec(60)
        };
        let mut old = claims(&spec(60));
        old.exp = now() - 60;
        let enc = EncodingKey::from_secret(secret.as_bytes()).unwrap();
        let expired = jsonwebtoken::encode(&Header::new(Algorithm::HS256), &old, &enc).unwrap();
        for (token, why) in [
            (mint_dev(&other, &spec(60)).unwrap(), AuthFailure::Invalid),
            (mint_dev(&key, &wrong_aud).unwrap(), AuthFailure::Invalid),
            (expired, AuthFailure::Expired),
        ] {
            assert_eq!(auth.verify(&token).await, Err(why));
        }
        assert_eq!(cache.len(), 1, "nothing but the good token was stored");
        assert_eq!(auth.verify(&good).await, Ok(42));
    }

    #[tokio::test]
    async fn a_token_out_of_its_time_is_refused_before_its_signature_is_checked() {
        // Signed with a key the API does not hold: were the signature checked first these
        // would be `Invalid`; the times are read first and say `Expired`.
        let secret = "a-development-secret-of-32-bytes!";
        let mut s = settings(secret);
        s.leeway_secs = 0;
        let auth = BuyerAuth::from_settings(&s).unwrap();
        let key = SecretString::from(secret.to_string());
        let mut late = claims(&spec(60));
        late.nbf = now() + 3600;
        let header = Header::new(Algorithm::HS256);
        let enc = EncodingKey::from_secret(b"not-the-api-secret-but-32-bytes!").unwrap();
        let token = jsonwebtoken::encode(&header, &late, &enc).unwrap();
        assert_eq!(auth.verify(&token).await, Err(AuthFailure::Expired));
        let mut old = claims(&spec(60));
        old.exp = now() - 3600;
        let token = jsonwebtoken::encode(&header, &old, &enc).unwrap();
        assert_eq!(auth.verify(&token).await, Err(AuthFailure::Expired));
        // And a good one still verifies in full.
        let good = mint_dev(&key, &spec(60)).unwrap();
        assert_eq!(auth.verify(&good).await, Ok(42));
    }

    fn now() -> u64 {
        jsonwebtoken::get_current_timestamp()
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
