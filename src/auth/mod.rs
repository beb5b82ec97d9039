//! Who a caller is (docs/architecture/security.md#security-model): a buyer by a verified token
//! (`buyer`), the payment provider by a signed notification (`signature`), an operator by the
//! admin token (`admin_token_matches`).

pub mod buyer;
pub mod cache;
pub mod jwks;
pub mod keygen;
pub mod pass;
pub mod pow;
pub mod remote;
pub mod signature;

use secrecy::{ExposeSecret, SecretString};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Makes aws-lc-rs the signature code of every token this process signs or verifies
/// (jsonwebtoken's `aws_lc_rs` backend: RSA verifies several times faster than the pure-Rust
/// backend; BENCHMARKS.md#buyer-token-verification). Called before the first key is
/// read or token signed; later calls change nothing. Explicit because a build that also holds
/// the RustCrypto backend (the benchmark crate compares the two) makes jsonwebtoken refuse to
/// choose on its own.
pub fn install_crypto() {
    let aws_lc = &jsonwebtoken::crypto::aws_lc::DEFAULT_PROVIDER;
    let _ = jsonwebtoken::crypto::CryptoProvider::install_default(aws_lc);
}

/// The token of an `Authorization: Bearer <token>` header value (scheme case-insensitive);
/// `None` for another scheme or an empty token.
pub fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Whether `Authorization: Bearer <token>` carries the admin token, compared in constant time
/// whatever the lengths. An empty configured token matches nothing.
pub fn admin_token_matches(configured: &SecretString, header: Option<&str>) -> bool {
    let want = configured.expose_secret().as_bytes();
    let got = header.and_then(bearer_token).unwrap_or_default().as_bytes();
    // Both sides hashed first: the comparison is then of two 32-byte digests, whose time
    // depends neither on where the bytes differ nor on the guess's length (comparing the raw
    // slices stops at once on a length mismatch).
    let (want_digest, got_digest) = (Sha256::digest(want), Sha256::digest(got));
    let same = want_digest.as_slice().ct_eq(got_digest.as_slice());
    !want.is_empty() && bool::from(same)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_token_matches_only_itself() {
        let t = SecretString::from("s3cret-admin".to_string());
        assert!(admin_token_matches(&t, Some("Bearer s3cret-admin")));
        assert!(!admin_token_matches(&t, Some("Bearer s3cret-admiN")));
        assert!(!admin_token_matches(&t, Some("Bearer s3cret")));
        assert!(!admin_token_matches(&t, Some("s3cret-admin")));
        assert!(!admin_token_matches(&t, None));
        let empty = SecretString::from(String::new());
        assert!(!admin_token_matches(&empty, Some("Bearer ")));
    }
}
