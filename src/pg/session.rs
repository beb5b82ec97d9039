//! A connection's session: the settings every connection runs with, and the check that the
//! session outlives a transaction, which the roles rely on.
//!
//! The settings (`search_path`, `statement_timeout`, `plan_cache_mode`) are set by one batch
//! of `SET` statements as a connection opens, not by the startup packet's `options`: PgBouncer
//! refuses that parameter (`unsupported startup parameter: options`), and through a pooler in
//! session mode a `SET` holds for the client's whole session as it does on a direct connection.
//!
//! What needs the session to outlive a transaction: prepared statements cached per connection
//! (the order, cancel and inbox statements), the relay's `LISTEN`, the resync's advisory lock,
//! the retention pass's `SET statement_timeout`. A pooler in transaction or statement mode
//! (PgBouncer's `pool_mode = transaction`) hands each transaction to whichever server is free,
//! so all of those would break, some silently; [`check_pool`] and [`check_one`] refuse such a
//! pooler as a process opens its first connections
//! (docs/RUNNING.md#pgbouncer).

use std::future::Future;
use std::task::Poll;

use anyhow::{anyhow, bail, Context as _};

use super::{PlanCache, TlsStream};

/// A connection's driving half, as this crate opens them.
type Connection = tokio_postgres::Connection<tokio_postgres::Socket, TlsStream>;
use crate::config::PgSettings;

/// The statements a connection runs once it opens, before anything else.
pub(super) fn setup_sql(settings: &PgSettings, plans: PlanCache) -> String {
    let mode = match plans {
        PlanCache::Custom => "force_custom_plan",
        PlanCache::Reuse => "auto",
    };
    // The schema is a plain identifier (`pg.schema` is validated as one).
    format!(
        "SET search_path = {}; SET statement_timeout = {}; SET plan_cache_mode = {mode}",
        settings.schema, settings.statement_timeout_ms
    )
}

/// Runs `work` on a connection's client while driving the connection itself, for a connection
/// that is handed to its caller undriven ([`super::connect_one`]): notices are dropped.
pub(super) async fn drive_while<T, E: Into<anyhow::Error>>(
    conn: &mut tokio_postgres::Connection<tokio_postgres::Socket, TlsStream>,
    work: impl Future<Output = Result<T, E>>,
) -> anyhow::Result<T> {
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = work.as_mut().poll(cx) {
            return Poll::Ready(r.map_err(Into::into));
        }
        loop {
            match conn.poll_message(cx) {
                Poll::Ready(Some(Ok(_))) => continue,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e.into())),
                Poll::Ready(None) => return Poll::Ready(Err(anyhow!("the connection closed"))),
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await
}

/// The server process behind a client right now (simple protocol: one message, so a pooler
/// cannot split it across servers).
async fn backend_pid(client: &tokio_postgres::Client) -> anyhow::Result<String> {
    let rows = client.simple_query("SELECT pg_backend_pid()").await?;
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .context("SELECT pg_backend_pid() returned no row")
}

/// Set once this process has seen its connections keep their session: the check runs once.
static KEPT: std::sync::OnceLock<()> = std::sync::OnceLock::new();

/// Refuses a pool whose connections do not keep one server session across transactions
/// ([`probe`] on two of its connections), unless this process checked already; a pool of one
/// connection borrows a second, short-lived one that `second` opens.
pub(super) async fn check_pool(
    pool: &deadpool_postgres::Pool,
    second: impl std::future::Future<Output = anyhow::Result<(tokio_postgres::Client, Connection)>>,
    endpoint: &str,
) -> anyhow::Result<()> {
    let unanswered = || format!("pg.url: PostgreSQL at {endpoint} does not answer");
    let a = pool.get().await.with_context(unanswered)?;
    if KEPT.get().is_some() {
        a.simple_query("SELECT 1").await.with_context(unanswered)?;
        return Ok(());
    }
    if pool.status().max_size >= 2 {
        let b = pool.get().await.with_context(unanswered)?;
        probe(&a, &b, endpoint).await?;
    } else {
        let (b, conn) = second.await?;
        let driver = tokio::spawn(conn);
        let checked = probe(&a, &b, endpoint).await;
        driver.abort();
        checked?;
    }
    let _ = KEPT.set(());
    Ok(())
}

/// [`check_pool`] for a connection handed out undriven ([`super::connect_one`]), with a second,
/// short-lived one that `second` opens (awaited only while no probe has passed yet).
pub(super) async fn check_one(
    client: &tokio_postgres::Client,
    conn: &mut Connection,
    second: impl std::future::Future<Output = anyhow::Result<(tokio_postgres::Client, Connection)>>,
    endpoint: &str,
) -> anyhow::Result<()> {
    if KEPT.get().is_some() {
        return Ok(());
    }
    let (b, b_conn) = second.await?;
    let driver = tokio::spawn(b_conn);
    let checked = drive_while(conn, probe(client, &b, endpoint)).await;
    driver.abort();
    checked?;
    let _ = KEPT.set(());
    Ok(())
}

/// Whether two connections, A and B, each keep one server session across transactions.
///
/// A asks which server it is on; B opens a transaction and asks the same; A asks again. On a
/// direct connection, or through a pooler in session mode, A stays on its server and B can
/// never be on it. In transaction mode the pooler gives B's transaction the idle server A just
/// used (PgBouncer reuses the most recently released one), and A's next statement goes
/// elsewhere. In statement mode B's transaction is refused.
async fn probe(
    a: &tokio_postgres::Client,
    b: &tokio_postgres::Client,
    endpoint: &str,
) -> anyhow::Result<()> {
    let unanswered = || format!("pg.url: PostgreSQL at {endpoint} does not answer");
    let a_before = backend_pid(a).await.with_context(unanswered)?;
    let in_tx = async {
        b.batch_execute("BEGIN").await?;
        let pid = backend_pid(b).await;
        b.batch_execute("COMMIT").await?;
        pid
    };
    let b_in_tx = in_tx.await.map_err(|e| {
        anyhow!(
            "pg.url: a transaction through {endpoint} failed ({e:#}): a pooler in statement \
             mode? seckill needs session pooling (docs/RUNNING.md#pgbouncer)"
        )
    })?;
    let a_after = backend_pid(a).await.with_context(unanswered)?;
    if a_before != a_after || b_in_tx == a_before {
        bail!(
            "pg.url: connections through {endpoint} do not keep their server session between \
             transactions (one moved from backend {a_before} to {a_after}; another's \
             transaction ran on {b_in_tx}): a pooler in transaction mode (PgBouncer \
             pool_mode = transaction) is in front. seckill needs session pooling: its prepared \
             statements, LISTEN, advisory locks and SET outlive a transaction \
             (docs/RUNNING.md#pgbouncer)"
        );
    }
    Ok(())
}
