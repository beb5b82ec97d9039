//! One settings tree for every role: `config/default.toml`, then `config/{SECKILL_ENV}.toml`,
//! then environment variables `SECKILL__SECTION__KEY`. Everything is validated at start-up and a
//! wrong value fails naming its key, so a bad deployment never reaches the sale.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("config: {0}")]
    Load(#[from] config::ConfigError),
    #[error("config key `{key}`: {reason}")]
    Invalid { key: &'static str, reason: String },
}

/// The shortest admin token accepted: 32 bytes, so guessing it is out of reach even before the
/// admin listener's throttle (docs/ARCHITECTURE.md#admin-surface).
pub const MIN_ADMIN_TOKEN_BYTES: usize = 32;

fn invalid(key: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        reason: reason.into(),
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
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PgSettings {
    /// libpq-style connection string (`host=... user=... dbname=...`). It may hold a password:
    /// a secret, never printed (errors name the host and port instead).
    pub url: SecretString,
    /// Schema holding the tables; tests give each run its own.
    pub schema: String,
    /// Order transactions the database sustains at once (measured, not guessed: docs/ARCHITECTURE.md#worker-budget).
    pub safe_concurrency: u32,
    /// Share of that concurrency the order consumers may use; the rest is for payment, queries, ops.
    pub order_share: f64,
    /// Share of it the timeout cancel may use (`order_share + cancel_share <= 1`).
    pub cancel_share: f64,
    /// Consumer instances sharing the budget (and timeout-cancel instances sharing theirs).
    pub instances: u32,
    /// Bound on any one statement, so a stuck lock turns into a retry, not a hung worker.
    pub statement_timeout_ms: u64,
    /// Connections for the API's reads (order / reservation lookups).
    pub api_pool_size: usize,
    /// How long a worker waits for a pooled connection before the attempt counts as transient.
    pub pool_wait_timeout_ms: u64,
    /// TLS to PostgreSQL: `off`, or `verify` (encrypted; the server's certificate checked
    /// against `pg.ca_file`, or the system's roots when empty, and its name against the host).
    pub tls: PgTls,
    /// PEM file of the CA(s) that sign the server's certificate (`verify` only).
    pub ca_file: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PgTls {
    Off,
    Verify,
}

/// How the reservation store is deployed (docs/ARCHITECTURE.md#redis-cluster).
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqSettings {
    /// The name servers, `host:port` (a name or an address), several separated by `;` as
    /// RocketMQ writes them (or `,`): the client asks the next when one does not answer.
    pub name_server: String,
    /// The master brokers topics are created on, `host:port`, comma-separated when the
    /// cluster has several (docs/ARCHITECTURE.md#two-brokers).
    pub broker_addr: String,
    pub cluster: String,
    /// Bound on one synchronous send; past it the outcome is UNKNOWN (never a release).
    pub send_timeout_ms: u64,
    /// Client retries of a refused or unsent attempt, inside `send_timeout_ms`.
    pub send_retries: u32,
    /// Queues per topic at creation (calibrated for this machine).
    pub order_create_queues: u32,
    pub other_queues: u32,
    /// Reservations gathered into one broker call by the API (1 = one send per reservation).
    pub send_batch_max: usize,
    /// How long a batch waits for more reservations after its first, in microseconds.
    pub send_linger_us: u64,
    /// Broker calls the API has in flight at once.
    pub send_batches_in_flight: usize,
}

impl MqSettings {
    /// Each master of `broker_addr`.
    pub fn broker_addrs(&self) -> impl Iterator<Item = &str> {
        self.broker_addr.split(',').map(str::trim)
    }

    /// Each name server of `name_server`.
    pub fn name_servers(&self) -> impl Iterator<Item = &str> {
        self.name_server
            .split([';', ','])
            .map(str::trim)
            .filter(|s| !s.is_empty())
    }

    /// The name servers as the RocketMQ client takes them: `a:9876;b:9876`.
    pub fn name_server_list(&self) -> String {
        self.name_servers().collect::<Vec<_>>().join(";")
    }
}

/// `host:port`, the host an IP address or a DNS name (resolved when connecting).
fn is_host_port(s: &str) -> bool {
    if s.parse::<SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    port.parse::<u16>().is_ok_and(|p| p > 0)
        && host.len() <= 253
        && host.trim_end_matches('.').split('.').all(label_ok)
}

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
    /// the buyers' load balancer (docs/ARCHITECTURE.md#admin-surface).
    pub admin_listen: SocketAddr,
    /// Where `api` serves /metrics, /healthz, /readyz for operators: the buyers' port serves
    /// no metrics (docs/ARCHITECTURE.md#security-model).
    pub metrics_listen: SocketAddr,
    /// Seconds from SIGTERM to exit at most: the drain delay, then in-flight requests.
    pub shutdown_grace_secs: u64,
    /// On SIGTERM, `/readyz` turns 503 and the listeners keep serving this long, so a load
    /// balancer's health check takes the instance out before anything is refused (0: close at
    /// once, for an instance no balancer sends to).
    pub drain_delay_ms: u64,
    /// Fail closed (docs/ARCHITECTURE.md#fail-closed-admission): new reservations get 503 SALE_PAUSED while the oldest
    /// unconfirmed reservation (or the order-create lag) is older than this share of the
    /// reservation validity; admission resumes once it is back under half of that.
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

/// Who the buyer of a request is (docs/ARCHITECTURE.md#security-model).
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
    /// JWKS (JSON) with the public keys buyer tokens are signed with: Ed25519 (EdDSA) or P-256
    /// (ES256), each with a `kid`; publish a new key beside the old one to rotate.
    pub jwks_file: String,
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaymentSettings {
    /// HMAC-SHA256 secrets shared with the payment provider; a notification signed with any
    /// of them is accepted (several during a rotation). Empty: payment notifications are
    /// refused. Secrets, never printed.
    pub webhook_secrets: Vec<SecretString>,
    /// How far a notification's signed timestamp may be from now, either way.
    pub tolerance_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumerSettings {
    /// Messages handed to one listener call, and at most per PostgreSQL transaction (calls are
    /// gathered into shared transactions up to this size).
    pub batch_size: usize,
    /// Order-create listener calls in flight at once (`consume --workers` overrides it): the
    /// batches the gathering sees together. Past the worker budget they wait in memory.
    pub listener_calls: usize,
    /// How long an order transaction that is not full waits for more calls to join it
    /// (docs/ARCHITECTURE.md#gathering-batches-across-queues); 0: natural batching only.
    pub gather_wait_ms: u64,
    /// Peak shaving inside the consumer (docs/ARCHITECTURE.md#pacing-during-a-burst): while the
    /// first waiting reservation is younger than this, one order transaction runs at a time
    /// and the backlog waits, leaving the CPU to the roles that answer buyers; past it the
    /// adaptive limit applies in full. 0: off.
    pub pace_age_ms: u64,
    /// The adaptive limit of order transactions in flight shrinks when a transaction takes
    /// longer than this (begin to commit)...
    pub tx_latency_target_ms: u64,
    /// ...or waits longer than this for a pooled connection; it grows back while both hold.
    pub pool_wait_target_ms: u64,
    /// Bound on one order transaction, begin to commit: past it the connection is dropped and
    /// the batch retried (each statement is already bounded by `pg.statement_timeout_ms`).
    pub tx_timeout_ms: u64,
    /// Broker redeliveries before a message goes to the DLQ.
    pub max_reconsume_times: i32,
    /// Where `consume` serves /metrics, /healthz, /readyz.
    pub metrics_listen: SocketAddr,
    /// Seconds to let in-flight transactions finish on SIGTERM.
    pub shutdown_grace_secs: u64,
    /// Seconds an order stays unpaid before the timeout cancel may take it back.
    pub pay_window_secs: u64,
    /// Listener calls in flight at once and messages per call of the other groups of the
    /// `consume` role (compensation, projection, DLQ intake); each call is one pooled
    /// connection's work, outside the order worker budget.
    pub compensate_workers: usize,
    pub compensate_batch_size: usize,
    pub projection_workers: usize,
    pub projection_batch_size: usize,
    pub dlq_intake_workers: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScanSettings {
    /// Where `scan` serves /metrics, /healthz, /readyz.
    pub metrics_listen: SocketAddr,
    /// Reservations one scanner leases per activity and pass.
    pub scanner_batch: usize,
    /// How long a scanner owns what it claimed; a dead scanner's claims return after it.
    pub scanner_lease_ms: u64,
    /// Pause between scanner passes when nothing was due.
    pub scanner_poll_ms: u64,
    /// Cap of the re-send backoff (it starts at `api.resend_backoff_ms` and doubles).
    pub resend_backoff_cap_ms: u64,
    /// How long after its validity a refused, uncertain reservation waits before it is settled
    /// from PostgreSQL (docs/ARCHITECTURE.md#uncertain-sends).
    pub settle_grace_ms: u64,
    /// A confirmed send the consumers have not taken this long after the group's progress
    /// on the brokers that answer is sent again (docs/ARCHITECTURE.md#a-dead-brokers-messages);
    /// 0: never.
    pub unconsumed_resend_ms: u64,
    /// Outbox rows one relay claims at a time.
    pub relay_batch: usize,
    /// How long a relay owns the rows it claimed before another may send them again.
    pub relay_lease_secs: u64,
    /// Attempts before an outbox row is marked DEAD (alert, operator).
    pub relay_max_attempts: i32,
    /// Fallback poll when no NOTIFY arrives.
    pub relay_poll_ms: u64,
    /// A timer (CANCEL_IF_UNPAID, due at the order's payment deadline) waits in the outbox
    /// until this long before it is due, then the relay sends it
    /// (docs/ARCHITECTURE.md#outbox-relay): a burst's timers leave the broker alone while the
    /// burst lasts. Written into the outbox row by the order transaction.
    pub timer_lead_secs: u64,
    pub relay_backoff_base_ms: u64,
    pub relay_backoff_cap_ms: u64,
    /// Sends in flight at once (scanner and relay each).
    pub send_concurrency: usize,
    pub shutdown_grace_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutSettings {
    /// Where `timeout-cancel` serves /metrics, /healthz, /readyz.
    pub metrics_listen: SocketAddr,
    /// The second trigger: an order still unpaid this long after its deadline (its timer is
    /// late or lost) is cancelled by the sweep over `orders` (docs/ARCHITECTURE.md#timeout-cancel-and-payment).
    pub sweep_grace_ms: u64,
    /// How often the sweep looks.
    pub sweep_interval_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSettings {
    /// Days inbox rows are kept (fractions allowed: 0.5 = 12 h). A replay of a message older
    /// than this could slip past the inbox and apply twice, so `dlq replay` refuses it unless
    /// forced.
    pub inbox_days: f64,
    /// Days SENT outbox rows are kept (PENDING and DEAD rows are never purged).
    pub outbox_days: f64,
    pub quarantine_days: f64,
    /// Days REPLAYED / DISCARDED dead letters are kept (OPEN ones are never purged).
    pub dlq_days: f64,
    /// Hours an activity's Redis keys (stock, buyers, request ids, indexes) live once the
    /// scanner has retired the activity (ended, nothing pending): long enough for the
    /// reconcile window (`seckill reconcile --window-hours`, 24 by default) to still compare
    /// them with PostgreSQL.
    pub activity_keys_hours: u32,
    /// After each pass, `VACUUM (ANALYZE)` the pipeline's busy tables. For a database that
    /// runs without autovacuum (such as this project's CI machines): dead rows from status
    /// updates and purges are otherwise never reclaimed, and every scan wades through them.
    /// Leave it off where autovacuum runs.
    pub vacuum: bool,
    /// Rows deleted per statement: small enough to never hold locks for long.
    pub batch: i64,
    /// How often `scan` runs the purge.
    pub interval_secs: u64,
}

impl RetentionSettings {
    /// A retention in days as a duration.
    pub fn age(days: f64) -> std::time::Duration {
        std::time::Duration::from_secs_f64(days.max(0.0) * 86_400.0)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySettings {
    /// `tracing` filter directive, e.g. `info,seckill=debug`.
    pub log_level: String,
    /// JSON lines instead of human-readable logs.
    pub json: bool,
}

/// How an event PostgreSQL originates reaches the broker (docs/ARCHITECTURE.md#delivering-events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Delivery {
    /// The event's row is written in the business transaction; the relay sends it.
    Outbox,
    /// A RocketMQ transaction message: half message, the business transaction, then commit or
    /// rollback; the broker asks back (answered from PostgreSQL) when the end does not arrive.
    Transaction,
}

impl Delivery {
    pub fn label(self) -> &'static str {
        match self {
            Delivery::Outbox => "outbox",
            Delivery::Transaction => "transaction",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EventSettings {
    /// The delivery of every family that does not name its own.
    pub delivery: Delivery,
    /// ORDER_PAID, written by the payment notification.
    pub order_paid: Option<Delivery>,
    /// ORDER_CANCELED, written by the timeout cancel (its RELEASE_RESERVATION always goes
    /// through the outbox).
    pub order_canceled: Option<Delivery>,
    /// The longest a local transaction may run after its half message was stored: past it the
    /// transaction rolls back itself, which is what lets a check-back answer ROLLBACK. Must
    /// stay well below the broker's `transactionTimeout` (6000 ms in config/rocketmq).
    pub transaction_local_timeout_ms: u64,
    /// Transaction messages in flight at once per process (each holds a client thread while
    /// its local transaction runs); past it a payment waits for a slot.
    pub transaction_in_flight: usize,
    /// Check-backs answered at once per process.
    pub transaction_check_threads: u32,
    /// A row still TRANSACTION this long after it was written (its commit never reached the
    /// broker, and the broker gave up asking) is handed to the relay by `seckill reconcile`.
    pub transaction_horizon_secs: u64,
}

impl Default for EventSettings {
    fn default() -> Self {
        Self {
            delivery: Delivery::Outbox,
            order_paid: None,
            order_canceled: None,
            transaction_local_timeout_ms: 2_000,
            transaction_in_flight: 64,
            transaction_check_threads: 4,
            transaction_horizon_secs: 600,
        }
    }
}

impl EventSettings {
    pub fn order_paid(&self) -> Delivery {
        self.order_paid.unwrap_or(self.delivery)
    }
    pub fn order_canceled(&self) -> Delivery {
        self.order_canceled.unwrap_or(self.delivery)
    }
}

/// Topic and consumer-group names, derived from the environment name (docs/ARCHITECTURE.md#topics-and-groups).
#[derive(Debug, Clone)]
pub struct Names {
    pub order_create_topic: String,
    pub order_timeout_topic: String,
    pub order_event_topic: String,
    pub compensate_topic: String,
    pub order_create_group: String,
    pub compensate_group: String,
    pub timeout_group: String,
    pub projection_group: String,
    /// The group that records dead letters of every other group.
    pub dlq_intake_group: String,
    pub producer_group: String,
    /// The transaction producers' group: the broker asks any live member about a half
    /// message, so every API instance joins it.
    pub transaction_producer_group: String,
}

impl Names {
    /// The broker's dead-letter topic of a consumer group.
    pub fn dlq_topic(group: &str) -> String {
        format!("%DLQ%{group}")
    }

    /// `(consumer group, the topic it consumes)` of every group whose dead letters are kept.
    pub fn dead_letter_sources(&self) -> Vec<(String, String)> {
        vec![
            (
                self.order_create_group.clone(),
                self.order_create_topic.clone(),
            ),
            (self.compensate_group.clone(), self.compensate_topic.clone()),
            (self.timeout_group.clone(), self.order_timeout_topic.clone()),
            (
                self.projection_group.clone(),
                self.order_event_topic.clone(),
            ),
        ]
    }

    /// Groups keep their production names in `PROD` (`CG_SECKILL_ORDER_CREATE_PG_V1`); any
    /// other environment inserts its name (`CG_STAGE_SECKILL_...`) so it never joins PROD's group.
    pub fn new(env: &str) -> Self {
        let infix = if env == "PROD" {
            String::new()
        } else {
            format!("{env}_")
        };
        Self {
            order_create_topic: format!("{env}_SECKILL_ORDER_CREATE_V1"),
            order_timeout_topic: format!("{env}_SECKILL_ORDER_TIMEOUT_V1"),
            order_event_topic: format!("{env}_SECKILL_ORDER_EVENT_V1"),
            compensate_topic: format!("{env}_SECKILL_INVENTORY_COMPENSATE_V1"),
            order_create_group: format!("CG_{infix}SECKILL_ORDER_CREATE_PG_V1"),
            compensate_group: format!("CG_{infix}SECKILL_INVENTORY_COMPENSATE_V1"),
            timeout_group: format!("CG_{infix}SECKILL_ORDER_TIMEOUT_V1"),
            projection_group: format!("CG_{infix}SECKILL_ORDER_QUERY_PROJECTION_V1"),
            dlq_intake_group: format!("CG_{infix}SECKILL_DLQ_INTAKE_V1"),
            producer_group: format!("PG_{infix}SECKILL_PRODUCER_V1"),
            transaction_producer_group: format!("PG_{infix}SECKILL_TX_PRODUCER_V1"),
        }
    }
}

impl Settings {
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

    pub fn names(&self) -> Names {
        Names::new(&self.env)
    }

    /// Checks every value a role relies on; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_stores()?;
        self.validate_mq()?;
        self.validate_api_and_consumer()?;
        self.validate_trust()?;
        self.validate_events()?;
        self.validate_scan_and_retention()
    }

    /// `[events]`.
    fn validate_events(&self) -> Result<(), ConfigError> {
        let ev = &self.events;
        if !(100..=4_000).contains(&ev.transaction_local_timeout_ms) {
            return Err(invalid(
                "events.transaction_local_timeout_ms",
                "must be in 100..=4000 (below the broker's 6000 ms transactionTimeout)",
            ));
        }
        if ev.transaction_in_flight == 0 || ev.transaction_in_flight > 1_000 {
            return Err(invalid(
                "events.transaction_in_flight",
                "must be in 1..=1000",
            ));
        }
        if ev.transaction_check_threads == 0 || ev.transaction_check_threads > 64 {
            return Err(invalid(
                "events.transaction_check_threads",
                "must be in 1..=64",
            ));
        }
        // The broker asks for 6 s + 60 checks x 2 s (config/rocketmq/broker.toml) before it
        // gives up: a shorter horizon would send copies of events it is still deciding.
        if ev.transaction_horizon_secs < 180 {
            return Err(invalid(
                "events.transaction_horizon_secs",
                "must be at least 180 (the broker is still asking before that)",
            ));
        }
        Ok(())
    }

    /// `env`, `[pg]` and `[redis]`.
    fn validate_stores(&self) -> Result<(), ConfigError> {
        let ident = |s: &str| {
            !s.is_empty()
                && s.len() <= 32
                && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        };
        if !ident(&self.env) {
            return Err(invalid(
                "env",
                "must be 1-32 characters of A-Z, a-z, 0-9, _",
            ));
        }
        if self.pg.url.expose_secret().trim().is_empty() {
            return Err(invalid("pg.url", "must not be empty"));
        }
        if self
            .pg
            .url
            .expose_secret()
            .parse::<tokio_postgres::Config>()
            .is_err()
        {
            return Err(invalid(
                "pg.url",
                "is not a valid PostgreSQL connection string",
            ));
        }
        if !ident(&self.pg.schema) || self.pg.schema.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(invalid("pg.schema", "must be a plain identifier"));
        }
        if self.pg.safe_concurrency == 0 {
            return Err(invalid("pg.safe_concurrency", "must be at least 1"));
        }
        if !(self.pg.order_share > 0.0 && self.pg.order_share <= 1.0) {
            return Err(invalid("pg.order_share", "must be in (0, 1]"));
        }
        if !(self.pg.cancel_share > 0.0 && self.pg.cancel_share < 1.0) {
            return Err(invalid("pg.cancel_share", "must be in (0, 1)"));
        }
        if self.pg.order_share + self.pg.cancel_share > 1.0 {
            return Err(invalid(
                "pg.cancel_share",
                "pg.order_share + pg.cancel_share must not exceed 1",
            ));
        }
        if self.timeout.sweep_interval_ms == 0 {
            return Err(invalid("timeout.sweep_interval_ms", "must be positive"));
        }
        if self.pg.instances == 0 {
            return Err(invalid("pg.instances", "must be at least 1"));
        }
        if self.pg.statement_timeout_ms == 0 {
            return Err(invalid("pg.statement_timeout_ms", "must be positive"));
        }
        if self.pg.api_pool_size == 0 {
            return Err(invalid("pg.api_pool_size", "must be at least 1"));
        }
        if self.pg.pool_wait_timeout_ms == 0 {
            return Err(invalid("pg.pool_wait_timeout_ms", "must be positive"));
        }
        let redis_url = self.redis.url.expose_secret();
        let urls = self.redis.urls();
        if urls
            .iter()
            .any(|u| !u.starts_with("redis://") && !u.starts_with("rediss://"))
        {
            return Err(invalid(
                "redis.url",
                "must start with redis:// (or rediss:// for TLS)",
            ));
        }
        if urls.len() > 1 && self.redis.mode != RedisMode::Cluster {
            return Err(invalid(
                "redis.url",
                "lists several nodes: that is for redis.mode = \"cluster\"",
            ));
        }
        if urls.iter().any(|u| u.starts_with("rediss://")) != urls[0].starts_with("rediss://") {
            return Err(invalid("redis.url", "mixes redis:// and rediss:// nodes"));
        }
        if !self.redis.ca_file.is_empty() {
            if !redis_url.starts_with("rediss://") {
                return Err(invalid("redis.ca_file", "is for a rediss:// URL only"));
            }
            crate::tls::read_ca(&self.redis.ca_file, "redis.ca_file")?;
        }
        if !self.pg.ca_file.is_empty() {
            if self.pg.tls != PgTls::Verify {
                return Err(invalid("pg.ca_file", "is for pg.tls = \"verify\" only"));
            }
            crate::tls::read_ca(&self.pg.ca_file, "pg.ca_file")?;
        }
        if self.redis.key_prefix.is_empty() || self.redis.key_prefix.contains(['{', '}', ' ']) {
            return Err(invalid(
                "redis.key_prefix",
                "must be non-empty without braces or spaces",
            ));
        }
        if self.redis.pool_size == 0 {
            return Err(invalid("redis.pool_size", "must be at least 1"));
        }
        for (key, ms) in [
            ("redis.connect_timeout_ms", self.redis.connect_timeout_ms),
            ("redis.response_timeout_ms", self.redis.response_timeout_ms),
            (
                "redis.pool_wait_timeout_ms",
                self.redis.pool_wait_timeout_ms,
            ),
        ] {
            if ms == 0 || ms > 60_000 {
                return Err(invalid(key, "must be in 1..=60000"));
            }
        }
        Ok(())
    }

    /// `[auth]` and `[payments]`: development shortcuts never reach PROD.
    fn validate_trust(&self) -> Result<(), ConfigError> {
        let prod = self.env == "PROD";
        if prod && self.auth.buyers == BuyerIdentity::Body {
            return Err(invalid(
                "auth.buyers",
                "\"body\" believes any caller's user_id and is refused when env = \"PROD\"",
            ));
        }
        let dev = self.auth.dev_hs256_secret.expose_secret();
        if prod && !dev.is_empty() {
            return Err(invalid(
                "auth.dev_hs256_secret",
                "development tokens are refused when env = \"PROD\" (use auth.jwks_file)",
            ));
        }
        if !dev.is_empty() && dev.len() < 32 {
            return Err(invalid(
                "auth.dev_hs256_secret",
                "must be at least 32 bytes",
            ));
        }
        if self.auth.audience.is_empty() {
            return Err(invalid("auth.audience", "must not be empty"));
        }
        if self.auth.leeway_secs > 300 {
            return Err(invalid("auth.leeway_secs", "must be at most 300"));
        }
        if self
            .payments
            .webhook_secrets
            .iter()
            .any(|s| s.expose_secret().len() < 16)
        {
            return Err(invalid(
                "payments.webhook_secrets",
                "every secret must be at least 16 bytes",
            ));
        }
        if !(1..=3600).contains(&self.payments.tolerance_secs) {
            return Err(invalid("payments.tolerance_secs", "must be in 1..=3600"));
        }
        Ok(())
    }

    /// `[mq]`.
    fn validate_mq(&self) -> Result<(), ConfigError> {
        let servers: Vec<&str> = self.mq.name_servers().collect();
        if servers.is_empty() || !servers.iter().all(|s| is_host_port(s)) {
            return Err(invalid(
                "mq.name_server",
                "must be host:port (a name or an IP address; several: `a:9876;b:9876`)",
            ));
        }
        if !self.mq.broker_addrs().all(is_host_port) {
            return Err(invalid(
                "mq.broker_addr",
                "must be host:port, a name or an IP address (several: comma-separated)",
            ));
        }
        if self.mq.send_timeout_ms == 0 || self.mq.send_timeout_ms > 10_000 {
            return Err(invalid("mq.send_timeout_ms", "must be in 1..=10000"));
        }
        if self.mq.send_retries > 5 {
            return Err(invalid("mq.send_retries", "must be in 0..=5"));
        }
        if self.mq.send_batch_max == 0 || self.mq.send_batch_max > 256 {
            return Err(invalid("mq.send_batch_max", "must be in 1..=256"));
        }
        if self.mq.send_linger_us > 10_000 {
            return Err(invalid(
                "mq.send_linger_us",
                "must be at most 10000 (10 ms): every reservation may wait this long",
            ));
        }
        if self.mq.send_batches_in_flight == 0 || self.mq.send_batches_in_flight > 64 {
            return Err(invalid("mq.send_batches_in_flight", "must be in 1..=64"));
        }
        if self.mq.order_create_queues == 0 || self.mq.other_queues == 0 {
            return Err(invalid(
                "mq.order_create_queues",
                "queue counts must be positive",
            ));
        }
        Ok(())
    }

    /// `[api]` and `[consumer]`.
    fn validate_api_and_consumer(&self) -> Result<(), ConfigError> {
        if self.api.max_body_bytes < 64 {
            return Err(invalid("api.max_body_bytes", "must be at least 64"));
        }
        if self.api.max_inflight == 0 {
            return Err(invalid("api.max_inflight", "must be at least 1"));
        }
        if self.api.reservation_valid_secs == 0 {
            return Err(invalid("api.reservation_valid_secs", "must be positive"));
        }
        if !(self.api.fail_closed_share > 0.0 && self.api.fail_closed_share <= 1.0) {
            return Err(invalid("api.fail_closed_share", "must be in (0, 1]"));
        }
        if self.consumer.tx_timeout_ms < self.pg.statement_timeout_ms {
            return Err(invalid(
                "consumer.tx_timeout_ms",
                "must be at least pg.statement_timeout_ms",
            ));
        }
        if self.api.lag_unreadable_probes == 0 {
            return Err(invalid("api.lag_unreadable_probes", "must be at least 1"));
        }
        if self.api.sold_out_poll_ms > 10_000 {
            return Err(invalid(
                "api.sold_out_poll_ms",
                "must be at most 10000 (a free unit is refused that long)",
            ));
        }
        if self.api.resume_ramp_secs > 3600 {
            return Err(invalid("api.resume_ramp_secs", "must be at most 3600"));
        }
        if self.api.admission_check_ms == 0 {
            return Err(invalid("api.admission_check_ms", "must be positive"));
        }
        if self.api.resend_backoff_ms == 0 {
            return Err(invalid("api.resend_backoff_ms", "must be positive"));
        }
        if self.api.header_read_timeout_ms == 0 || self.api.header_read_timeout_ms > 60_000 {
            return Err(invalid(
                "api.header_read_timeout_ms",
                "must be in 1..=60000",
            ));
        }
        if self.api.request_timeout_ms == 0 || self.api.request_timeout_ms > 120_000 {
            return Err(invalid("api.request_timeout_ms", "must be in 1..=120000"));
        }
        if self.api.max_connections == 0 {
            return Err(invalid("api.max_connections", "must be at least 1"));
        }
        if self.api.drain_delay_ms >= self.api.shutdown_grace_secs * 1000 {
            return Err(invalid(
                "api.drain_delay_ms",
                "must be shorter than api.shutdown_grace_secs, which bounds the whole shutdown",
            ));
        }
        if self.api.write_timeout_ms == 0 || self.api.write_timeout_ms > 60_000 {
            return Err(invalid("api.write_timeout_ms", "must be in 1..=60000"));
        }
        let head = crate::http::MIN_HEAD_BYTES;
        if !(head..=65_536).contains(&self.api.max_head_bytes) {
            return Err(invalid(
                "api.max_head_bytes",
                format!("must be in {head}..=65536"),
            ));
        }
        let admin = self.api.admin_token.expose_secret().len();
        if admin > 0 && admin < MIN_ADMIN_TOKEN_BYTES {
            return Err(invalid(
                "api.admin_token",
                format!(
                    "must be at least {MIN_ADMIN_TOKEN_BYTES} bytes (e.g. `openssl rand -hex 32`), \
                     or empty for no admin listener"
                ),
            ));
        }
        for (key, rate, burst) in [
            (
                "api.buyer_rate_per_sec",
                self.api.buyer_rate_per_sec,
                self.api.buyer_burst,
            ),
            (
                "api.address_rate_per_sec",
                self.api.address_rate_per_sec,
                self.api.address_burst,
            ),
        ] {
            if !(rate.is_finite() && rate >= 0.0) {
                return Err(invalid(key, "must be 0 (no limit) or positive"));
            }
            if rate > 0.0 && burst == 0 {
                return Err(invalid(key, "needs a burst of at least 1"));
            }
        }
        if self.consumer.batch_size == 0 || self.consumer.batch_size > 32 {
            return Err(invalid("consumer.batch_size", "must be in 1..=32"));
        }
        // Listener calls in flight (order-create at most 128 of the process's 160 slots, the
        // other groups 64 each) and messages per call (at most the client's 32).
        let c = &self.consumer;
        for (key, value, max) in [
            ("consumer.listener_calls", c.listener_calls, 128),
            ("consumer.compensate_workers", c.compensate_workers, 64),
            ("consumer.projection_workers", c.projection_workers, 64),
            ("consumer.dlq_intake_workers", c.dlq_intake_workers, 64),
            (
                "consumer.compensate_batch_size",
                c.compensate_batch_size,
                32,
            ),
            (
                "consumer.projection_batch_size",
                c.projection_batch_size,
                32,
            ),
        ] {
            if value == 0 || value > max {
                return Err(invalid(key, format!("must be in 1..={max}")));
            }
        }
        if self.consumer.gather_wait_ms > 1_000 {
            // The wait comes out of every order's reservation->order time (SLO 3 s).
            return Err(invalid("consumer.gather_wait_ms", "must be at most 1000"));
        }
        if self.consumer.pace_age_ms > 2_000 {
            // Held this long, an order still has the rest of its 3 s SLO to be created.
            return Err(invalid("consumer.pace_age_ms", "must be at most 2000"));
        }
        if self.consumer.tx_latency_target_ms == 0 {
            return Err(invalid("consumer.tx_latency_target_ms", "must be positive"));
        }
        if self.consumer.pool_wait_target_ms == 0 {
            return Err(invalid("consumer.pool_wait_target_ms", "must be positive"));
        }
        if self.consumer.max_reconsume_times < 0 {
            return Err(invalid(
                "consumer.max_reconsume_times",
                "must not be negative",
            ));
        }
        if self.consumer.pay_window_secs == 0 {
            return Err(invalid("consumer.pay_window_secs", "must be positive"));
        }
        Ok(())
    }

    /// `[scan]`, `[retention]` and `[telemetry]`.
    fn validate_scan_and_retention(&self) -> Result<(), ConfigError> {
        let sc = &self.scan;
        if sc.scanner_batch == 0 || sc.scanner_batch > 10_000 {
            return Err(invalid("scan.scanner_batch", "must be in 1..=10000"));
        }
        if sc.scanner_lease_ms < 100 {
            return Err(invalid("scan.scanner_lease_ms", "must be at least 100"));
        }
        if sc.scanner_poll_ms == 0 || sc.relay_poll_ms == 0 {
            return Err(invalid(
                "scan.scanner_poll_ms",
                "poll intervals must be positive",
            ));
        }
        if sc.resend_backoff_cap_ms < self.api.resend_backoff_ms {
            return Err(invalid(
                "scan.resend_backoff_cap_ms",
                "must be >= api.resend_backoff_ms",
            ));
        }
        if sc.settle_grace_ms > 3_600_000 {
            return Err(invalid(
                "scan.settle_grace_ms",
                "must be at most 3600000 (an hour): the unit is held that long",
            ));
        }
        if sc.unconsumed_resend_ms > 0
            && (sc.unconsumed_resend_ms < 1_000
                || sc.unconsumed_resend_ms >= self.api.reservation_valid_secs * 1_000)
        {
            // Shorter than a commit would send copies of messages still in a transaction;
            // longer than the validity, and the reservation expires first.
            return Err(invalid(
                "scan.unconsumed_resend_ms",
                "must be 0 (off), or at least 1000 and below api.reservation_valid_secs",
            ));
        }
        if sc.timer_lead_secs < 10 {
            // The broker's timer wheel delivers seconds late (BENCHMARKS.md), and a send may
            // need a retry: a lead shorter than that would make every timer late.
            return Err(invalid("scan.timer_lead_secs", "must be at least 10"));
        }
        if sc.relay_batch == 0 || sc.relay_batch > 10_000 {
            return Err(invalid("scan.relay_batch", "must be in 1..=10000"));
        }
        if sc.relay_lease_secs == 0 {
            return Err(invalid("scan.relay_lease_secs", "must be positive"));
        }
        if sc.relay_max_attempts < 1 {
            return Err(invalid("scan.relay_max_attempts", "must be at least 1"));
        }
        if sc.relay_backoff_base_ms == 0 || sc.relay_backoff_cap_ms < sc.relay_backoff_base_ms {
            return Err(invalid(
                "scan.relay_backoff_cap_ms",
                "must be >= scan.relay_backoff_base_ms > 0",
            ));
        }
        if sc.send_concurrency == 0 {
            return Err(invalid("scan.send_concurrency", "must be at least 1"));
        }
        let rt = &self.retention;
        for (key, days) in [
            ("retention.inbox_days", rt.inbox_days),
            ("retention.outbox_days", rt.outbox_days),
            ("retention.quarantine_days", rt.quarantine_days),
            ("retention.dlq_days", rt.dlq_days),
        ] {
            if !(days.is_finite() && days > 0.0 && days <= 36_500.0) {
                return Err(invalid(key, "must be a positive number of days"));
            }
        }
        if rt.batch <= 0 || rt.batch > 100_000 {
            return Err(invalid("retention.batch", "must be in 1..=100000"));
        }
        if rt.interval_secs == 0 {
            return Err(invalid("retention.interval_secs", "must be positive"));
        }
        if tracing_subscriber::EnvFilter::try_new(&self.telemetry.log_level).is_err() {
            return Err(invalid(
                "telemetry.log_level",
                "is not a valid filter directive",
            ));
        }
        Ok(())
    }

    /// The worker budget (docs/ARCHITECTURE.md#worker-budget):
    /// Timeout-cancel transactions one `timeout-cancel` process runs at once:
    /// `safe_concurrency × cancel_share / instances`, at least 1.
    pub fn cancel_budget(&self) -> usize {
        worker_budget(
            self.pg.safe_concurrency,
            self.pg.cancel_share,
            self.pg.instances,
        )
    }

    /// `safe_concurrency × order_share / instances`, at least 1.
    pub fn worker_budget(&self) -> usize {
        worker_budget(
            self.pg.safe_concurrency,
            self.pg.order_share,
            self.pg.instances,
        )
    }
}

/// `budget = pg_safe_concurrency × order_share / instances` (e.g. 240 × 0.7 / 12 = 14), floor, ≥ 1.
pub fn worker_budget(safe_concurrency: u32, order_share: f64, instances: u32) -> usize {
    let raw = f64::from(safe_concurrency) * order_share / f64::from(instances.max(1));
    (raw.floor() as usize).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_servers_are_names_or_addresses_one_or_several() {
        assert!(is_host_port("127.0.0.1:9876"));
        assert!(is_host_port("[::1]:9876"));
        assert!(is_host_port("namesrv.internal:9876"));
        assert!(is_host_port("namesrv-a:9876"));
        for bad in [
            "namesrv", "namesrv:", ":9876", "a b:9876", "-a:9876", "host:0", "h:99999",
        ] {
            assert!(!is_host_port(bad), "{bad}");
        }
        let mq = |v: &str| MqSettings {
            name_server: v.into(),
            ..test_mq()
        };
        assert_eq!(mq("a:9876").name_server_list(), "a:9876");
        assert_eq!(mq("a:9876; b:9877").name_server_list(), "a:9876;b:9877");
        assert_eq!(mq("a:9876,b:9877,").name_server_list(), "a:9876;b:9877");
    }

    fn test_mq() -> MqSettings {
        Settings::load_from(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("config")
                .as_path(),
        )
        .unwrap()
        .mq
    }

    #[test]
    fn budget_matches_the_documented_example() {
        assert_eq!(worker_budget(240, 0.7, 12), 14);
        assert_eq!(worker_budget(8, 0.7, 1), 5);
        assert_eq!(worker_budget(1, 0.1, 4), 1);
    }

    #[test]
    fn names_carry_the_environment_prefix() {
        let n = Names::new("PROD");
        assert_eq!(n.order_create_topic, "PROD_SECKILL_ORDER_CREATE_V1");
        assert_eq!(n.order_create_group, "CG_SECKILL_ORDER_CREATE_PG_V1");
        assert_eq!(
            Names::new("T1").order_create_group,
            "CG_T1_SECKILL_ORDER_CREATE_PG_V1"
        );
    }
}
