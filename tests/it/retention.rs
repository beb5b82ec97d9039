//! Retention deletes only settled rows past their retention, in bounded batches.

use crate::common;

use std::time::Duration;

use crate::common::TestEnv;
use seckill::pg::retention::{pass, purge, purge_all, INBOX};
use seckill::roles::consume::order_create::OrderCreateHandler;

#[tokio::test]
async fn retention_deletes_only_what_is_past_retention_in_batches() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    let archive = seckill::archive::Archive::of(&env.settings);
    c.batch_execute(
        "INSERT INTO consumer_inbox (consumer_group, message_id, topic, status, received_at)
           SELECT 'g', 'old-' || i, 't', 'SUCCEEDED', now() - interval '20 days' FROM generate_series(1, 5) i;
         INSERT INTO consumer_inbox (consumer_group, message_id, topic, status, received_at)
           SELECT 'g', 'new-' || i, 't', 'SUCCEEDED', now() - interval '1 day' FROM generate_series(1, 3) i;
         INSERT INTO event_outbox (event_id, topic, tag, message_key, payload, status, created_at)
           SELECT 'old-sent-' || i, 't', 'x', 'k', '{}', 'SENT', now() - interval '20 days' FROM generate_series(1, 3) i;
         INSERT INTO event_outbox (event_id, topic, tag, message_key, payload, status, created_at) VALUES
           ('old-pending', 't', 'x', 'k', '{}', 'PENDING', now() - interval '20 days'),
           ('old-dead', 't', 'x', 'k', '{}', 'DEAD', now() - interval '20 days'),
           ('new-sent', 't', 'x', 'k', '{}', 'SENT', now());
         INSERT INTO dlq_messages (consumer_group, topic, dlq_queue_id, dlq_queue_offset, attempts, payload, status, first_seen) VALUES
           ('g', 't', 0, 1, 3, 'x', 'DISCARDED', now() - interval '40 days'),
           ('g', 't', 0, 2, 3, 'x', 'OPEN', now() - interval '40 days'),
           ('g', 't', 0, 3, 3, 'x', 'REPLAYED', now() - interval '1 day');
         INSERT INTO dlq_audit (dlq_id, action, actor, reason, outcome)
           SELECT dlq_id, 'DISCARD', 'ops', 'test', 'DISCARDED' FROM dlq_messages WHERE dlq_queue_offset = 1;
         INSERT INTO quarantined_messages (consumer_group, topic, reason, error, raw_body, received_at) VALUES
           ('g', 't', 'INVALID_JSON', 'e', 'x', now() - interval '40 days'),
           ('g', 't', 'INVALID_JSON', 'e', 'x', now());",
    )
    .await
    .unwrap();

    // Bounded batches: 5 old inbox rows, 2 per statement = 3 statements.
    let (rows, batches) = purge(&mut c, &archive, INBOX, Duration::from_secs(14 * 86_400), 2)
        .await
        .unwrap();
    assert_eq!((rows, batches), (5, 3));
    assert_eq!(env.count("SELECT count(*) FROM consumer_inbox").await, 3);

    let done = purge_all(&mut c, &archive, &env.settings.retention)
        .await
        .unwrap();
    let deleted = |t: &str| done.iter().find(|(name, _)| *name == t).map(|(_, n)| *n);
    assert_eq!(
        deleted("event_outbox_by_day"),
        Some(3),
        "only old SENT rows"
    );
    assert_eq!(
        deleted("dlq_messages"),
        Some(1),
        "only the old settled dead letter"
    );
    assert_eq!(deleted("quarantined_messages"), Some(1));
    let remaining: Vec<String> = c
        .query("SELECT event_id FROM event_outbox ORDER BY event_id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(remaining, vec!["new-sent", "old-dead", "old-pending"]);
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_messages WHERE status = 'OPEN'")
            .await,
        1,
        "OPEN stays"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit").await,
        1,
        "the audit trail stays"
    );
    // Each pass marks how far it purged; a database without autovacuum gets its busy tables
    // vacuumed after the pass.
    assert_eq!(
        env.count(
            "SELECT count(*) FROM retention_marks WHERE table_name = 'consumer_inbox_by_day'
               AND purged_before BETWEEN now() - interval '14 days 1 minute'
                                     AND now() - interval '13 days 23 hours'"
        )
        .await,
        1
    );
    drop(c);
    env.cleanup().await;
}

/// The pass as the scan role runs it: VACUUM under the pass's long bound (under the 2 s
/// statement bound it failed on a loaded machine), the session's bound given back after.
#[tokio::test]
async fn a_retention_pass_gives_the_session_its_statement_bound_back_after_vacuum() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    let mut rt = env.settings.retention.clone();
    rt.vacuum = true;
    let archive = seckill::archive::Archive::of(&env.settings);
    pass(&mut c, &archive, &rt, env.settings.pg.statement_timeout_ms)
        .await
        .unwrap();
    let bound: i64 = c
        .query_one(
            "SELECT setting::bigint FROM pg_settings WHERE name = 'statement_timeout'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(bound as u64, env.settings.pg.statement_timeout_ms);
    drop(c);
    env.cleanup().await;
}

/// An order whose inbox row retention purged is not a violation once the inbox's mark has
/// passed it; before the mark it is, and two creating messages always are.
#[tokio::test]
async fn the_invariants_allow_an_inbox_row_purged_by_retention_and_nothing_else() {
    let env = TestEnv::without_topics().await;
    env.activity(60, 1, 5).await;
    let h = OrderCreateHandler::new(env.pool(2).await, &env.settings, 1);
    let topic = env.names().order_create_topic;
    let e = common::event(60, 1, 1, 300);
    h.process(&[common::delivery_of(&topic, &e)]).await.unwrap();
    let group = env.names().order_create_group;
    let redis = env.redis().await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let check = || async {
        seckill::invariants::check(&**c, &redis, &group, 60, 1)
            .await
            .unwrap()
            .violations
            .into_iter()
            .filter(|v| v.contains("creating messages"))
            .count()
    };
    assert_eq!(check().await, 0);
    // Ten minutes old, its inbox row gone: with no retention mark, a message is missing.
    c.batch_execute(&format!(
        "UPDATE orders SET created_at = now() - interval '10 minutes';
         DELETE FROM consumer_inbox WHERE message_id = '{}'",
        e.message_id
    ))
    .await
    .unwrap();
    assert_eq!(check().await, 1);
    // Retention has purged what is older than 5 minutes: the row went with its age.
    c.batch_execute(
        "INSERT INTO retention_marks (table_name, purged_before)
         VALUES ('consumer_inbox', now() - interval '5 minutes')",
    )
    .await
    .unwrap();
    assert_eq!(check().await, 0);
    // Two creating messages for one order are never explained by retention.
    c.batch_execute(&format!(
        "INSERT INTO consumer_inbox (consumer_group, message_id, topic, order_id, status, decision)
         VALUES ('{group}', 'm1', 't', '{o}', 'SUCCEEDED', 'CREATED'),
                ('{group}', 'm2', 't', '{o}', 'SUCCEEDED', 'CREATED')",
        o = e.order_id
    ))
    .await
    .unwrap();
    assert_eq!(check().await, 1);
    drop(c);
    env.cleanup().await;
}

/// The growing tables' sizes the scan role exports: bytes and the row estimate of each (a
/// partitioned table summed over its partitions), and the age of the audit record's oldest day
/// partition; the scan role's /metrics carries them.
#[tokio::test]
async fn the_growing_tables_sizes_and_the_oldest_audit_partition_are_read_and_exported() {
    use seckill::pg::table_sizes;
    let env = TestEnv::without_topics().await;
    env.activity(1750, 1, 10).await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let day = (chrono::Utc::now() - chrono::Duration::days(3)).date_naive();
    seckill::pg::partitions::ensure_day(&c, "audit_events", day)
        .await
        .unwrap();
    c.batch_execute(
        "INSERT INTO consumer_inbox (consumer_group, message_id, topic, status, received_at)
           SELECT 'g', 'm-' || i, 't', 'SUCCEEDED', now() FROM generate_series(1, 500) i;
         ANALYZE consumer_inbox;",
    )
    .await
    .unwrap();
    let sizes = table_sizes::growing(&**c).await.unwrap();
    let of = |t: &str| sizes.iter().find(|s| s.table == t).unwrap().clone();
    assert_eq!(sizes.len(), table_sizes::GROWING.len());
    assert_eq!(of("consumer_inbox").rows, 500);
    assert!(
        of("consumer_inbox").bytes > 8192,
        "{:?}",
        of("consumer_inbox")
    );
    // Partitioned tables: their partitions' bytes (the parents hold none).
    assert!(
        of("orders").bytes > 0 && of("audit_events").bytes > 0,
        "{sizes:?}"
    );
    let age = table_sizes::oldest_day_partition_age_secs(&**c, "audit_events")
        .await
        .unwrap()
        .unwrap();
    assert!((3.0 * 86_400.0..4.0 * 86_400.0).contains(&age), "{age}");
    let scan = crate::common::Role::scan().spawn(&env);
    crate::common::ready([&scan]).await;
    crate::common::assert_metrics(
        &format!("http://127.0.0.1:{}/metrics", scan.ops),
        &[
            "pg_table_bytes{table=\"consumer_inbox\"}",
            "pg_table_rows_estimate{table=\"consumer_inbox\"} 500",
            "pg_partition_oldest_age_seconds{table=\"audit_events\"}",
        ],
    )
    .await;
    let mut scan = scan.proc;
    assert!(scan.terminate(20).await.success());
    drop(c);
    env.cleanup().await;
}
