//! Sale passes (docs/architecture/hot-path.md#sale-passes): a signed, single-use right to buy in
//! one activity, issued to one buyer before the sale.
//!
//! A pass reads `sp1.<activity_id>.<user_id>.<pass_id>.<signature>`, the signature the
//! base64url HMAC-SHA256 of everything before it under one of `passes.secrets` (the first
//! signs, any verifies: a secret rotates without a gap). Checking one costs one HMAC and no
//! store: a forged pass, or another buyer's, or another activity's, is refused before the
//! reservation script runs. That it buys once is the script's to enforce.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, KeyInit, Mac};
use secrecy::{ExposeSecret, SecretString};
use sha2::Sha256;

/// The header a reservation carries its pass in.
pub const PASS_HEADER: &str = "sale-pass";

const VERSION: &str = "sp1";

/// Why a pass is refused (the caller sees `PASS_INVALID`; metrics see the reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassFailure {
    /// Not `sp1.<activity>.<user>.<pass_id>.<signature>`.
    Malformed,
    /// Another activity's or another buyer's pass.
    NotYours,
    /// No secret in use signed it.
    BadSignature,
}

impl PassFailure {
    pub fn label(self) -> &'static str {
        match self {
            PassFailure::Malformed => "malformed",
            PassFailure::NotYours => "not_yours",
            PassFailure::BadSignature => "bad_signature",
        }
    }
}

fn mac(secret: &SecretString, signed: &str) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(secret.expose_secret().as_bytes())
        .expect("HMAC takes a key of any length");
    m.update(signed.as_bytes());
    m
}

/// The pass of `pass_id`, issued to `user_id` for `activity_id`, signed with `secret`.
pub fn sign(secret: &SecretString, activity_id: i64, user_id: i64, pass_id: &str) -> String {
    let signed = format!("{VERSION}.{activity_id}.{user_id}.{pass_id}");
    let tag = mac(secret, &signed).finalize().into_bytes();
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(tag))
}

/// The pass id of `pass` when one of `secrets` signed it for this buyer and activity.
pub fn verify<'p>(
    secrets: &[SecretString],
    pass: &'p str,
    activity_id: i64,
    user_id: i64,
) -> Result<&'p str, PassFailure> {
    let (signed, tag) = pass.rsplit_once('.').ok_or(PassFailure::Malformed)?;
    let mut parts = signed.splitn(4, '.');
    let (Some(VERSION), Some(a), Some(u), Some(pass_id)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(PassFailure::Malformed);
    };
    let ids = (a.parse::<i64>(), u.parse::<i64>());
    let (Ok(a), Ok(u)) = ids else {
        return Err(PassFailure::Malformed);
    };
    if !crate::domain::ids::is_valid_id("sp", pass_id) {
        return Err(PassFailure::Malformed);
    }
    let tag = URL_SAFE_NO_PAD
        .decode(tag)
        .map_err(|_| PassFailure::Malformed)?;
    // The signature first, in constant time: the ids are believed only once it holds.
    let signed_by_us = secrets
        .iter()
        .any(|s| mac(s, signed).verify_slice(&tag).is_ok());
    if !signed_by_us {
        return Err(PassFailure::BadSignature);
    }
    if a != activity_id || u != user_id {
        return Err(PassFailure::NotYours);
    }
    Ok(pass_id)
}

/// A key of its own for each use of a pass secret (`label`: what it signs), so a signature
/// made for one use is never accepted for another.
pub fn derived_key(secret: &SecretString, label: &str) -> String {
    hex::encode(mac(secret, label).finalize().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> SecretString {
        SecretString::from(s.to_string())
    }

    const ID: &str = "sp_01JEXAMPLE00000000000000A";

    #[test]
    fn a_pass_verifies_for_its_buyer_and_activity_only() {
        let k = secret("pass-secret-of-at-least-32-bytes!!");
        let id = format!("sp_{}", ulid::Ulid::new());
        let p = sign(&k, 7, 42, &id);
        assert_eq!(verify(std::slice::from_ref(&k), &p, 7, 42), Ok(id.as_str()));
        assert_eq!(
            verify(std::slice::from_ref(&k), &p, 7, 43),
            Err(PassFailure::NotYours)
        );
        assert_eq!(
            verify(std::slice::from_ref(&k), &p, 8, 42),
            Err(PassFailure::NotYours)
        );
        // Another secret did not sign it; during a rotation either verifies.
        let other = secret("another-secret-of-at-least-32-bytes");
        assert_eq!(
            verify(std::slice::from_ref(&other), &p, 7, 42),
            Err(PassFailure::BadSignature)
        );
        assert_eq!(verify(&[other, k], &p, 7, 42), Ok(id.as_str()));
    }

    #[test]
    fn an_altered_pass_is_refused() {
        let k = secret("pass-secret-of-at-least-32-bytes!!");
        let id = format!("sp_{}", ulid::Ulid::new());
        let p = sign(&k, 7, 42, &id);
        // Another buyer's id written into a genuine pass breaks its signature.
        let forged = p.replacen(".42.", ".43.", 1);
        assert_eq!(
            verify(std::slice::from_ref(&k), &forged, 7, 43),
            Err(PassFailure::BadSignature)
        );
        for bad in [
            "",
            "sp1",
            "sp1.7.42",
            &format!("sp2.7.42.{ID}.x"),
            "sp1.7.x.sp_1.AAAA",
        ] {
            assert_eq!(
                verify(std::slice::from_ref(&k), bad, 7, 42),
                Err(PassFailure::Malformed),
                "{bad}"
            );
        }
        assert!(
            verify(&[], &p, 7, 42).is_err(),
            "no secret verifies nothing"
        );
    }
}
