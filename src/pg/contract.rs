//! The contract step of V25 (docs/architecture/postgresql.md#tables-by-day): once every instance
//! runs a release that reads and writes only the by-day inbox and outbox, the unpartitioned
//! `consumer_inbox` and `event_outbox` and the triggers mirroring them go, and with them the
//! price of writing every inbox and outbox row twice. Refused while PostgreSQL holds a session
//! of an older release, which would still read or write them.

use tokio_postgres::GenericClient;

/// What the step drops (also run by bench/limits/schema.sql, so pgbench's baseline writes what a
/// contracted deployment writes).
const CONTRACT_SQL: &str = include_str!("contract.sql");

/// The first schema whose releases read and write only the by-day tables.
pub const BY_DAY_SINCE: u32 = 25;

/// Why the contract did not run.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    #[error(
        "an older release is still connected ({}): it reads and writes consumer_inbox and \
         event_outbox; upgrade every instance first (--force to drop them anyway)",
        .0.iter().map(|(n, c)| format!("{n} x{c}")).collect::<Vec<_>>().join(", ")
    )]
    OlderReleaseConnected(Vec<(String, i64)>),
    #[error("the by-day tables are missing: run `seckill migrate` first")]
    NotExpanded,
    #[error(transparent)]
    Pg(#[from] tokio_postgres::Error),
}

/// What the contract did.
#[derive(Debug, PartialEq, Eq)]
pub enum Contracted {
    /// The old tables and their mirrors were dropped; `differed`: rows that were not the same in
    /// both tables of a pair (0 unless retention dropped a day or an older release deleted
    /// rows).
    Dropped { differed: i64 },
    /// Nothing left to drop.
    AlreadyDone,
}

/// Whether a session named `application_name` belongs to a release that may still use the
/// unpartitioned tables: seckill's name without a schema tag (`seckill`, `seckill-<part>@<env>`,
/// as releases before V25 name theirs) or tagged below [`BY_DAY_SINCE`]
/// (`crate::pg::name_connections`).
pub fn is_older_release(application_name: &str) -> bool {
    let ours = application_name == "seckill"
        || application_name.starts_with("seckill-")
        || application_name.starts_with("seckill~");
    if !ours {
        return false;
    }
    match application_name.rsplit_once("~s") {
        Some((_, v)) => v.parse::<u32>().map_or(true, |v| v < BY_DAY_SINCE),
        None => true,
    }
}

/// Sessions of older releases connected to this database now, by `application_name`.
pub async fn older_sessions(
    client: &impl GenericClient,
) -> Result<Vec<(String, i64)>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT application_name, count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()
               AND application_name LIKE 'seckill%'
             GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
        .filter(|(name, _)| is_older_release(name))
        .collect())
}

/// Drops the old tables and their mirrors in one transaction, audited; refused while an older
/// release is connected unless `force`.
pub async fn run(
    client: &mut tokio_postgres::Client,
    actor: &str,
    force: bool,
) -> Result<Contracted, ContractError> {
    let exists = |t: &str| format!("to_regclass('{t}') IS NOT NULL");
    let row = client
        .query_one(
            &format!(
                "SELECT {}, {}, {} AND {}",
                exists("consumer_inbox"),
                exists("event_outbox"),
                exists("consumer_inbox_by_day"),
                exists("event_outbox_by_day")
            ),
            &[],
        )
        .await?;
    let (inbox, outbox, by_day): (bool, bool, bool) = (row.get(0), row.get(1), row.get(2));
    if !by_day {
        return Err(ContractError::NotExpanded);
    }
    if !inbox && !outbox {
        return Ok(Contracted::AlreadyDone);
    }
    let older = older_sessions(&*client).await?;
    if !older.is_empty() && !force {
        return Err(ContractError::OlderReleaseConnected(older));
    }
    let tx = client.transaction().await?;
    // Waiting on a writer's lock would hold every writer of the tables behind this one.
    tx.batch_execute("SET LOCAL lock_timeout = '5s'").await?;
    let differed: i64 = tx
        .query_one("SELECT seckill_twins_differ()", &[])
        .await?
        .get(0);
    tx.batch_execute(CONTRACT_SQL).await?;
    let detail = serde_json::json!({
        "differed": differed,
        "older_sessions": older.iter().map(|(n, c)| format!("{n} x{c}")).collect::<Vec<_>>(),
        "forced": force,
    });
    crate::pg::audit::record(
        &tx,
        actor,
        "schema_contract",
        "consumer_inbox,event_outbox",
        &detail,
    )
    .await?;
    tx.commit().await?;
    Ok(Contracted::Dropped { differed })
}

#[cfg(test)]
mod tests {
    use super::is_older_release;

    #[test]
    fn sessions_without_this_releases_tag_are_older() {
        for older in [
            "seckill",
            "seckill-consume@PROD",
            "seckill-api@T~s24",
            "seckill~s3",
        ] {
            assert!(is_older_release(older), "{older}");
        }
        for ours_or_others in [
            "seckill-consume@PROD~s25",
            "seckill~s26",
            "psql",
            "pgbench",
            "",
        ] {
            assert!(!is_older_release(ours_or_others), "{ours_or_others}");
        }
    }
}
