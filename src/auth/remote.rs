//! The identity provider's keys from its JWKS URL (`auth.jwks_url`;
//! docs/architecture/security.md#buyer-tokens).
//!
//! - Fetched at start and every `auth.jwks_refresh_secs`; until a first fetch succeeds the
//!   API is not ready and answers buyers 503 (the fault is ours, not theirs).
//! - A token naming a `kid` the set lacks triggers one refresh: one in flight at a time (later
//!   askers wait for its outcome), and none sooner than `auth.jwks_min_refresh_secs` after the
//!   last, so a caller spraying random kids costs the provider one request per interval.
//! - A failed fetch, an answer that is not a JWKS, or an empty one keeps the last good set.
//! - A changed set replaces the old one whole (a withdrawn key verifies nothing from then on)
//!   and empties the verified-token cache.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::cache::TokenCache;
use super::jwks::KeySet;
use crate::config::{AuthSettings, ConfigError};

const KEY: &str = "auth.jwks_url";

/// The most a JWKS answer may weigh: a provider's set is a few kilobytes.
const MAX_JWKS_BYTES: usize = 1 << 20;

/// Why a refresh ran: the label of `jwks_refresh_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Start,
    Periodic,
    UnknownKid,
}

impl Reason {
    fn label(self) -> &'static str {
        match self {
            Reason::Start => "start",
            Reason::Periodic => "periodic",
            Reason::UnknownKid => "unknown_kid",
        }
    }
}

/// The provider's key set, kept fresh.
pub struct RemoteJwks {
    url: String,
    client: reqwest::Client,
    /// The last good set (empty until the first fetch succeeds).
    current: RwLock<Current>,
    loaded: AtomicBool,
    /// Held while a refresh runs (single flight); when the last on-demand one started.
    last_on_demand: tokio::sync::Mutex<Option<Instant>>,
    min_interval: Duration,
    period: Duration,
    cache: Option<Arc<TokenCache>>,
}

/// The last good set and the JWKS text it came from (an unchanged answer changes nothing).
#[derive(Default)]
struct Current {
    keys: Arc<KeySet>,
    source: String,
}

impl RemoteJwks {
    /// The fetcher for `auth.jwks_url` (not fetched yet: see [`RemoteJwks::start`]).
    pub fn new(s: &AuthSettings, cache: Option<Arc<TokenCache>>) -> Result<Self, ConfigError> {
        crate::config::check_jwks_url(&s.jwks_url)?;
        // The client builds a TLS config even for a loopback http URL, from the process's
        // crypto provider.
        crate::tls::install_crypto_provider();
        let mut client = reqwest::Client::builder()
            .timeout(Duration::from_millis(s.jwks_timeout_ms))
            .connect_timeout(Duration::from_millis(s.jwks_timeout_ms))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("seckill/", env!("CARGO_PKG_VERSION")));
        if s.jwks_url.starts_with("https://") {
            let tls = crate::tls::client_config(&s.jwks_ca_file, "auth.jwks_ca_file")
                .map_err(|e| ConfigError::invalid(e.key, e.reason))?;
            client = client.use_preconfigured_tls(tls);
        }
        let client = client
            .build()
            .map_err(|e| ConfigError::invalid(KEY, e.to_string()))?;
        Ok(Self {
            url: s.jwks_url.clone(),
            client,
            current: RwLock::default(),
            loaded: AtomicBool::new(false),
            last_on_demand: tokio::sync::Mutex::new(None),
            min_interval: Duration::from_secs(s.jwks_min_refresh_secs),
            period: Duration::from_secs(s.jwks_refresh_secs),
            cache,
        })
    }

    /// The current set (the last good one).
    pub fn keys(&self) -> Arc<KeySet> {
        self.current.read().expect("jwks lock").keys.clone()
    }

    /// Whether a set has ever been fetched.
    pub fn loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    /// First fetch, then the refresh loop until `shutdown`: every `auth.jwks_refresh_secs`
    /// once loaded, every `auth.jwks_min_refresh_secs` until then.
    pub fn start(self: &Arc<Self>, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut reason = Reason::Start;
            loop {
                {
                    let _flight = this.last_on_demand.lock().await;
                    this.refresh(reason).await;
                }
                reason = Reason::Periodic;
                let wait = if this.loaded() {
                    this.period
                } else {
                    this.min_interval
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        })
    }

    /// A token named `kid` and no key has it: refresh once, unless a refresh in flight or one
    /// less than `auth.jwks_min_refresh_secs` ago already answered. The set afterwards.
    pub async fn refresh_for(&self, kid: &str) -> Arc<KeySet> {
        let mut last = self.last_on_demand.lock().await;
        let keys = self.keys();
        if keys.get(kid).is_some() {
            return keys;
        }
        if last.is_some_and(|t| t.elapsed() < self.min_interval) {
            metrics::counter!("jwks_refresh_total", "reason" => "unknown_kid", "result" => "throttled")
                .increment(1);
            return keys;
        }
        *last = Some(Instant::now());
        self.refresh(Reason::UnknownKid).await;
        self.keys()
    }

    /// One fetch; the set is replaced only by a good, non-empty, different one.
    async fn refresh(&self, reason: Reason) {
        let started = Instant::now();
        let result = match self.fetch().await {
            Ok(text) => self.adopt(text),
            Err(e) => {
                warn!(url = %self.url, reason = reason.label(), error = %e,
                      "cannot refresh the identity provider's keys; keeping the last good set");
                "error"
            }
        };
        metrics::histogram!("jwks_refresh_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        metrics::counter!("jwks_refresh_total", "reason" => reason.label(), "result" => result)
            .increment(1);
    }

    async fn fetch(&self) -> Result<String, String> {
        let mut resp = self
            .client
            .get(&self.url)
            .header("accept", "application/json")
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("HTTP {}", resp.status()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_JWKS_BYTES {
                return Err(format!("answer larger than {MAX_JWKS_BYTES} bytes"));
            }
        }
        let text = String::from_utf8(body).map_err(|_| "answer is not UTF-8".to_string())?;
        Ok(text)
    }

    /// Takes a fetched JWKS if it is good and new; the result label.
    fn adopt(&self, text: String) -> &'static str {
        if self.current.read().expect("jwks lock").source == text {
            self.mark_loaded();
            return "unchanged";
        }
        let set = match KeySet::parse(&text, KEY) {
            Ok(set) if !set.is_empty() => set,
            Ok(_) => {
                warn!(url = %self.url, "the identity provider published no key; keeping the last good set");
                return "error";
            }
            Err(e) => {
                warn!(url = %self.url, error = %e, "the identity provider's answer is not a usable JWKS; keeping the last good set");
                return "error";
            }
        };
        let old = self.keys();
        let (before, after) = (old.kids(), set.kids());
        let added: Vec<&str> = after
            .iter()
            .filter(|k| !before.contains(k))
            .copied()
            .collect();
        let dropped: Vec<&str> = before
            .iter()
            .filter(|k| !after.contains(k))
            .copied()
            .collect();
        info!(url = %self.url, keys = set.len(), added = ?added, dropped = ?dropped,
              "identity provider's keys changed");
        metrics::gauge!("jwks_keys").set(set.len() as f64);
        *self.current.write().expect("jwks lock") = Current {
            keys: Arc::new(set),
            source: text,
        };
        if let Some(cache) = &self.cache {
            cache.clear();
        }
        self.mark_loaded();
        "ok"
    }

    fn mark_loaded(&self) {
        self.loaded.store(true, Ordering::Release);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        metrics::gauge!("jwks_last_success_timestamp_seconds").set(now.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_over_https_or_from_loopback_only() {
        for ok in [
            "https://login.shop.example/.well-known/jwks.json",
            "http://127.0.0.1:8089/jwks",
            "http://[::1]/jwks",
            "http://localhost/jwks",
        ] {
            assert!(crate::config::check_jwks_url(ok).is_ok(), "{ok}");
        }
        for bad in [
            "http://login.shop.example/jwks",
            "http://10.0.0.1/jwks",
            "ftp://127.0.0.1/jwks",
            "file:///etc/jwks.json",
            "not a url",
        ] {
            let e = crate::config::check_jwks_url(bad)
                .err()
                .unwrap_or_else(|| panic!("{bad} accepted"));
            assert!(e.to_string().contains(KEY), "{e}");
        }
    }
}
