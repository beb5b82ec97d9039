//! `seckill archive list|verify|restore`: the segments retention wrote before taking rows out
//! of PostgreSQL (docs/architecture/postgresql.md#the-archive), read back.

use std::collections::HashMap;

use clap::{Args, Subcommand};

use crate::archive::{Archive, Manifest};
use crate::config::Settings;
use crate::pg::archive_segments::{self, Committed};

#[derive(Debug, Subcommand)]
pub enum ArchiveCommand {
    /// The segments, oldest rows first, and whether their rows left PostgreSQL.
    List(ListArgs),
    /// Every segment against its manifest (size, SHA-256 of the file and of its lines, rows)
    /// and against the catalogue; exits 1 on any problem.
    Verify(ListArgs),
    /// Rows of committed segments back into `restored_<table>` (made like the table, with its
    /// keys: a row restored twice is there once), for reading beside the live tables.
    Restore(RestoreArgs),
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only this table's segments.
    #[arg(long)]
    pub table: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// These segments (repeatable)...
    #[arg(long = "segment", required_unless_present = "table")]
    pub segments: Vec<String>,
    /// ...or every committed segment of this table.
    #[arg(long)]
    pub table: Option<String>,
}

pub async fn run(settings: Settings, command: ArchiveCommand) -> anyhow::Result<bool> {
    let pool = crate::pg::connect_pool(&settings.pg, 1).await?;
    let client = pool.get().await?;
    let archive = Archive::of(&settings);
    match command {
        ArchiveCommand::List(args) => {
            let (manifests, committed) = both(&archive, &client, args.table.as_deref()).await?;
            list(&manifests, &committed, args.json)?;
            Ok(true)
        }
        ArchiveCommand::Verify(args) => {
            let (manifests, committed) = both(&archive, &client, args.table.as_deref()).await?;
            Ok(verify(&archive, &manifests, &committed))
        }
        ArchiveCommand::Restore(args) => restore(&archive, &client, &args).await,
    }
}

/// The segments on disk and the catalogue's, keyed by segment id.
async fn both(
    archive: &Archive,
    client: &tokio_postgres::Client,
    table: Option<&str>,
) -> anyhow::Result<(Vec<Manifest>, HashMap<String, Committed>)> {
    let manifests = archive.list(table)?;
    let committed = archive_segments::list(client, table)
        .await?
        .into_iter()
        .map(|c| (c.segment_id.clone(), c))
        .collect();
    Ok((manifests, committed))
}

fn list(
    manifests: &[Manifest],
    committed: &HashMap<String, Committed>,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        let out: Vec<serde_json::Value> = manifests
            .iter()
            .map(|m| {
                let mut v = serde_json::to_value(m).unwrap_or_default();
                v["committed"] = committed.contains_key(&m.segment_id).into();
                v
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{:<30}  {:<22}  {:<10}  {:>8}  {:>10}  {:<9}  source",
        "segment", "table", "day", "rows", "bytes", "committed"
    );
    for m in manifests {
        let day = m.oldest_at.map(|t| t.format("%Y-%m-%d").to_string());
        println!(
            "{:<30}  {:<22}  {:<10}  {:>8}  {:>10}  {:<9}  {}",
            m.segment_id,
            m.table,
            day.unwrap_or_default(),
            m.rows,
            m.bytes,
            if committed.contains_key(&m.segment_id) {
                "yes"
            } else {
                "no"
            },
            m.source
        );
    }
    Ok(())
}

/// Prints each problem; true when there is none. A segment the catalogue does not know is
/// reported but is not a problem: its pass did not commit and its rows are still in the table.
fn verify(
    archive: &Archive,
    manifests: &[Manifest],
    committed: &HashMap<String, Committed>,
) -> bool {
    let (mut problems, mut rows, mut uncommitted) = (0, 0, 0);
    for m in manifests {
        if let Err(p) = archive.read(m) {
            println!("{}: {p}", m.segment_id);
            problems += 1;
            continue;
        }
        rows += m.rows;
        match committed.get(&m.segment_id) {
            None => {
                println!(
                    "{}: not in archive_segments: its pass did not commit, its rows are still in {}",
                    m.segment_id, m.table
                );
                uncommitted += 1;
            }
            Some(c) if c.sha256 != m.sha256 || c.rows as u64 != m.rows => {
                println!(
                    "{}: the catalogue says {} rows, SHA-256 {}; the manifest {} rows, {}",
                    m.segment_id, c.rows, c.sha256, m.rows, m.sha256
                );
                problems += 1;
            }
            Some(_) => {}
        }
    }
    let on_disk: std::collections::HashSet<&str> =
        manifests.iter().map(|m| m.segment_id.as_str()).collect();
    for c in committed
        .values()
        .filter(|c| !on_disk.contains(c.segment_id.as_str()))
    {
        println!(
            "{}: catalogued ({} rows of {}) but not in {}",
            c.segment_id,
            c.rows,
            c.table,
            archive.root().display()
        );
        problems += 1;
    }
    println!(
        "verified {} segment(s), {rows} row(s): {problems} problem(s), {uncommitted} uncommitted",
        manifests.len()
    );
    problems == 0
}

/// Restores the selected committed segments; prints the rows added per table.
async fn restore(
    archive: &Archive,
    client: &tokio_postgres::Client,
    args: &RestoreArgs,
) -> anyhow::Result<bool> {
    let (manifests, committed) = both(archive, client, args.table.as_deref()).await?;
    let chosen: Vec<&Manifest> = manifests
        .iter()
        .filter(|m| committed.contains_key(&m.segment_id))
        .filter(|m| args.segments.is_empty() || args.segments.contains(&m.segment_id))
        .collect();
    for s in &args.segments {
        anyhow::ensure!(
            chosen.iter().any(|m| &m.segment_id == s),
            "segment {s} is not a committed segment of {}",
            archive.root().display()
        );
    }
    let mut added: HashMap<&str, u64> = HashMap::new();
    for m in chosen {
        let rows = archive.read(m)?;
        anyhow::ensure!(
            m.table.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
            "segment {} names table {:?}",
            m.segment_id,
            m.table
        );
        let into = format!("restored_{}", m.table);
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {into}
                   (LIKE {t} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)",
                t = m.table
            ))
            .await?;
        let json = serde_json::Value::Array(rows);
        let n = client
            .execute(
                &format!(
                    "INSERT INTO {into}
                     SELECT (jsonb_populate_record(NULL::{into}, r)).*
                     FROM jsonb_array_elements($1::jsonb) r
                     ON CONFLICT DO NOTHING"
                ),
                &[&json],
            )
            .await?;
        *added.entry(m.table.as_str()).or_default() += n;
    }
    for (table, n) in &added {
        println!("restored_{table}: {n} row(s) added");
    }
    Ok(true)
}
