//! Signing keys generated here, and the JWKS that publishes their public halves: what the
//! benchmarks, the demo and the tests sign buyer tokens with, the way a shop's identity provider
//! does (`seckill token keygen`). The private key never leaves the process or file it was
//! written to; the API is only ever given the JWKS.

use aws_lc_rs::encoding::AsDer;
use aws_lc_rs::signature::{
    EcdsaKeyPair, Ed25519KeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING,
};
use base64::Engine;
use jsonwebtoken::Algorithm;
use serde_json::{json, Value};

/// A private key (PKCS#8 PEM) with its `kid` and algorithm, and its public JWK.
pub struct SigningKey {
    pub alg: Algorithm,
    pub kid: String,
    pub pem: String,
    pub jwk: Value,
}

/// The algorithms buyer tokens are signed with (the JWKS accepts exactly these).
pub const ALGORITHMS: [Algorithm; 4] = [
    Algorithm::RS256,
    Algorithm::PS256,
    Algorithm::ES256,
    Algorithm::EdDSA,
];

/// An algorithm by its JOSE name (`RS256`, `PS256`, `ES256`, `EdDSA`), case-insensitive.
pub fn parse_algorithm(name: &str) -> Option<Algorithm> {
    ALGORITHMS
        .into_iter()
        .find(|a| format!("{a:?}").eq_ignore_ascii_case(name))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn pem(der: &[u8]) -> String {
    let config = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new("PRIVATE KEY", der), config)
}

/// A new key for `alg` under `kid`: RSA 2048 bits for RS256 and PS256, P-256 for ES256,
/// Ed25519 for EdDSA.
pub fn generate(alg: Algorithm, kid: &str) -> anyhow::Result<SigningKey> {
    let fail = |what: &str| anyhow::anyhow!("cannot generate {what} key");
    let (der, jwk) = match alg {
        Algorithm::RS256 | Algorithm::PS256 => {
            let pair = aws_lc_rs::rsa::KeyPair::generate(aws_lc_rs::rsa::KeySize::Rsa2048)
                .map_err(|_| fail("an RSA"))?;
            let public = aws_lc_rs::rsa::PublicKeyComponents::<Vec<u8>>::from(pair.public_key());
            let der = pair.as_der().map_err(|_| fail("an RSA"))?;
            let jwk = json!({"kty": "RSA", "n": b64(&public.n), "e": b64(&public.e)});
            (der.as_ref().to_vec(), jwk)
        }
        Algorithm::ES256 => {
            let pair = EcdsaKeyPair::generate(&ECDSA_P256_SHA256_FIXED_SIGNING)
                .map_err(|_| fail("a P-256"))?;
            // The uncompressed point: 0x04 || x || y.
            let point = pair.public_key().as_ref();
            let (x, y) = point[1..].split_at(32);
            let jwk = json!({"kty": "EC", "crv": "P-256", "x": b64(x), "y": b64(y)});
            let der = pair.to_pkcs8v1().map_err(|_| fail("a P-256"))?;
            (der.as_ref().to_vec(), jwk)
        }
        Algorithm::EdDSA => {
            let pair = Ed25519KeyPair::generate().map_err(|_| fail("an Ed25519"))?;
            let jwk = json!({"kty": "OKP", "crv": "Ed25519", "x": b64(pair.public_key().as_ref())});
            let der = pair.to_pkcs8v1().map_err(|_| fail("an Ed25519"))?;
            (der.as_ref().to_vec(), jwk)
        }
        other => anyhow::bail!("{other:?}: buyer tokens are RS256, PS256, ES256 or EdDSA"),
    };
    let mut jwk = jwk;
    jwk["kid"] = json!(kid);
    jwk["alg"] = json!(format!("{alg:?}"));
    jwk["use"] = json!("sig");
    Ok(SigningKey {
        alg,
        kid: kid.to_string(),
        pem: pem(&der),
        jwk,
    })
}

/// The JWKS (`{"keys": [...]}`) publishing these keys' public halves.
pub fn jwks<'a>(keys: impl IntoIterator<Item = &'a SigningKey>) -> String {
    let keys: Vec<&Value> = keys.into_iter().map(|k| &k.jwk).collect();
    json!({ "keys": keys }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::buyer::{mint_with_key, AuthFailure, TokenSpec};
    use crate::auth::jwks::KeySet;
    use std::time::Duration;

    #[test]
    fn every_generated_key_signs_tokens_its_jwks_verifies_and_no_other_does() {
        let keys: Vec<SigningKey> = ALGORITHMS
            .iter()
            .map(|a| generate(*a, &format!("k-{a:?}")).unwrap())
            .collect();
        let set = KeySet::parse(&jwks(&keys), "auth.jwks_file").unwrap();
        let spec = TokenSpec {
            user_id: 7,
            ttl: Duration::from_secs(60),
            audience: "seckill",
            issuer: "",
        };
        let verifier = crate::auth::buyer::Verifier::for_tests("seckill");
        for key in &keys {
            let token = mint_with_key(key.alg, key.pem.as_bytes(), &key.kid, &spec).unwrap();
            assert_eq!(verifier.verify(&set, &token), Ok(7), "{:?}", key.alg);
            // Signed by this key, claimed under another kid of the same family or not.
            let other = keys.iter().find(|k| k.kid != key.kid).unwrap();
            let forged = mint_with_key(key.alg, key.pem.as_bytes(), &other.kid, &spec);
            if let Ok(forged) = forged {
                assert_eq!(
                    verifier.verify(&set, &forged),
                    Err(AuthFailure::Invalid),
                    "{:?} as {}",
                    key.alg,
                    other.kid
                );
            }
        }
        assert_eq!(parse_algorithm("rs256"), Some(Algorithm::RS256));
        assert_eq!(parse_algorithm("HS256"), None);
    }
}
