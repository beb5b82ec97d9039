//! Who a caller is (docs/ARCHITECTURE.md#security-model): a buyer by a verified token
//! (`buyer`), the payment provider by a signed notification (`signature`), an operator by the
//! admin token (`admin_token_matches`).

pub mod buyer;
pub mod signature;

use secrecy::{ExposeSecret, SecretString};
use subtle::ConstantTimeEq;

/// The token of an `Authorization: Bearer <token>` header value (scheme case-insensitive);
/// `None` for another scheme or an empty token.
pub fn bearer_token(header: &str) -> Option<&str> {
    let (scheme, token) = header.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Whether `Authorization: Bearer <token>` carries the admin token, compared in constant time.
/// An empty configured token matches nothing.
pub fn admin_token_matches(configured: &SecretString, header: Option<&str>) -> bool {
    let want = configured.expose_secret().as_bytes();
    let Some(got) = header.and_then(bearer_token) else {
        return false;
    };
    // `ct_eq` takes a time that depends on the lengths only, never on where bytes differ.
    !want.is_empty() && bool::from(want.ct_eq(got.as_bytes()))
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
