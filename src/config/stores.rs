//! `[pg]` and `[redis]`: where the stores are and how every wait on them is bounded.

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::ConfigError;

/// 1-32 characters of A-Z, a-z, 0-9, _ (the environment name, the schema): what may go into a
/// schema, topic or group name unquoted.
pub(super) fn is_ident(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PgSettings {
    /// libpq-style connection string (`host=... user=... dbname=...`). It may hold a password:
    /// a secret, never printed (errors name the host and port instead).
    pub url: SecretString,
    /// Schema holding the tables; tests give each run its own.
    pub schema: String,
    /// Order transactions the database sustains at once (measured, not guessed:
    /// docs/architecture/order-creation.md#worker-budget).
    pub safe_concurrency: u32,
    /// Share of that concurrency the order consumers may use; the rest is for payment, queries, ops.
    pub order_share: f64,
    /// Share of it the timeout cancel may use (`order_share + cancel_share <= 1`).
    pub cancel_share: f64,
    /// Connections the whole fleet may open on the database: its `max_connections` less the
    /// superuser reserve and every other client
    /// (docs/architecture/order-creation.md#connection-budget).
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Instances of each role against this database: the worker budgets are divided among
    /// consume and timeout-cancel instances, and the connection budget counts every role's
    /// pools. Read the first two through [`PgSettings::consume_instances`] and
    /// [`PgSettings::timeout_cancel_instances`].
    #[serde(default = "one")]
    pub api_instances: u32,
    #[serde(default, rename = "consume_instances")]
    pub consume_instances_key: Option<u32>,
    #[serde(default, rename = "timeout_cancel_instances")]
    pub timeout_cancel_instances_key: Option<u32>,
    #[serde(default = "one")]
    pub scan_instances: u32,
    /// Connections kept for operators' one-shot commands (migrate, reconcile, dlq, refunds,
    /// resync).
    #[serde(default = "default_operator_connections")]
    pub operator_connections: u32,
    /// Deprecated: one count for consume and timeout-cancel instances at once. Still read for
    /// whichever of `consume_instances` / `timeout_cancel_instances` is not set, with a
    /// warning at start-up ([`PgSettings::deprecations`]).
    #[serde(default)]
    pub instances: Option<u32>,
    /// Bound on any one statement, so a stuck lock turns into a retry, not a hung worker.
    pub statement_timeout_ms: u64,
    /// Connections for the API's reads (order / reservation lookups).
    pub api_pool_size: usize,
    /// How long a worker waits for a pooled connection before the attempt counts as transient.
    pub pool_wait_timeout_ms: u64,
    /// How often each role reads which server is the primary and on which timeline: a change
    /// is a failover seen (docs/architecture/postgresql.md#failover).
    #[serde(default = "default_primary_check_ms")]
    pub primary_check_ms: u64,
    /// TLS to PostgreSQL: `off`, or `verify` (encrypted; the server's certificate checked
    /// against `pg.ca_file`, or the system's roots when empty, and its name against the host).
    pub tls: PgTls,
    /// PEM file of the CA(s) that sign the server's certificate (`verify` only).
    pub ca_file: String,
}

fn default_primary_check_ms() -> u64 {
    1000
}

/// Several hosts in `pg.url` are a primary and its standbys: every connection must open on the
/// one that accepts writes, which only `target_session_attrs=read-write` asks for (without it
/// the first host that answers is taken, a standby or a demoted primary included).
fn check_hosts(url: &tokio_postgres::Config) -> Result<(), ConfigError> {
    use tokio_postgres::config::TargetSessionAttrs;
    let hosts = url.get_hosts().len();
    if hosts > 1 && url.get_target_session_attrs() != TargetSessionAttrs::ReadWrite {
        return Err(ConfigError::invalid(
            "pg.url",
            "names several hosts: add target_session_attrs=read-write so every connection \
             opens on the primary (docs/architecture/postgresql.md#failover)",
        ));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PgTls {
    Off,
    Verify,
}

/// How the reservation store is deployed (docs/architecture/redis.md#redis-cluster).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisMode {
    /// One server (or a primary with replicas behind one address).
    Standalone,
    /// Redis Cluster: `url` lists seed nodes, commands follow the slot map.
    Cluster,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisSettings {
    pub mode: RedisMode,
    /// `redis://[:password@]host:port`; with `mode = "cluster"`, a comma-separated list of
    /// seed nodes. A secret, never printed.
    pub url: SecretString,
    /// Prefix of every key; tests give each run its own.
    pub key_prefix: String,
    pub pool_size: usize,
    /// Connecting to Redis takes at most this.
    pub connect_timeout_ms: u64,
    /// Each command's answer takes at most this; past it the call fails (the caller answers
    /// 503 and the buyer retries with the same request_id).
    pub response_timeout_ms: u64,
    /// Waiting for a pooled connection takes at most this.
    pub pool_wait_timeout_ms: u64,
    /// PEM file of the CA(s) that sign the server's certificate, for a `rediss://` URL (empty:
    /// the system's roots).
    pub ca_file: String,
}

impl RedisSettings {
    /// Each node `url` names (one, or a cluster's seeds), exposed: never print them.
    pub fn urls(&self) -> Vec<&str> {
        self.url.expose_secret().split(',').map(str::trim).collect()
    }
}

fn one() -> u32 {
    1
}

fn default_max_connections() -> u32 {
    90
}

fn default_operator_connections() -> u32 {
    8
}

impl PgSettings {
    /// `consume` instances: `pg.consume_instances`, else the deprecated `pg.instances`, else 1.
    pub fn consume_instances(&self) -> u32 {
        self.consume_instances_key.or(self.instances).unwrap_or(1)
    }

    /// `timeout-cancel` instances: `pg.timeout_cancel_instances`, else the deprecated
    /// `pg.instances`, else 1.
    pub fn timeout_cancel_instances(&self) -> u32 {
        self.timeout_cancel_instances_key
            .or(self.instances)
            .unwrap_or(1)
    }

    /// Keys still read but on their way out, each with what replaces it (logged at start-up).
    pub fn deprecations(&self) -> Vec<String> {
        match self.instances {
            Some(n) => vec![format!(
                "pg.instances = {n} is deprecated: it counts consume and timeout-cancel \
                 instances at once; set pg.consume_instances and pg.timeout_cancel_instances \
                 (now {} and {})",
                self.consume_instances(),
                self.timeout_cancel_instances()
            )],
            None => Vec::new(),
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if self.url.expose_secret().trim().is_empty() {
            return Err(invalid("pg.url", "must not be empty"));
        }
        let Ok(url) = self.url.expose_secret().parse::<tokio_postgres::Config>() else {
            return Err(invalid(
                "pg.url",
                "is not a valid PostgreSQL connection string",
            ));
        };
        check_hosts(&url)?;
        if !is_ident(&self.schema) || self.schema.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(invalid("pg.schema", "must be a plain identifier"));
        }
        if self.safe_concurrency == 0 {
            return Err(invalid("pg.safe_concurrency", "must be at least 1"));
        }
        if !(self.order_share > 0.0 && self.order_share <= 1.0) {
            return Err(invalid("pg.order_share", "must be in (0, 1]"));
        }
        if !(self.cancel_share > 0.0 && self.cancel_share < 1.0) {
            return Err(invalid("pg.cancel_share", "must be in (0, 1)"));
        }
        if self.order_share + self.cancel_share > 1.0 {
            return Err(invalid(
                "pg.cancel_share",
                "pg.order_share + pg.cancel_share must not exceed 1",
            ));
        }
        for (key, n) in [
            ("pg.instances", self.instances.unwrap_or(1)),
            ("pg.api_instances", self.api_instances),
            ("pg.consume_instances", self.consume_instances()),
            (
                "pg.timeout_cancel_instances",
                self.timeout_cancel_instances(),
            ),
            ("pg.scan_instances", self.scan_instances),
            ("pg.max_connections", self.max_connections),
        ] {
            if n == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        if self.statement_timeout_ms == 0 {
            return Err(invalid("pg.statement_timeout_ms", "must be positive"));
        }
        if self.api_pool_size == 0 {
            return Err(invalid("pg.api_pool_size", "must be at least 1"));
        }
        if self.pool_wait_timeout_ms == 0 {
            return Err(invalid("pg.pool_wait_timeout_ms", "must be positive"));
        }
        if !(100..=60_000).contains(&self.primary_check_ms) {
            return Err(invalid("pg.primary_check_ms", "must be in 100..=60000"));
        }
        if !self.ca_file.is_empty() {
            if self.tls != PgTls::Verify {
                return Err(invalid("pg.ca_file", "is for pg.tls = \"verify\" only"));
            }
            crate::tls::read_ca(&self.ca_file, "pg.ca_file")?;
        }
        Ok(())
    }
}

impl RedisSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        let urls = self.urls();
        if urls
            .iter()
            .any(|u| !u.starts_with("redis://") && !u.starts_with("rediss://"))
        {
            return Err(invalid(
                "redis.url",
                "must start with redis:// (or rediss:// for TLS)",
            ));
        }
        if urls.len() > 1 && self.mode != RedisMode::Cluster {
            return Err(invalid(
                "redis.url",
                "lists several nodes: that is for redis.mode = \"cluster\"",
            ));
        }
        if urls.iter().any(|u| u.starts_with("rediss://")) != urls[0].starts_with("rediss://") {
            return Err(invalid("redis.url", "mixes redis:// and rediss:// nodes"));
        }
        if !self.ca_file.is_empty() {
            if !urls[0].starts_with("rediss://") {
                return Err(invalid("redis.ca_file", "is for a rediss:// URL only"));
            }
            crate::tls::read_ca(&self.ca_file, "redis.ca_file")?;
        }
        if self.key_prefix.is_empty() || self.key_prefix.contains(['{', '}', ' ']) {
            return Err(invalid(
                "redis.key_prefix",
                "must be non-empty without braces or spaces",
            ));
        }
        if self.pool_size == 0 {
            return Err(invalid("redis.pool_size", "must be at least 1"));
        }
        for (key, ms) in [
            ("redis.connect_timeout_ms", self.connect_timeout_ms),
            ("redis.response_timeout_ms", self.response_timeout_ms),
            ("redis.pool_wait_timeout_ms", self.pool_wait_timeout_ms),
        ] {
            if ms == 0 || ms > 60_000 {
                return Err(invalid(key, "must be in 1..=60000"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(url: &str) -> PgSettings {
        PgSettings {
            url: url.to_owned().into(),
            ..super::super::tests::test_settings().pg
        }
    }

    #[test]
    fn several_hosts_need_read_write_sessions_one_host_does_not() {
        assert!(pg("host=127.0.0.1 port=5432 user=postgres")
            .validate()
            .is_ok());
        let two = "host=127.0.0.1,127.0.0.1 port=5441,5442 user=postgres dbname=seckill";
        match pg(two).validate() {
            Err(ConfigError::Invalid { key, reason }) => {
                assert_eq!(key, "pg.url");
                assert!(
                    reason.contains("target_session_attrs=read-write"),
                    "{reason}"
                );
            }
            other => panic!("two hosts without read-write sessions: {other:?}"),
        }
        let any = format!("{two} target_session_attrs=any");
        assert!(pg(&any).validate().is_err());
        let rw = format!("{two} target_session_attrs=read-write");
        assert!(pg(&rw).validate().is_ok());
        let uri = "postgresql://postgres@127.0.0.1:5441,127.0.0.1:5442/seckill\
                   ?target_session_attrs=read-write";
        assert!(pg(uri).validate().is_ok());
    }
}
