//! The archive (docs/architecture/postgresql.md#the-archive): rows retention takes out of
//! PostgreSQL, written first as segments a data team or `seckill archive` can read back.
//!
//! Layout, object-store shaped, under `retention.archive_dir`:
//! `<env>/<table>/dt=<YYYY-MM-DD>/<segment_id>.jsonl.zst` (one row per line, each the row's
//! `to_jsonb`, zstd-compressed) beside `<segment_id>.manifest.json` (what the segment holds,
//! with the SHA-256 of the compressed file and of its lines). `dt` is the day of the segment's
//! oldest row. The data file is written and synced before its manifest, the manifest before the
//! rows leave PostgreSQL, whose `archive_segments` row commits in the same transaction as the
//! rows' DELETE (or the partition's DROP): a segment with no catalogue row was written by a
//! pass that did not commit, and its rows are still in the table (`archive verify` says so).

pub mod read;

use std::io::Write;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The one format written: JSON Lines, zstd-compressed.
pub const FORMAT: &str = "jsonl.zst";

/// What a segment holds, written beside it and into `archive_segments`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub segment_id: String,
    /// The table the rows came from.
    pub table: String,
    pub env: String,
    pub format: String,
    pub rows: u64,
    /// Size of the compressed file.
    pub bytes: u64,
    /// SHA-256 of the compressed file, hex.
    pub sha256: String,
    /// SHA-256 of the uncompressed lines, hex: what a reader who decompressed them can check.
    pub content_sha256: String,
    /// The column that dated the rows, and the span it covers.
    pub time_column: String,
    pub oldest_at: Option<DateTime<Utc>>,
    pub newest_at: Option<DateTime<Utc>>,
    /// How the rows left PostgreSQL: `DELETE` (a retention batch) or `DROP <partition>`.
    pub source: String,
    /// The schema's migration version when written.
    pub schema_version: i32,
    pub created_at: DateTime<Utc>,
}

impl Manifest {
    /// The data file's path relative to the archive's environment root.
    pub fn data_path(&self) -> PathBuf {
        self.dir().join(format!("{}.{FORMAT}", self.segment_id))
    }

    fn manifest_path(&self) -> PathBuf {
        self.dir()
            .join(format!("{}.manifest.json", self.segment_id))
    }

    fn dir(&self) -> PathBuf {
        let day = self.oldest_at.unwrap_or(self.created_at).format("%Y-%m-%d");
        PathBuf::from(&self.table).join(format!("dt={day}"))
    }
}

/// Rows on their way to a segment: each row's JSON and its time.
pub struct Batch {
    pub table: String,
    pub time_column: String,
    pub source: String,
    pub schema_version: i32,
    pub rows: Vec<(serde_json::Value, Option<DateTime<Utc>>)>,
}

/// One environment's archive: `<retention.archive_dir>/<env>`.
#[derive(Debug, Clone)]
pub struct Archive {
    root: PathBuf,
    env: String,
}

impl Archive {
    pub fn new(dir: impl AsRef<Path>, env: &str) -> Self {
        Self {
            root: dir.as_ref().join(env),
            env: env.to_string(),
        }
    }

    /// The archive of a deployment's settings.
    pub fn of(settings: &crate::config::Settings) -> Self {
        Self::new(&settings.retention.archive_dir, &settings.env)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// [`Archive::write`] off the async threads.
    pub async fn write_async(&self, batch: Batch) -> std::io::Result<Manifest> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.write(&batch))
            .await
            .map_err(std::io::Error::other)?
    }

    /// Writes `batch` as one segment: data synced, then its manifest synced, then their
    /// directory. Blocking file I/O: call it from `spawn_blocking` in a server.
    pub fn write(&self, batch: &Batch) -> std::io::Result<Manifest> {
        let mut lines = Vec::new();
        for (row, _) in &batch.rows {
            serde_json::to_writer(&mut lines, row)?;
            lines.push(b'\n');
        }
        let compressed = zstd::encode_all(&lines[..], 3)?;
        let times = batch.rows.iter().filter_map(|(_, t)| *t);
        let manifest = Manifest {
            segment_id: format!("seg_{}", ulid::Ulid::new()),
            table: batch.table.clone(),
            env: self.env.clone(),
            format: FORMAT.to_string(),
            rows: batch.rows.len() as u64,
            bytes: compressed.len() as u64,
            sha256: hex::encode(Sha256::digest(&compressed)),
            content_sha256: hex::encode(Sha256::digest(&lines)),
            time_column: batch.time_column.clone(),
            oldest_at: times.clone().min(),
            newest_at: times.max(),
            source: batch.source.clone(),
            schema_version: batch.schema_version,
            created_at: Utc::now(),
        };
        let dir = self.root.join(manifest.dir());
        std::fs::create_dir_all(&dir)?;
        write_synced(&self.root.join(manifest.data_path()), &compressed)?;
        let json = serde_json::to_vec_pretty(&manifest)?;
        write_synced(&self.root.join(manifest.manifest_path()), &json)?;
        std::fs::File::open(&dir)?.sync_all()?;
        Ok(manifest)
    }
}

/// Writes `bytes` to `path` through a temporary name, synced before the rename: a reader never
/// sees half a file under the final name.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_reads_back_as_written_and_a_changed_byte_is_caught() {
        let dir = std::env::temp_dir().join(format!("seckill-archive-{}", ulid::Ulid::new()));
        let archive = Archive::new(&dir, "UNIT");
        let at = |s: &str| Some(s.parse::<DateTime<Utc>>().unwrap());
        let rows = vec![
            (serde_json::json!({"id": 1}), at("2026-01-02T10:00:00Z")),
            (serde_json::json!({"id": 2}), at("2026-01-01T23:00:00Z")),
        ];
        let m = archive
            .write(&Batch {
                table: "consumer_inbox".into(),
                time_column: "received_at".into(),
                source: "DELETE".into(),
                schema_version: 24,
                rows,
            })
            .unwrap();
        assert_eq!(m.rows, 2);
        assert_eq!(
            m.data_path().parent().unwrap(),
            Path::new("consumer_inbox/dt=2026-01-01")
        );
        let listed = archive.list(Some("consumer_inbox")).unwrap();
        assert_eq!(listed, vec![m.clone()]);
        let back = archive.read(&m).unwrap();
        assert_eq!(back[1]["id"], 2);

        let path = archive.root().join(m.data_path());
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert!(matches!(
            archive.read(&m),
            Err(read::Problem::Checksum { .. })
        ));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
