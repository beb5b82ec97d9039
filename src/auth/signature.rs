//! Signed payment notifications (docs/architecture/security.md#security-model).
//!
//! The payment provider signs each notification with a secret it shares with this service:
//! `Seckill-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<raw body>">`. A header may
//! carry several `v1` entries and the service keeps several secrets, so a secret rotates
//! without a gap. The timestamp must be within the tolerance either way, so a captured
//! notification cannot be replayed later; the comparison is constant-time.

use hmac::{Hmac, KeyInit, Mac};
use secrecy::{ExposeSecret, SecretString};
use sha2::Sha256;

/// The header carrying the signature.
pub const SIGNATURE_HEADER: &str = "seckill-signature";

/// Why a notification's signature is refused (the caller sees only `BAD_SIGNATURE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureFailure {
    /// No header, or not `t=…,v1=…`.
    Malformed,
    /// The timestamp is outside the tolerance.
    Stale,
    /// No `v1` matches any active secret.
    Mismatch,
}

impl SignatureFailure {
    pub fn label(self) -> &'static str {
        match self {
            SignatureFailure::Malformed => "malformed",
            SignatureFailure::Stale => "stale",
            SignatureFailure::Mismatch => "mismatch",
        }
    }
}

fn mac(secret: &SecretString, t: i64, body: &[u8]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret.expose_secret().as_bytes())
        .expect("HMAC takes a key of any length");
    m.update(t.to_string().as_bytes());
    m.update(b".");
    m.update(body);
    m
}

/// The header value signing `body` at `t` with `secret` (the provider's side; the demo, the
/// bench and the tests sign with it).
pub fn sign(secret: &SecretString, t: i64, body: &[u8]) -> String {
    let tag = mac(secret, t, body).finalize().into_bytes();
    format!("t={t},v1={}", hex::encode(tag))
}

/// Checks `header` against `body` with every active secret, at `now` (unix seconds).
pub fn verify(
    secrets: &[SecretString],
    header: Option<&str>,
    body: &[u8],
    now: i64,
    tolerance_secs: u64,
) -> Result<(), SignatureFailure> {
    let header = header.ok_or(SignatureFailure::Malformed)?;
    let mut t = None;
    let mut tags = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", v)) => t = v.parse::<i64>().ok(),
            Some(("v1", v)) => tags.push(hex::decode(v).map_err(|_| SignatureFailure::Malformed)?),
            // Other schemes (a future v2) are ignored, as their senders expect.
            _ => {}
        }
    }
    let t = t.ok_or(SignatureFailure::Malformed)?;
    if tags.is_empty() {
        return Err(SignatureFailure::Malformed);
    }
    if now.abs_diff(t) > tolerance_secs {
        return Err(SignatureFailure::Stale);
    }
    let matched = secrets.iter().any(|secret| {
        tags.iter()
            .any(|tag| mac(secret, t, body).verify_slice(tag).is_ok())
    });
    if matched {
        Ok(())
    } else {
        Err(SignatureFailure::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> SecretString {
        SecretString::from(s.to_string())
    }

    #[test]
    fn a_signature_verifies_with_any_active_secret_within_the_tolerance() {
        let (old, new) = (secret("whsec-old"), secret("whsec-new"));
        let body = br#"{"order_id":"ord_1"}"#;
        let h = sign(&new, 1_000, body);
        let both = [old.clone(), new.clone()];
        assert_eq!(verify(&both, Some(&h), body, 1_000, 300), Ok(()));
        assert_eq!(verify(&both, Some(&h), body, 1_300, 300), Ok(()));
        assert_eq!(verify(&both, Some(&h), body, 700, 300), Ok(()));
        assert_eq!(
            verify(&both, Some(&h), body, 1_301, 300),
            Err(SignatureFailure::Stale)
        );
        assert_eq!(
            verify(std::slice::from_ref(&old), Some(&h), body, 1_000, 300),
            Err(SignatureFailure::Mismatch)
        );
        // The body is what is signed: one byte changed and it no longer matches.
        assert_eq!(
            verify(&both, Some(&h), br#"{"order_id":"ord_2"}"#, 1_000, 300),
            Err(SignatureFailure::Mismatch)
        );
        // So is the timestamp: moving it forward breaks the signature.
        let moved = h.replace("t=1000", "t=1001");
        assert_eq!(
            verify(&both, Some(&moved), body, 1_000, 300),
            Err(SignatureFailure::Mismatch)
        );
        // During a rotation the provider sends one v1 per secret.
        let v1_old = sign(&old, 1_000, body);
        let two = format!("{h},{}", v1_old.split_once(',').unwrap().1);
        assert_eq!(verify(&[old], Some(&two), body, 1_000, 300), Ok(()));
    }

    #[test]
    fn malformed_headers_are_refused() {
        let s = [secret("k")];
        for h in ["", "t=1", "v1=00", "t=x,v1=00", "t=1,v1=zz"] {
            assert_eq!(
                verify(&s, Some(h), b"", 1, 300),
                Err(SignatureFailure::Malformed),
                "{h}"
            );
        }
        assert_eq!(
            verify(&s, None, b"", 1, 300),
            Err(SignatureFailure::Malformed)
        );
    }
}
