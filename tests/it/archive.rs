//! The archive (docs/architecture/postgresql.md#the-archive): what retention takes out of
//! PostgreSQL is written first, reads back equal to what left, is checked by `archive verify`,
//! restores readable, and can be sent again after the broker no longer has it.

use std::collections::BTreeSet;
use std::time::Duration;

use seckill::archive::Archive;
use seckill::pg::retention::{purge, purge_all, OUTBOX};

use crate::common::{self, Role, TestEnv};

/// `sql`'s first column, as text.
async fn texts(env: &TestEnv, sql: &str) -> BTreeSet<String> {
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let rows = c.query(sql, &[]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// Every row of the archive's segments of `table`, read and checked.
fn archived(env: &TestEnv, table: &str) -> Vec<serde_json::Value> {
    let archive = Archive::of(&env.settings);
    let mut rows = Vec::new();
    for m in archive.list(Some(table)).unwrap() {
        rows.extend(archive.read(&m).unwrap());
    }
    rows
}

fn field(rows: &[serde_json::Value], f: &str) -> BTreeSet<String> {
    rows.iter()
        .map(|r| r[f].as_str().unwrap_or_default().to_string())
        .collect()
}

/// The SENT outbox rows older than 14 days, 10 per batch, archived then deleted.
async fn purge_old_outbox(
    c: &mut tokio_postgres::Client,
    archive: &Archive,
) -> Result<(u64, u64), seckill::pg::retention::RetentionError> {
    purge(c, archive, OUTBOX, Duration::from_secs(14 * 86_400), 10).await
}

/// The rows a pass deletes are the archive's rows, field for field; `archive verify` passes,
/// catches a changed byte, and a restore makes them readable in `restored_<table>` once.
///
/// One story: verify, corruption and restore all read the one archive the pass wrote.
#[tokio::test]
async fn what_retention_deletes_is_archived_first_verified_and_restorable() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    c.batch_execute(
        "INSERT INTO event_outbox (event_id, topic, tag, message_key, payload, status, created_at, sent_at)
           SELECT 'old-sent-' || i, 't', 'x', 'k', jsonb_build_object('n', i), 'SENT',
                  now() - interval '20 days', now() - interval '20 days'
           FROM generate_series(1, 25) i;
         INSERT INTO event_outbox (event_id, topic, tag, message_key, payload, status, created_at)
           VALUES ('old-pending', 't', 'x', 'k', '{}', 'PENDING', now() - interval '20 days');
         INSERT INTO consumer_inbox (consumer_group, message_id, topic, status, received_at)
           SELECT 'g', 'old-' || i, 't', 'SUCCEEDED', now() - interval '20 days'
           FROM generate_series(1, 7) i;",
    )
    .await
    .unwrap();
    let before = texts(
        &env,
        "SELECT to_jsonb(o)::text FROM event_outbox_by_day o WHERE status = 'SENT'",
    )
    .await;
    let archive = Archive::of(&env.settings);
    // 25 rows in batches of 10: three segments, each its own transaction.
    let (rows, batches) = purge_old_outbox(&mut c, &archive).await.unwrap();
    assert_eq!((rows, batches), (25, 3));
    let done = purge_all(&mut c, &archive, &env.settings.retention)
        .await
        .unwrap();
    assert!(done.contains(&("consumer_inbox_by_day", 7)), "{done:?}");

    let outbox = archived(&env, "event_outbox_by_day");
    let after: BTreeSet<String> = outbox.iter().map(|r| r.to_string()).collect();
    let before: BTreeSet<String> = before
        .iter()
        .map(|t| {
            serde_json::from_str::<serde_json::Value>(t)
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        after, before,
        "the archive holds exactly the rows that left"
    );
    assert_eq!(
        field(&archived(&env, "consumer_inbox_by_day"), "message_id").len(),
        7
    );
    assert_eq!(
        texts(&env, "SELECT event_id FROM event_outbox").await,
        BTreeSet::from(["old-pending".to_string()])
    );
    assert_eq!(
        env.count("SELECT COALESCE(sum(row_count), 0)::bigint FROM archive_segments WHERE table_name = 'event_outbox_by_day'").await,
        25
    );

    let verify = common::cli(&env, &["archive", "verify"]);
    let said = String::from_utf8_lossy(&verify.stdout).to_string();
    assert!(verify.status.success(), "{said}");
    assert!(
        said.contains("verified 4 segment(s), 32 row(s): 0 problem(s), 0 uncommitted"),
        "{said}"
    );

    let restore = common::cli(
        &env,
        &["archive", "restore", "--table", "event_outbox_by_day"],
    );
    assert!(
        restore.status.success(),
        "{}",
        String::from_utf8_lossy(&restore.stderr)
    );
    let again = common::cli(
        &env,
        &["archive", "restore", "--table", "event_outbox_by_day"],
    );
    assert!(String::from_utf8_lossy(&again.stdout)
        .contains("restored_event_outbox_by_day: 0 row(s) added"));
    assert_eq!(
        env.count(
            "SELECT count(*) FROM restored_event_outbox_by_day WHERE status = 'SENT' AND payload ? 'n'"
        )
        .await,
        25,
        "restored once, readable as rows"
    );

    // One changed byte in one segment: verify names it and fails.
    let m = &archive.list(Some("event_outbox_by_day")).unwrap()[0];
    let path = archive.root().join(m.data_path());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[10] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let verify = common::cli(&env, &["archive", "verify"]);
    let said = String::from_utf8_lossy(&verify.stdout).to_string();
    assert!(!verify.status.success(), "{said}");
    assert!(
        said.contains(&m.segment_id) && said.contains("1 problem(s)"),
        "{said}"
    );
    drop(c);
    env.cleanup().await;
}

/// An archive that cannot be written stops the pass before anything is deleted.
#[tokio::test]
async fn rows_stay_when_the_archive_cannot_be_written() {
    let mut env = TestEnv::without_topics().await;
    // A file where the archive's directory should be.
    let blocked = std::env::temp_dir().join(format!("seckill-blocked-{}", env.settings.env));
    std::fs::write(&blocked, b"not a directory").unwrap();
    env.settings.retention.archive_dir = blocked.to_string_lossy().into_owned();
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    c.batch_execute(
        "INSERT INTO event_outbox (event_id, topic, tag, message_key, payload, status, created_at)
           SELECT 'old-sent-' || i, 't', 'x', 'k', '{}', 'SENT', now() - interval '20 days'
           FROM generate_series(1, 5) i",
    )
    .await
    .unwrap();
    let archive = Archive::of(&env.settings);
    let err = purge_old_outbox(&mut c, &archive).await.unwrap_err();
    assert!(
        matches!(err, seckill::pg::retention::RetentionError::Archive(_)),
        "{err}"
    );
    assert_eq!(env.count("SELECT count(*) FROM event_outbox").await, 5);
    assert_eq!(env.count("SELECT count(*) FROM archive_segments").await, 0);
    std::fs::remove_file(blocked).unwrap();
    drop(c);
    env.cleanup().await;
}

/// The audit record sheds whole day partitions: detached, archived in segments, dropped; the
/// archive's rows are the partition's; a late event of that day makes its partition again.
///
/// One story: the late event matters only after the drop, into the partition the pass removed.
#[tokio::test]
async fn an_old_audit_partition_is_archived_then_dropped_and_a_late_event_still_lands() {
    let mut env = TestEnv::without_topics().await;
    env.settings.retention.archive_segment_rows = 4;
    env.settings.retention.audit_days = 30.0;
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    let old = chrono::NaiveDate::from_ymd_opt(2026, 1, 2).unwrap();
    seckill::pg::partitions::ensure_day(&c, "audit_events", old)
        .await
        .unwrap();
    let today = chrono::Utc::now().date_naive();
    seckill::pg::partitions::ensure_day(&c, "audit_events", today)
        .await
        .unwrap();
    c.batch_execute(
        "INSERT INTO audit_events (order_at, message_id, event_type, order_id, payload, topic, broker_msg_id, stored_at)
           SELECT '2026-01-02 10:00:00+00', 'old-' || i, 'ORDER_PAID', 'ord', jsonb_build_object('i', i), 't', 'b', now()
           FROM generate_series(1, 10) i;
         INSERT INTO audit_events (order_at, message_id, event_type, order_id, payload, topic, broker_msg_id, stored_at)
           VALUES (now(), 'new-1', 'ORDER_PAID', 'ord', '{}', 't', 'b', now());",
    )
    .await
    .unwrap();
    let archive = Archive::of(&env.settings);
    let done = purge_all(&mut c, &archive, &env.settings.retention)
        .await
        .unwrap();
    assert!(done.contains(&("audit_events", 10)), "{done:?}");
    let rows = archived(&env, "audit_events");
    assert_eq!(rows.len(), 10);
    assert_eq!(
        field(&rows, "message_id"),
        (1..=10).map(|i| format!("old-{i}")).collect(),
        "the archive holds the dropped partition's rows"
    );
    assert_eq!(
        archive.list(Some("audit_events")).unwrap().len(),
        3,
        "4 + 4 + 2 rows"
    );
    assert!(archive
        .list(Some("audit_events"))
        .unwrap()
        .iter()
        .all(|m| m.source == "DROP audit_events_p20260102"));
    assert_eq!(
        env.count("SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'audit_events_p2026010%'").await,
        0,
        "neither the partition nor its detached copy is left"
    );
    assert_eq!(env.count("SELECT count(*) FROM audit_events").await, 1);

    // A late event of an order minted that day: its partition is made again and it lands.
    let handler = seckill::roles::consume::audit::AuditHandler::new(
        env.pool(2).await,
        "CG_AUDIT_TEST".into(),
    );
    let order = format!("ord_{}", ulid::Ulid::from_parts(1_767_348_000_000, 1));
    let event = format!("{order}.v3.REFUND_REQUIRED");
    let body = format!(r#"{{"event_id":"{event}","order_id":"{order}","activity_id":5}}"#);
    let late = seckill::mq::Delivery {
        topic: "T_SECKILL_ORDER_EVENT_V1".into(),
        tags: "REFUND_REQUIRED".into(),
        keys: order.clone(),
        properties: seckill::mq::Properties::from([("message_id", event.as_str())]),
        body: body.into_bytes(),
        reconsume_times: 0,
        queue_id: 0,
        queue_offset: 1,
        store_timestamp_ms: chrono::Utc::now().timestamp_millis(),
        broker_msg_id: "b-late".into(),
        broker_name: "broker-a".into(),
    };
    assert_eq!(handler.process(&[late]).await.unwrap(), 1);
    assert_eq!(
        env.count("SELECT count(*) FROM audit_events_p20260102")
            .await,
        1
    );
    drop(c);
    env.cleanup().await;
}

/// An order event the broker does not hold (sent before its retention, its outbox row since
/// archived and deleted) is sent again from the archive and reaches the audit record.
#[tokio::test]
async fn an_event_gone_from_the_broker_is_replayed_from_the_archive() {
    let env = TestEnv::with_topics().await;
    let names = env.names();
    let order = format!("ord_{}", ulid::Ulid::new());
    let event = format!("{order}.v2.ORDER_PAID");
    let payload = serde_json::json!({
        "event_id": event, "event_type": "ORDER_PAID", "order_id": order,
        "activity_id": 7902, "aggregate_version": 2,
        "schema_version": seckill::domain::SCHEMA_VERSION,
    });
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    c.execute(
        "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, aggregate_version,
                                   payload, status, created_at, sent_at)
         VALUES ($1, $2, 'ORDER_PAID', $3, $3, 2, $4, 'SENT', now() - interval '20 days',
                 now() - interval '20 days')",
        &[&event, &names.order_event_topic, &order, &payload],
    )
    .await
    .unwrap();
    let archive = Archive::of(&env.settings);
    purge_all(&mut c, &archive, &env.settings.retention)
        .await
        .unwrap();
    assert_eq!(env.count("SELECT count(*) FROM event_outbox").await, 0);

    let consume = Role::consume(1).spawn(&env);
    common::ready([&consume]).await;
    let since = (chrono::Utc::now() - chrono::Duration::days(21)).to_rfc3339();
    let until = (chrono::Utc::now() - chrono::Duration::days(19)).to_rfc3339();
    let args = [
        "dlq",
        "replay",
        "--from-archive",
        "--group",
        &names.audit_group,
        "--since",
        &since,
        "--until",
        &until,
        "--reason",
        "the lake lost it",
        "--actor",
        "tester",
        "--force",
    ];
    let out = common::cli_async(&env, &args).await;
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    common::eventually(30, "the archived event in the audit record", || async {
        texts(&env, "SELECT message_id FROM audit_events").await == BTreeSet::from([event.clone()])
    })
    .await;
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'REPLAY' AND source_ref LIKE 'archive:seg_%#1' AND outcome LIKE 'CONFIRMED%'").await,
        1,
        "audited with where it was archived"
    );
    let mut consume = consume.proc;
    assert!(consume.terminate(40).await.success());
    drop(c);
    env.cleanup().await;
}
