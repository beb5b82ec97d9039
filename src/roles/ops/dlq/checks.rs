//! The pre-checks of a replay (`dlq_audit.checks`): is the message already applied, is its
//! reservation still held, does this build read its schema, is it older than the inbox's
//! retention.

use serde::Serialize;

use crate::config::Settings;
use crate::pg::replay::{self, ReplayRow};

/// What the pre-checks found about one dead letter or quarantined message before a replay
/// (`dlq_audit.checks`).
#[derive(Debug, Clone, Serialize)]
pub struct Checks {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dlq_id: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quarantine_id: Option<i64>,
    /// Where the broker stored it (a replay read from the source topic).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_ref: Option<String>,
    pub consumer_group: String,
    pub message_id: Option<String>,
    /// The group's inbox already holds the message (`status/decision`): a replay is a no-op.
    pub already_applied: Option<String>,
    /// Order-create only: the reservation in Redis (`RESERVED`: its unit is still held;
    /// `RELEASED`; `MISSING`), or why it could not be read.
    pub reservation: Option<String>,
    /// The payload carries a schema version this build reads.
    pub schema_known: bool,
    /// First seen longer ago than the inbox retention: the inbox may not recognise a duplicate.
    pub older_than_inbox_retention: bool,
}

/// Runs the pre-checks of a replay: PostgreSQL's inbox, Redis's reservation, the payload.
pub async fn pre_checks(
    settings: &Settings,
    client: &tokio_postgres::Client,
    rows: &[ReplayRow],
) -> anyhow::Result<Vec<Checks>> {
    let order_create = settings.names().order_create_group.clone();
    let retention = chrono::Duration::from_std(crate::config::RetentionSettings::age(
        settings.retention.inbox_days,
    ))?;
    let redis = if rows.iter().any(|r| r.consumer_group == order_create) {
        Some(crate::redis::RedisStore::connect(&settings.redis).await)
    } else {
        None
    };
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let already_applied = match &row.message_id {
            Some(id) => replay::inbox_state(client, &row.consumer_group, id)
                .await?
                .map(|(status, decision)| format!("{status}/{}", decision.unwrap_or_default())),
            None => None,
        };
        let event = (row.consumer_group == order_create)
            .then(|| crate::domain::OrderCreateRequested::decode(&row.payload).ok())
            .flatten();
        let reservation = match (&redis, &event) {
            (Some(Ok(redis)), Some(e)) => Some(
                match redis.reservation(e.activity_id, &e.reservation_id).await {
                    Ok(h) => h.get("status").cloned().unwrap_or_else(|| "MISSING".into()),
                    Err(err) => format!("unreadable: {err}"),
                },
            ),
            (Some(Err(err)), _) => Some(format!("unreadable: {err}")),
            (Some(Ok(_)), None) => Some("unknown: the payload does not decode".into()),
            (None, _) => None,
        };
        let schema_known = if row.consumer_group == order_create {
            event.is_some()
        } else {
            schema_version(row) == Some(i64::from(crate::domain::SCHEMA_VERSION))
        };
        out.push(Checks {
            dlq_id: row.subject.dlq_id(),
            quarantine_id: row.subject.quarantine_id(),
            source_ref: row.subject.source_ref().map(str::to_string),
            consumer_group: row.consumer_group.clone(),
            message_id: row.message_id.clone(),
            already_applied,
            reservation,
            schema_known,
            older_than_inbox_retention: row.first_seen < chrono::Utc::now() - retention,
        });
    }
    Ok(out)
}

/// The schema version of a dead letter: its body's `schema_version`, else its property's.
fn schema_version(row: &ReplayRow) -> Option<i64> {
    serde_json::from_slice::<serde_json::Value>(&row.payload)
        .ok()
        .and_then(|v| v.get("schema_version").and_then(serde_json::Value::as_i64))
        .or_else(|| {
            row.properties
                .get("schema_version")
                .and_then(serde_json::Value::as_str)
                .and_then(|v| v.parse().ok())
        })
}

pub(super) fn print_checks(checks: &[Checks], json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(checks)?);
        return Ok(());
    }
    println!(
        "{:>6}  {:<40}  {:<24}  {:<12}  {:<7}  retention",
        "id", "group / message_id", "already applied", "reservation", "schema"
    );
    for c in checks {
        println!(
            "{:>6}  {:<40}  {:<24}  {:<12}  {:<7}  {}",
            c.dlq_id.or(c.quarantine_id).unwrap_or_default(),
            format!(
                "{} / {}",
                c.consumer_group,
                c.message_id.as_deref().unwrap_or("-")
            ),
            c.already_applied.as_deref().unwrap_or("no"),
            c.reservation.as_deref().unwrap_or("-"),
            if c.schema_known { "known" } else { "UNKNOWN" },
            if c.older_than_inbox_retention {
                "OLDER (needs --force)"
            } else {
                "ok"
            }
        );
    }
    println!("dry run: {} message(s), nothing sent", checks.len());
    Ok(())
}
