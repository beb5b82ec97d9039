//! One settings tree for every role: `config/default.toml`, then `config/{SECKILL_ENV}.toml`,
//! then environment variables `SECKILL__SECTION__KEY`. Everything is validated at start-up and a
//! wrong value fails naming its key, so a bad deployment never reaches the sale.
//!
//! One file per concern, each section validating its own keys; what relates two sections is
//! checked here:
//! - `stores`: `[pg]`, `[redis]`;
//! - `mq`: `[mq]`, `[events]`;
//! - `api`: `[api]`, `[auth]`, `[payments]`;
//! - `workers`: `[consumer]`, `[scan]`, `[timeout]`, `[retention]`, `[telemetry]`;
//! - `names`: topic and group names from `env`;
//! - `dlq`: `[dlq]`, the ticket hook of new groups of failures;
//! - `budget`: every role's PostgreSQL pools against `pg.max_connections`.

mod api;
pub mod budget;
mod dlq;
mod mq;
mod names;
mod stores;
mod workers;

use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

pub use api::{
    check_jwks_url, ApiSettings, AuthSettings, BuyerIdentity, PassSettings, PaymentSettings,
    MIN_ADMIN_TOKEN_BYTES,
};
pub use dlq::DlqSettings;
pub use mq::{EventDelivery, EventSettings, MqSettings};
pub use names::Names;
use stores::is_ident;
pub use stores::{PgSettings, PgTls, RedisMode, RedisSettings};
pub use workers::{
    ConsumerSettings, RetentionSettings, ScanSettings, TelemetrySettings, TimeoutSettings,
};

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Load(#[from] config::ConfigError),
    #[error("config key `{key}`: {reason}")]
    Invalid { key: &'static str, reason: String },
}

impl From<crate::tls::TlsError> for ConfigError {
    fn from(e: crate::tls::TlsError) -> Self {
        ConfigError::Invalid {
            key: e.key,
            reason: e.reason,
        }
    }
}

impl ConfigError {
    /// The value of `key` is wrong, for `reason`.
    pub fn invalid(key: &'static str, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key,
            reason: reason.into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Environment name; it prefixes every topic and consumer group (`PROD_SECKILL_...`), so
    /// environments and tests sharing one broker never see each other's messages.
    pub env: String,
    pub pg: PgSettings,
    pub redis: RedisSettings,
    pub mq: MqSettings,
    pub api: ApiSettings,
    pub auth: AuthSettings,
    pub payments: PaymentSettings,
    pub consumer: ConsumerSettings,
    pub scan: ScanSettings,
    pub timeout: TimeoutSettings,
    pub retention: RetentionSettings,
    pub telemetry: TelemetrySettings,
    #[serde(default)]
    pub events: EventSettings,
    #[serde(default)]
    pub passes: PassSettings,
    #[serde(default)]
    pub dlq: DlqSettings,
    /// The topic and group names of `env`, made on first use and kept (and cloned with the
    /// settings): every role reads them from here.
    #[serde(skip)]
    names: std::sync::OnceLock<Names>,
}

impl Settings {
    /// The topic and consumer-group names of this environment
    /// (docs/architecture/messages.md#topics-and-groups).
    pub fn names(&self) -> &Names {
        self.names.get_or_init(|| Names::new(&self.env))
    }

    /// How long a request may wait for its activity's draw
    /// (docs/architecture/hot-path.md#a-fair-start): its own time (`api.request_timeout_ms`) less
    /// one send and 500 ms for the answer. A fair window is at most this.
    pub fn draw_hold_ms(&self) -> u64 {
        self.api
            .request_timeout_ms
            .saturating_sub(self.mq.send_timeout_ms + 500)
    }

    /// Loads from `dir` (normally `config/`) with the environment overlay and env variables.
    pub fn load_from(dir: &Path) -> Result<Self, ConfigError> {
        let env_name = std::env::var("SECKILL_ENV").unwrap_or_else(|_| "local".to_string());
        let base: PathBuf = dir.join("default.toml");
        let overlay: PathBuf = dir.join(format!("{env_name}.toml"));
        let cfg = config::Config::builder()
            .add_source(config::File::from(base).required(true))
            .add_source(config::File::from(overlay).required(false))
            .add_source(
                config::Environment::with_prefix("SECKILL")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true),
            )
            .build()?;
        let settings: Settings = cfg.try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Loads from `$SECKILL_CONFIG_DIR` or `./config`.
    pub fn load() -> Result<Self, ConfigError> {
        let dir = std::env::var("SECKILL_CONFIG_DIR").unwrap_or_else(|_| "config".to_string());
        Self::load_from(Path::new(&dir))
    }

    /// Checks every value a role relies on; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !is_ident(&self.env) {
            return Err(ConfigError::invalid(
                "env",
                "must be 1-32 characters of A-Z, a-z, 0-9, _",
            ));
        }
        self.pg.validate()?;
        self.redis.validate()?;
        self.mq.validate()?;
        self.api.validate()?;
        self.consumer.validate()?;
        self.auth.validate(self.env == "PROD")?;
        self.payments.validate()?;
        self.events.validate()?;
        self.passes.validate()?;
        self.dlq.validate()?;
        self.scan.validate()?;
        self.timeout.validate()?;
        self.retention.validate()?;
        self.telemetry.validate()?;
        self.validate_across_sections()
    }

    /// What relates two sections.
    fn validate_across_sections(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if self.consumer.tx_timeout_ms < self.pg.statement_timeout_ms {
            return Err(invalid(
                "consumer.tx_timeout_ms",
                "must be at least pg.statement_timeout_ms",
            ));
        }
        if self.scan.resend_backoff_cap_ms < self.api.resend_backoff_ms {
            return Err(invalid(
                "scan.resend_backoff_cap_ms",
                "must be >= api.resend_backoff_ms",
            ));
        }
        let resend = self.scan.unconsumed_resend_ms;
        if resend > 0 && (resend < 1_000 || resend >= self.api.reservation_valid_secs * 1_000) {
            // Shorter than a commit would send copies of messages still in a transaction;
            // longer than the validity, and the reservation expires first.
            return Err(invalid(
                "scan.unconsumed_resend_ms",
                "must be 0 (off), or at least 1000 and below api.reservation_valid_secs",
            ));
        }
        let margin = self.consumer.fast_lane_margin_ms;
        if self.consumer.fast_lane_backlog_ms > 0
            && (margin == 0 || margin >= self.api.reservation_valid_secs * 1_000)
        {
            // As long as the validity, every message would be shed.
            return Err(invalid(
                "consumer.fast_lane_margin_ms",
                "must be positive and below api.reservation_valid_secs while the fast lane is on",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings of `config/` as the tests load them.
    pub(super) fn test_settings() -> Settings {
        Settings::load_from(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("config")
                .as_path(),
        )
        .unwrap()
    }
}
