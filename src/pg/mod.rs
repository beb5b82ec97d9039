//! PostgreSQL: pools, migrations, and the transactions that make the source of truth.

pub mod archive_segments;
pub mod audit;
pub mod audit_stream;
pub mod books;
pub mod cancel_tx;
pub mod contract;
pub mod dlq;
pub mod dlq_tickets;
pub mod errors;
pub mod fences;
pub mod half_message_events;
pub mod order_state;
pub mod order_tx;
pub mod outbox;
pub mod partitions;
pub mod passes;
pub mod primary;
pub mod quarantine;
pub mod queries;
pub mod reconcile;
pub mod refunds;
pub mod replay;
pub mod replay_batches;
pub mod retention;
pub mod rows;
mod session;
pub(crate) mod statements;
pub mod table_sizes;

use std::time::Duration;

use anyhow::Context as _;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres_rustls::MakeRustlsConnect;

use secrecy::ExposeSecret;

use crate::config::{PgSettings, PgTls};

/// Where a configuration points, for messages: hosts and ports only, never the user or the
/// password the connection string may hold.
pub fn endpoint(cfg: &tokio_postgres::Config) -> String {
    let ports = cfg.get_ports();
    cfg.get_hosts()
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let host = match h {
                tokio_postgres::config::Host::Tcp(h) => h.clone(),
                #[cfg(unix)]
                tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
            };
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            format!("{host}:{port}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

mod embedded {
    refinery::embed_migrations!("sql");
}

/// `application_name` of this process's connections ([`name_connections`]).
static APPLICATION_NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The newest migration this binary carries: the schema it reads and writes.
pub fn schema_version() -> u32 {
    static NEWEST: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *NEWEST.get_or_init(|| {
        embedded::migrations::runner()
            .get_migrations()
            .iter()
            .map(|m| m.version())
            .max()
            .unwrap_or(0)
    })
}

/// Names every connection this process opens from now on `seckill-<part>@<env>~s<schema>`
/// (`part`: the role, or `ops`; `schema`: [`schema_version`]), so `pg_stat_activity` shows which
/// part of the fleet holds it (docs/architecture/order-creation.md#connection-budget) and which
/// release, for `seckill migrate --contract` (docs/architecture/postgresql.md#tables-by-day). The
/// first call wins; before it, `seckill~s<schema>`.
pub fn name_connections(part: &str, env: &str) {
    let _ = APPLICATION_NAME.set(format!("seckill-{part}@{env}~s{}", schema_version()));
}

fn application_name() -> String {
    APPLICATION_NAME
        .get()
        .cloned()
        .unwrap_or_else(|| format!("seckill~s{}", schema_version()))
}

/// Whether a pool's connections reuse the plans of their prepared statements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanCache {
    /// Every run of a statement is planned with its parameters (`force_custom_plan`): right
    /// whatever the tables' statistics say, at the planner's price on every run.
    Custom,
    /// PostgreSQL's own choice (`auto`): a prepared statement's generic plan is reused after
    /// five runs, foreign-key checks' plans too. Only for a pool whose repeated statements
    /// have one sensible plan whatever the statistics (the order transaction's hot path,
    /// docs/architecture/order-creation.md#planning-once); a statement that searches a growing
    /// table is sent unnamed there ([`Sql::PerRun`]), so it is planned with its parameters every
    /// time.
    Reuse,
}

/// The connection config of every pool and connection. Each connection then sets its session
/// ([`session::setup_sql`], run as it opens): search_path to the configured schema and a
/// statement timeout, so a stuck lock turns into a retryable error instead of a hung worker.
///
/// `plan_cache_mode` is [`PlanCache::Custom`] unless a pool asks otherwise: the hot statements
/// are prepared once per connection; left to itself PostgreSQL switches to a generic plan
/// after five runs, and one made while the inbox was nearly empty (a fresh deployment, the
/// first seconds of a sale) scans the whole inbox on every batch until the next ANALYZE. Seen
/// with `pgbench -M prepared` running the same statements on a fresh schema
/// (bench/limits/limits.sh): the batched transaction fell from 140 to 60 a second within 8 s.
pub fn pg_config(settings: &PgSettings) -> anyhow::Result<tokio_postgres::Config> {
    let mut cfg: tokio_postgres::Config = settings
        .url
        .expose_secret()
        .parse()
        .context("pg.url: not a valid PostgreSQL connection string")?;
    cfg.application_name(application_name());
    // `pg.tls` decides, whatever the URL says.
    cfg.ssl_mode(match settings.tls {
        PgTls::Off => tokio_postgres::config::SslMode::Disable,
        PgTls::Verify => tokio_postgres::config::SslMode::Require,
    });
    cfg.connect_timeout(Duration::from_secs(5));
    // A server or network that goes silent mid-statement: the kernel gives up on the
    // connection after PG_TCP_USER_TIMEOUT of unacknowledged data, and keepalives find a
    // dead idle one, so a call fails (transient: rolled back, redelivered) instead of hanging.
    cfg.keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(2))
        .keepalives_retries(3)
        .tcp_user_timeout(PG_TCP_USER_TIMEOUT);
    Ok(cfg)
}

/// The TLS connector of every PostgreSQL connection: rustls trusting `pg.ca_file` (or the
/// system's roots). With `pg.tls = "off"` the connection asks for no TLS and it is unused.
pub fn connector(settings: &PgSettings) -> anyhow::Result<MakeRustlsConnect> {
    let config = match settings.tls {
        PgTls::Off => {
            crate::tls::install_crypto_provider();
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::aws_lc_rs::default_provider(),
            ))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth()
        }
        PgTls::Verify => crate::tls::client_config(&settings.ca_file, "pg.ca_file")?,
    };
    Ok(MakeRustlsConnect::new(config))
}

/// The stream of a connection made with [`connector`].
pub type TlsStream =
    <MakeRustlsConnect as tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>>::Stream;

/// Connects one client outside a pool (migrations, operator tools, the relay's LISTEN).
pub async fn connect_one(
    settings: &PgSettings,
) -> anyhow::Result<(
    tokio_postgres::Client,
    tokio_postgres::Connection<tokio_postgres::Socket, TlsStream>,
)> {
    let cfg = pg_config(settings)?;
    let (client, mut conn) = cfg
        .connect(connector(settings)?)
        .await
        .with_context(|| format!("pg.url: cannot connect to {}", endpoint(&cfg)))?;
    let setup = session::setup_sql(settings, PlanCache::Custom);
    session::drive_while(&mut conn, client.batch_execute(&setup))
        .await
        .with_context(|| format!("pg: setting up a session at {}", endpoint(&cfg)))?;
    let shown = endpoint(&cfg);
    session::check_one(&client, &mut conn, connect_bare(settings, &shown), &shown).await?;
    Ok((client, conn))
}

/// A connection with no session set up: the session probe's second client
/// ([`session::check_pool`]).
async fn connect_bare(
    settings: &PgSettings,
    endpoint: &str,
) -> anyhow::Result<(
    tokio_postgres::Client,
    tokio_postgres::Connection<tokio_postgres::Socket, TlsStream>,
)> {
    pg_config(settings)?
        .connect(connector(settings)?)
        .await
        .with_context(|| format!("pg.url: cannot connect to {endpoint}"))
}

/// How long sent data may stay unacknowledged by PostgreSQL before the connection is dropped
/// (well past any `statement_timeout`, which PostgreSQL enforces itself).
const PG_TCP_USER_TIMEOUT: Duration = Duration::from_secs(20);

/// Builds a pool of `size` connections and checks, before returning, that its connections
/// answer and keep their session between transactions ([`session::check_pool`]).
pub async fn connect_pool(settings: &PgSettings, size: usize) -> anyhow::Result<Pool> {
    connect_pool_with(settings, size, PlanCache::Custom).await
}

/// [`connect_pool`] whose connections plan as `plans` says.
pub async fn connect_pool_with(
    settings: &PgSettings,
    size: usize,
    plans: PlanCache,
) -> anyhow::Result<Pool> {
    let cfg = pg_config(settings)?;
    let shown = endpoint(&cfg);
    let setup = session::setup_sql(settings, plans);
    let mgr = Manager::from_config(
        cfg,
        connector(settings)?,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let wait = Duration::from_millis(settings.pool_wait_timeout_ms);
    // What this process may open, all pools together
    // (docs/architecture/order-creation.md#connection-budget).
    metrics::gauge!("pg_pool_capacity").increment(size.max(1) as f64);
    let pool = Pool::builder(mgr)
        .max_size(size.max(1))
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(wait))
        .create_timeout(Some(Duration::from_secs(5)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .post_create(deadpool_postgres::Hook::async_fn(move |client, _| {
            let setup = setup.clone();
            Box::pin(async move {
                client
                    .batch_execute(&setup)
                    .await
                    .map_err(deadpool_postgres::HookError::Backend)
            })
        }))
        .build()
        .context("pg: cannot build the pool")?;
    session::check_pool(&pool, connect_bare(settings, &shown), &shown).await?;
    Ok(pool)
}

/// Creates the schema when missing and applies the migrations in `sql/` (tracked by refinery).
/// Returns the versions applied by this run.
pub async fn migrate(settings: &PgSettings) -> anyhow::Result<Vec<u32>> {
    let (mut client, conn) = connect_one(settings).await?;
    let conn_task = tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS \"{}\"",
            settings.schema
        ))
        .await
        .context("creating the schema")?;
    let report = embedded::migrations::runner()
        .set_migration_table_name("seckill_schema_history")
        .run_async(&mut client)
        .await
        .context("applying migrations")?;
    drop(client);
    let _ = conn_task.await;
    Ok(report
        .applied_migrations()
        .iter()
        .map(|m| m.version())
        .collect())
}

/// [`migrate`], then, when this run created the schema (it applied V1), the contract steps of
/// its expands ([`contract`]): no older release can have used a schema made now, so a fresh
/// deployment never pays for mirrors kept for one. What `seckill migrate` and the benchmarks
/// run; the tests migrate without it, and their schemas keep the mirrors, which they exercise.
pub async fn migrate_contracting_new(settings: &PgSettings) -> anyhow::Result<Vec<u32>> {
    let applied = migrate(settings).await?;
    if applied.contains(&1) {
        let (mut client, conn) = connect_one(settings).await?;
        let conn = tokio::spawn(conn);
        let done = contract::run(&mut client, "migrate:new-schema", false).await;
        drop(client);
        let _ = conn.await;
        done.context("contracting a schema made now")?;
    }
    Ok(applied)
}

/// Bounds this session's statements at `secs` (a one-shot scan or a purge, not the hot path).
pub async fn set_statement_timeout(
    client: &impl tokio_postgres::GenericClient,
    secs: u64,
) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(&format!("SET statement_timeout = '{secs}s'"))
        .await
}

/// Gives this session back the pool's statement bound, `ms` (`pg.statement_timeout_ms`; a
/// `RESET` would give the server's default: the bound is set by a statement as the session
/// opens, [`session::setup_sql`]).
pub async fn reset_statement_timeout(
    client: &impl tokio_postgres::GenericClient,
    ms: u64,
) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(&format!("SET statement_timeout = {ms}"))
        .await
}

/// Keeps a message that can never be processed, with its raw body, for an operator.
pub async fn quarantine(
    client: &impl tokio_postgres::GenericClient,
    group: &str,
    d: &crate::mq::Delivery,
    reason: &str,
    error: &str,
) -> Result<u64, tokio_postgres::Error> {
    let mut rows = rows::QuarantineRows::default();
    rows.push(rows::Poison {
        message_id: d.properties.get("message_id").map(str::to_owned),
        broker_msg_id: d.broker_msg_id.clone(),
        reason: reason.to_owned(),
        error: error.to_owned(),
        body: d.body.clone(),
        properties: serde_json::to_value(&d.properties).unwrap_or_default(),
        delivery_attempt: d.reconsume_times,
    });
    rows.insert_with(client, group, &d.topic).await
}

/// The order facts of `order_id` from `r`: reservation, activity, SKU and user ids in the four
/// columns from `at`.
pub(crate) fn order_ref(
    order_id: String,
    r: &tokio_postgres::Row,
    at: usize,
) -> crate::domain::events::OrderRef {
    crate::domain::events::OrderRef {
        order_id,
        reservation_id: r.get(at),
        activity_id: r.get(at + 1),
        sku_id: r.get(at + 2),
        user_id: r.get(at + 3),
    }
}
