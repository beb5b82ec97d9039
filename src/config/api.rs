//! `[api]`, `[auth]` and `[payments]`: the listeners and their bounds, who buyers are, and
//! what the payment provider proves itself with.

use std::net::SocketAddr;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::ConfigError;

/// The shortest admin token accepted: 32 bytes, so guessing it is out of reach even before the
/// admin listener's throttle (docs/architecture/security.md#admin-surface).
pub const MIN_ADMIN_TOKEN_BYTES: usize = 32;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiSettings {
    pub listen: SocketAddr,
    /// Largest accepted request body; anything bigger is a 400 before parsing.
    pub max_body_bytes: usize,
    /// Reservation requests handled at once; beyond it the API answers 503 OVERLOADED at once.
    pub max_inflight: usize,
    /// How long after the reservation an order may still be created (immutable, in the message).
    pub reservation_valid_secs: u64,
    /// First re-send attempt of an UNKNOWN send is scheduled this far ahead (scanner backoff base).
    pub resend_backoff_ms: u64,
    /// Bearer token for the admin listener; empty: no admin listener. A secret, never printed.
    pub admin_token: SecretString,
    /// Where the admin listener (pause, resume, status, outbox requeue) listens: keep it off
    /// the buyers' load balancer (docs/architecture/security.md#admin-surface).
    pub admin_listen: SocketAddr,
    /// Where `api` serves /metrics, /healthz, /readyz for operators: the buyers' port serves
    /// no metrics (docs/architecture/security.md#security-model).
    pub metrics_listen: SocketAddr,
    /// Seconds from SIGTERM to exit at most: the drain delay, then in-flight requests.
    pub shutdown_grace_secs: u64,
    /// On SIGTERM, `/readyz` turns 503 and the listeners keep serving this long, so a load
    /// balancer's health check takes the instance out before anything is refused (0: close at
    /// once, for an instance no balancer sends to).
    pub drain_delay_ms: u64,
    /// Fail closed (docs/architecture/hot-path.md#fail-closed-admission): new reservations get 503
    /// SALE_PAUSED while the oldest unconfirmed reservation (or the order-create lag) is older than
    /// this share of the reservation validity; admission resumes once it is back under half of
    /// that.
    pub fail_closed_share: f64,
    /// How often the admission check runs.
    pub admission_check_ms: u64,
    /// How often an API instance re-reads the SKUs it answers SOLD_OUT from memory: a released
    /// unit is refused for at most this long (0: every request goes to Redis).
    pub sold_out_poll_ms: u64,
    /// After a fail-closed pause ends, admission ramps from 10 % of new reservations to all
    /// over this many seconds (0: all at once).
    pub resume_ramp_secs: u64,
    /// Lag probes failing in a row (with reservations sent meanwhile) before admission closes:
    /// an unreadable lag is never read as a fresh one.
    pub lag_unreadable_probes: u32,
    /// A request head must arrive within this; a keep-alive connection idle this long closes.
    pub header_read_timeout_ms: u64,
    /// A whole request, its body included, is answered within this (408 otherwise).
    pub request_timeout_ms: u64,
    /// An answer whose write makes no progress this long (a client that never reads) closes
    /// its connection.
    pub write_timeout_ms: u64,
    /// Largest request head (request line and headers); a longer one gets 431 and a closed
    /// connection. A half-sent head holds at most this much memory.
    pub max_head_bytes: usize,
    /// Connections served at once; past it the listener waits for one to close.
    pub max_connections: usize,
    /// Reservation requests a buyer may make per second, sustained (0: no limit)...
    pub buyer_rate_per_sec: f64,
    /// ...and at once after a quiet spell (the bucket's size).
    pub buyer_burst: u32,
    /// The same per client address (0: no limit).
    pub address_rate_per_sec: f64,
    pub address_burst: u32,
    /// Peers whose `X-Forwarded-For` is believed (a load balancer in front of the API); any
    /// other peer is the client address itself, whatever it forwards.
    pub trusted_proxies: Vec<std::net::IpAddr>,
}

impl ApiSettings {
    /// The buyers' listener's limits against slow and hostile clients.
    pub fn http_limits(&self) -> crate::http::Limits {
        crate::http::Limits {
            name: "buyers",
            header_read_timeout: std::time::Duration::from_millis(self.header_read_timeout_ms),
            request_timeout: std::time::Duration::from_millis(self.request_timeout_ms),
            write_timeout: std::time::Duration::from_millis(self.write_timeout_ms),
            max_head_bytes: self.max_head_bytes,
            max_connections: self.max_connections,
        }
    }
}

impl ApiSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if self.max_body_bytes < 64 {
            return Err(invalid("api.max_body_bytes", "must be at least 64"));
        }
        if self.max_inflight == 0 {
            return Err(invalid("api.max_inflight", "must be at least 1"));
        }
        if self.reservation_valid_secs == 0 {
            return Err(invalid("api.reservation_valid_secs", "must be positive"));
        }
        if !(self.fail_closed_share > 0.0 && self.fail_closed_share <= 1.0) {
            return Err(invalid("api.fail_closed_share", "must be in (0, 1]"));
        }
        if self.lag_unreadable_probes == 0 {
            return Err(invalid("api.lag_unreadable_probes", "must be at least 1"));
        }
        if self.sold_out_poll_ms > 10_000 {
            return Err(invalid(
                "api.sold_out_poll_ms",
                "must be at most 10000 (a free unit is refused that long)",
            ));
        }
        if self.resume_ramp_secs > 3600 {
            return Err(invalid("api.resume_ramp_secs", "must be at most 3600"));
        }
        if self.admission_check_ms == 0 {
            return Err(invalid("api.admission_check_ms", "must be positive"));
        }
        if self.resend_backoff_ms == 0 {
            return Err(invalid("api.resend_backoff_ms", "must be positive"));
        }
        self.validate_listeners()?;
        for (key, rate, burst) in [
            (
                "api.buyer_rate_per_sec",
                self.buyer_rate_per_sec,
                self.buyer_burst,
            ),
            (
                "api.address_rate_per_sec",
                self.address_rate_per_sec,
                self.address_burst,
            ),
        ] {
            if !(rate.is_finite() && rate >= 0.0) {
                return Err(invalid(key, "must be 0 (no limit) or positive"));
            }
            if rate > 0.0 && burst == 0 {
                return Err(invalid(key, "needs a burst of at least 1"));
            }
        }
        Ok(())
    }

    /// The listeners' bounds, the hand-off on SIGTERM and the admin token.
    fn validate_listeners(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if self.header_read_timeout_ms == 0 || self.header_read_timeout_ms > 60_000 {
            return Err(invalid(
                "api.header_read_timeout_ms",
                "must be in 1..=60000",
            ));
        }
        if self.request_timeout_ms == 0 || self.request_timeout_ms > 120_000 {
            return Err(invalid("api.request_timeout_ms", "must be in 1..=120000"));
        }
        if self.max_connections == 0 {
            return Err(invalid("api.max_connections", "must be at least 1"));
        }
        if self.drain_delay_ms >= self.shutdown_grace_secs * 1000 {
            return Err(invalid(
                "api.drain_delay_ms",
                "must be shorter than api.shutdown_grace_secs, which bounds the whole shutdown",
            ));
        }
        if self.write_timeout_ms == 0 || self.write_timeout_ms > 60_000 {
            return Err(invalid("api.write_timeout_ms", "must be in 1..=60000"));
        }
        let head = crate::http::MIN_HEAD_BYTES;
        if !(head..=65_536).contains(&self.max_head_bytes) {
            return Err(ConfigError::invalid(
                "api.max_head_bytes",
                format!("must be in {head}..=65536"),
            ));
        }
        let admin = self.admin_token.expose_secret().len();
        if admin > 0 && admin < MIN_ADMIN_TOKEN_BYTES {
            return Err(ConfigError::invalid(
                "api.admin_token",
                format!(
                    "must be at least {MIN_ADMIN_TOKEN_BYTES} bytes (e.g. `openssl rand -hex 32`), \
                     or empty for no admin listener"
                ),
            ));
        }
        Ok(())
    }
}

/// Who the buyer of a request is (docs/architecture/security.md#security-model).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuyerIdentity {
    /// The verified `sub` of an `Authorization: Bearer` JWT; the body's `user_id` may be left
    /// out, and must equal it when present.
    Token,
    /// The body's `user_id`, believed as sent: for development and the benchmark's
    /// comparison only, refused when `env = "PROD"`.
    Body,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSettings {
    pub buyers: BuyerIdentity,
    /// JWKS (JSON) with the public keys buyer tokens are signed with: RSA (RS256, PS256),
    /// P-256 (ES256) or Ed25519 (EdDSA), each with a `kid`; publish a new key beside the old
    /// one to rotate.
    pub jwks_file: String,
    /// The identity provider's JWKS URL (https, or http to loopback): fetched at start, every
    /// `jwks_refresh_secs`, and on a token naming an unknown `kid` (at most once per
    /// `jwks_min_refresh_secs`); the last good set is kept while the provider is down.
    pub jwks_url: String,
    /// CA file for `jwks_url`'s certificate (empty: the system's roots).
    pub jwks_ca_file: String,
    pub jwks_refresh_secs: u64,
    pub jwks_min_refresh_secs: u64,
    /// One fetch's bound, connect included.
    pub jwks_timeout_ms: u64,
    /// Verified tokens remembered (digest of the whole token, kept until its `exp`), so a
    /// buyer's retries cost one signature check; 0 turns the cache off.
    pub token_cache_entries: usize,
    /// The `aud` every token must carry.
    pub audience: String,
    /// The `iss` every token must carry (empty: not checked).
    pub issuer: String,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway_secs: u64,
    /// HS256 secret for development tokens (`seckill token mint`); empty in production and
    /// refused when `env = "PROD"`. A secret, never printed.
    pub dev_hs256_secret: SecretString,
}

impl AuthSettings {
    /// Development shortcuts never reach PROD (`prod`: `env = "PROD"`).
    pub(super) fn validate(&self, prod: bool) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if prod && self.buyers == BuyerIdentity::Body {
            return Err(invalid(
                "auth.buyers",
                "\"body\" believes any caller's user_id and is refused when env = \"PROD\"",
            ));
        }
        let dev = self.dev_hs256_secret.expose_secret();
        if prod && !dev.is_empty() {
            return Err(invalid(
                "auth.dev_hs256_secret",
                "development tokens are refused when env = \"PROD\" (use auth.jwks_url or auth.jwks_file)",
            ));
        }
        if !dev.is_empty() && dev.len() < 32 {
            return Err(invalid(
                "auth.dev_hs256_secret",
                "must be at least 32 bytes",
            ));
        }
        if self.audience.is_empty() {
            return Err(invalid("auth.audience", "must not be empty"));
        }
        if self.leeway_secs > 300 {
            return Err(invalid("auth.leeway_secs", "must be at most 300"));
        }
        if !self.jwks_url.is_empty() {
            check_jwks_url(&self.jwks_url)?;
        }
        if self.jwks_min_refresh_secs == 0 {
            return Err(invalid("auth.jwks_min_refresh_secs", "must be at least 1"));
        }
        if self.jwks_refresh_secs < self.jwks_min_refresh_secs {
            return Err(invalid(
                "auth.jwks_refresh_secs",
                "must be at least auth.jwks_min_refresh_secs",
            ));
        }
        if !(100..=30_000).contains(&self.jwks_timeout_ms) {
            return Err(invalid("auth.jwks_timeout_ms", "must be 100..=30000"));
        }
        if self.token_cache_entries > 10_000_000 {
            return Err(invalid(
                "auth.token_cache_entries",
                "must be at most 10000000 (about 1 GB)",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaymentSettings {
    /// HMAC-SHA256 secrets shared with the payment provider; a notification signed with any
    /// of them is accepted (several during a rotation). Empty: payment notifications are
    /// refused. Secrets, never printed.
    pub webhook_secrets: Vec<SecretString>,
    /// How far a notification's signed timestamp may be from now, either way.
    pub tolerance_secs: u64,
    /// A payment is answered 2xx only once its commit is on a synchronous standby; while the
    /// primary has none (`synchronous_standby_names` empty) notifications are refused 503
    /// `PAYMENT_NOT_DURABLE` and the provider sends them again
    /// (docs/architecture/postgresql.md#failover). Off: a single server's commit suffices.
    #[serde(default)]
    pub require_sync_standby: bool,
}

impl PaymentSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if self
            .webhook_secrets
            .iter()
            .any(|s| s.expose_secret().len() < 16)
        {
            return Err(invalid(
                "payments.webhook_secrets",
                "every secret must be at least 16 bytes",
            ));
        }
        if !(1..=3600).contains(&self.tolerance_secs) {
            return Err(invalid("payments.tolerance_secs", "must be in 1..=3600"));
        }
        Ok(())
    }
}

const JWKS_URL: &str = "auth.jwks_url";

/// Whether `url` may carry keys: `https://`, or `http://` to a loopback address (a sidecar on
/// the same host), nothing else.
pub fn check_jwks_url(url: &str) -> Result<(), ConfigError> {
    let parsed = url::Url::parse(url)
        .map_err(|e| ConfigError::invalid(JWKS_URL, format!("not a URL: {e}")))?;
    let loopback = match parsed.host() {
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    match parsed.scheme() {
        "https" => Ok(()),
        "http" if loopback => Ok(()),
        "http" => Err(ConfigError::invalid(
            JWKS_URL,
            "plain http only to a loopback address; keys from elsewhere need https",
        )),
        other => Err(ConfigError::invalid(
            JWKS_URL,
            format!("scheme `{other}`; use https"),
        )),
    }
}

/// `[passes]`: sale passes (docs/architecture/hot-path.md#sale-passes) and the proof of work their
/// registration may require.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PassSettings {
    /// Secrets that sign passes and proof-of-work challenges: the first signs, any verifies
    /// (two during a rotation); the same on every API instance. Empty: no pass can be issued
    /// or checked, so an activity that requires passes sells to nobody. Secrets, never printed.
    pub secrets: Vec<SecretString>,
    /// SHA-256 rounds per counter a client tries.
    pub pow_cost: u32,
    /// Seconds a proof-of-work challenge may be answered in.
    pub pow_challenge_secs: u64,
    /// Challenges one instance is asked for per second that double the work (0: fixed work).
    pub pow_load_step_per_sec: u32,
    /// The most the load multiplies an activity's work by.
    pub pow_max_factor: u32,
}

impl Default for PassSettings {
    fn default() -> Self {
        Self {
            secrets: Vec::new(),
            pow_cost: 10,
            pow_challenge_secs: 300,
            pow_load_step_per_sec: 50,
            pow_max_factor: 64,
        }
    }
}

impl PassSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if self.secrets.iter().any(|s| s.expose_secret().len() < 32) {
            return Err(invalid(
                "passes.secrets",
                "every secret must be at least 32 bytes",
            ));
        }
        if !(1..=100_000).contains(&self.pow_cost) {
            return Err(invalid("passes.pow_cost", "must be in 1..=100000"));
        }
        if !(10..=86_400).contains(&self.pow_challenge_secs) {
            return Err(invalid(
                "passes.pow_challenge_secs",
                "must be in 10..=86400",
            ));
        }
        if !(1..=1024).contains(&self.pow_max_factor) {
            return Err(invalid("passes.pow_max_factor", "must be in 1..=1024"));
        }
        Ok(())
    }
}
