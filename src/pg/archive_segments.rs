//! `archive_segments`: the catalogue of the archive's segments whose rows left PostgreSQL
//! (docs/architecture/postgresql.md#the-archive).

use tokio_postgres::GenericClient;

use crate::archive::Manifest;

/// Records a segment, in the transaction that takes its rows out.
pub async fn insert(
    client: &impl GenericClient,
    m: &Manifest,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "INSERT INTO archive_segments
               (segment_id, table_name, path, row_count, bytes, sha256, oldest_at, newest_at, source)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            &[
                &m.segment_id,
                &m.table,
                &m.data_path().to_string_lossy().as_ref(),
                &(m.rows as i64),
                &(m.bytes as i64),
                &m.sha256,
                &m.oldest_at,
                &m.newest_at,
                &m.source,
            ],
        )
        .await
        .map(|_| ())
}

/// A committed segment as the catalogue knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Committed {
    pub segment_id: String,
    pub table: String,
    pub rows: i64,
    pub sha256: String,
}

/// Every committed segment (of one table if given).
pub async fn list(
    client: &impl GenericClient,
    table: Option<&str>,
) -> Result<Vec<Committed>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT segment_id, table_name, row_count, sha256 FROM archive_segments
             WHERE $1::text IS NULL OR table_name = $1 ORDER BY oldest_at, segment_id",
            &[&table],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Committed {
            segment_id: r.get(0),
            table: r.get(1),
            rows: r.get(2),
            sha256: r.get(3),
        })
        .collect())
}

/// The schema's migration version, written into each manifest (0 for a schema made without
/// `seckill migrate`'s history table).
pub async fn schema_version(client: &impl GenericClient) -> Result<i32, tokio_postgres::Error> {
    let history: bool = client
        .query_one(
            "SELECT to_regclass('seckill_schema_history') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    if !history {
        return Ok(0);
    }
    Ok(client
        .query_one(
            "SELECT COALESCE(max(version), 0) FROM seckill_schema_history",
            &[],
        )
        .await?
        .get(0))
}
