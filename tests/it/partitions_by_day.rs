//! The inbox and the outbox partitioned by day of their ids (docs/architecture/postgresql.md#tables-by-day):
//! retention makes days ahead, archives and drops whole days past retention, keeps a day that
//! still holds unsettled events; and while a release before V25 still writes the unpartitioned
//! tables, one claim per message holds across both releases and each sees the other's rows.

use chrono::{NaiveDate, Utc};
use seckill::archive::Archive;
use seckill::pg::retention::purge_all;
use std::collections::BTreeSet;

use crate::common::{self, TestEnv};

/// An id minted at noon (UTC) of `day`, as src/domain/ids.rs mints them.
fn minted(prefix: &str, day: NaiveDate, n: u128) -> String {
    let noon = day.and_hms_opt(12, 0, 0).unwrap().and_utc();
    format!(
        "{prefix}_{}",
        ulid::Ulid::from_parts(noon.timestamp_millis() as u64, n)
    )
}

async fn tables(env: &TestEnv, like: &str) -> BTreeSet<String> {
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    c.query(
        "SELECT tablename::text FROM pg_tables
         WHERE schemaname = current_schema() AND tablename LIKE $1",
        &[&like],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// The partition key is the time in the id's ULID, the same in SQL as in the id minted: every
/// copy of a message lands in one partition whenever it arrives.
#[tokio::test]
async fn the_partition_key_is_the_time_minted_in_the_id() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let ms = 1_765_000_123_456u64;
    let u = ulid::Ulid::from_parts(ms, 42);
    for id in [
        format!("evt_{u}"),
        format!("rsv_17_{u}"),
        format!("rsv_17.3_{u}"),
        format!("cmp_rsv_17_{u}"),
        format!("ord_{u}.pay-1.REFUND_REQUIRED"),
    ] {
        let at: f64 = c
            .query_one(
                "SELECT extract(epoch FROM seckill_id_at($1))::float8",
                &[&id],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!((at * 1000.0).round() as u64, ms, "{id}");
    }
    let none: f64 = c
        .query_one(
            "SELECT extract(epoch FROM seckill_id_at('7f000001-00002a9f'))::float8",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(none, 0.0, "no ULID: the epoch, the DEFAULT partition");
    drop(c);
    env.cleanup().await;
}

/// One pass: days ahead made; an inbox day and an outbox day past retention archived (the
/// archive's rows are the day's rows) and dropped; an outbox day holding a DEAD event kept
/// attached with only that event left; ids without a ULID purged row by row from the DEFAULT
/// partition; the inbox's retention mark moved past the dropped day's rows.
#[tokio::test]
async fn days_past_retention_are_archived_and_dropped_unless_they_hold_unsettled_events() {
    let mut env = TestEnv::without_topics().await;
    env.settings.retention.archive_segment_rows = 4;
    let today = Utc::now().date_naive();
    let old = today - chrono::Duration::days(20);
    let older = today - chrono::Duration::days(21);
    let pool = env.pool(1).await;
    let mut c = pool.get().await.unwrap();
    for (table, day) in [
        ("consumer_inbox_by_day", old),
        ("event_outbox_by_day", old),
        ("event_outbox_by_day", older),
    ] {
        seckill::pg::partitions::ensure_day(&c, table, day)
            .await
            .unwrap();
    }
    let inbox_old: Vec<String> = (1..=6).map(|n| minted("evt", old, n)).collect();
    let sent_old: Vec<String> = (1..=3).map(|n| minted("evt", old, 100 + n)).collect();
    let (held_sent, held_dead) = (minted("evt", older, 1), minted("evt", older, 2));
    let fresh = minted("evt", today, 1);
    c.execute(
        "INSERT INTO consumer_inbox_by_day
           (consumer_group, message_id, topic, status, received_at, id_at)
         SELECT 'g', m, 't', 'SUCCEEDED', seckill_id_at(m) + interval '1 minute', seckill_id_at(m)
         FROM unnest($1::text[] || $2::text) m",
        &[&inbox_old, &fresh],
    )
    .await
    .unwrap();
    c.batch_execute(
        "INSERT INTO consumer_inbox_by_day
           (consumer_group, message_id, topic, status, received_at, id_at)
         VALUES ('g', 'no-ulid-old', 't', 'SUCCEEDED', now() - interval '20 days', 'epoch'),
                ('g', 'no-ulid-new', 't', 'SUCCEEDED', now(), 'epoch')",
    )
    .await
    .unwrap();
    c.execute(
        "INSERT INTO event_outbox_by_day
           (event_id, topic, tag, message_key, payload, status, created_at, id_at)
         SELECT e, 't', 'x', 'k', '{}', s, seckill_id_at(e), seckill_id_at(e)
         FROM unnest($1::text[], $2::text[]) AS t(e, s)",
        &[
            &[&sent_old[..], &[held_sent.clone(), held_dead.clone()]].concat(),
            &["SENT", "SENT", "SENT", "SENT", "DEAD"]
                .map(String::from)
                .to_vec(),
        ],
    )
    .await
    .unwrap();

    let archive = Archive::of(&env.settings);
    let done = purge_all(&mut c, &archive, &env.settings.retention)
        .await
        .unwrap();
    let done_of = |t: &str| done.iter().find(|(n, _)| *n == t).map(|(_, r)| *r);
    assert_eq!(done_of("consumer_inbox_by_day"), Some(7), "{done:?}");
    assert_eq!(done_of("event_outbox_by_day"), Some(4), "{done:?}");

    // Days ahead, for both tables.
    for t in ["consumer_inbox_by_day", "event_outbox_by_day"] {
        for ahead in 0..=3 {
            let name =
                seckill::pg::partitions::partition_name(t, today + chrono::Duration::days(ahead));
            assert_eq!(tables(&env, &name).await.len(), 1, "{name}");
        }
    }
    // The old days are gone, archive first: the segments of each drop hold its rows.
    let day_of = |t: &str, d: NaiveDate| seckill::pg::partitions::partition_name(t, d);
    assert!(tables(&env, &day_of("consumer_inbox_by_day", old))
        .await
        .is_empty());
    assert!(tables(&env, &day_of("event_outbox_by_day", old))
        .await
        .is_empty());
    let dropped = |table: &str, day: NaiveDate, id: &str| {
        let source = format!("DROP {}", day_of(table, day));
        let mut ids = BTreeSet::new();
        for m in archive.list(Some(table)).unwrap() {
            if m.source == source {
                // read() checks the segment's checksum against its manifest.
                for r in archive.read(&m).unwrap() {
                    ids.insert(r[id].as_str().unwrap().to_string());
                }
            }
        }
        ids
    };
    assert_eq!(
        dropped("consumer_inbox_by_day", old, "message_id"),
        inbox_old.iter().cloned().collect()
    );
    assert_eq!(
        dropped("event_outbox_by_day", old, "event_id"),
        sent_old.iter().cloned().collect()
    );
    // The day holding a DEAD event stays, its SENT event archived and deleted row by row.
    assert_eq!(
        tables(&env, &day_of("event_outbox_by_day", older))
            .await
            .len(),
        1
    );
    let left: Vec<String> = c
        .query(
            &format!(
                "SELECT event_id FROM {}",
                day_of("event_outbox_by_day", older)
            ),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, vec![held_dead]);
    // The DEFAULT partition: the old row without a ULID purged by age, the new one kept.
    let inbox: BTreeSet<String> = c
        .query("SELECT message_id FROM consumer_inbox_by_day", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(inbox, BTreeSet::from([fresh, "no-ulid-new".to_string()]));
    // The mark covers the dropped day's newest row: the books expect none of its orders' rows.
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM retention_marks WHERE table_name = 'consumer_inbox_by_day'
               AND purged_before >= '{old} 12:01:00+00'"
        ))
        .await,
        1
    );
    drop(c);
    env.cleanup().await;
}

/// Claims by a release before V25 (the unpartitioned table, its own statement) and by this one
/// (the by-day table, through the order-create handler) decide together: whichever claims a
/// message first processes it, the other reads a duplicate, also when both claim at once; each
/// release sees the other's rows and outcomes.
#[tokio::test]
async fn an_older_release_and_this_one_claim_each_message_once_and_see_each_others_rows() {
    const OLD_CLAIM: &str = "INSERT INTO consumer_inbox
           (consumer_group, message_id, topic, reservation_id, order_id, status, delivery_attempt,
            activity_id)
         VALUES ($1, $2, 't', NULL, 'o', 'PROCESSING', 0, $3)
         ON CONFLICT DO NOTHING
         RETURNING message_id";
    let env = TestEnv::without_topics().await;
    env.activity(2510, 1, 10).await;
    let group = env.names().order_create_group;
    let topic = env.names().order_create_topic;
    let h = std::sync::Arc::new(
        seckill::roles::consume::order_create::OrderCreateHandler::new(
            env.pool(2).await,
            &env.settings,
            1,
        ),
    );
    let pool = env.pool(2).await;
    let mut old = pool.get().await.unwrap();
    let act = 2510i64;

    // This release first: the older one reads the duplicate, and sees the row and its event.
    let first = common::event(2510, 1, 1, 300);
    h.process(&[common::delivery_of(&topic, &first)])
        .await
        .unwrap();
    let claimed = old
        .query(OLD_CLAIM, &[&group, &first.message_id, &act])
        .await
        .unwrap();
    assert!(claimed.is_empty(), "a duplicate for the older release");
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM consumer_inbox WHERE message_id = '{}' AND decision = 'CREATED'",
            first.message_id
        ))
        .await,
        1
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM event_outbox WHERE aggregate_id = '{}'",
            first.order_id
        ))
        .await,
        2,
        "ORDER_CREATED and its timer, for an older relay"
    );

    // The older release first: this one reads the duplicate and creates no order.
    let second = common::event(2510, 1, 2, 300);
    let claimed = old
        .query(OLD_CLAIM, &[&group, &second.message_id, &act])
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    h.process(&[common::delivery_of(&topic, &second)])
        .await
        .unwrap();
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM orders WHERE order_id = '{}'",
            second.order_id
        ))
        .await,
        0,
        "the older release owns it"
    );
    // Its outcome, written where it writes, is the one this release reads.
    old.execute(
        "UPDATE consumer_inbox SET status = 'REJECTED', decision = 'EXPIRED'
         WHERE consumer_group = $1 AND message_id = $2",
        &[&group, &second.message_id],
    )
    .await
    .unwrap();
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM consumer_inbox_by_day
             WHERE message_id = '{}' AND status = 'REJECTED' AND decision = 'EXPIRED'",
            second.message_id
        ))
        .await,
        1
    );
    // An older relay's SENT is this relay's SENT.
    old.execute(
        "UPDATE event_outbox SET status = 'SENT', sent_at = now() WHERE aggregate_id = $1",
        &[&first.order_id],
    )
    .await
    .unwrap();
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM event_outbox_by_day WHERE aggregate_id = '{}' AND status = 'SENT'",
            first.order_id
        ))
        .await,
        2
    );

    // Both at once: the older release's claim is open when this one's arrives; it waits, and
    // reads the duplicate once the first commits.
    let third = common::event(2510, 1, 3, 300);
    let tx = old.transaction().await.unwrap();
    let claimed = tx
        .query(OLD_CLAIM, &[&group, &third.message_id, &act])
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let racing = {
        let h = h.clone();
        let d = common::delivery_of(&topic, &third);
        tokio::spawn(async move { h.process(&[d]).await })
    };
    common::eventually(10, "this release's claim waits on the open one", || async {
        env.count(
            "SELECT count(*) FROM pg_stat_activity
             WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .await
            >= 1
    })
    .await;
    tx.commit().await.unwrap();
    racing.await.unwrap().unwrap();
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM orders WHERE order_id = '{}'",
            third.order_id
        ))
        .await,
        0
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM consumer_inbox_by_day WHERE message_id = '{}'",
            third.message_id
        ))
        .await,
        1
    );
    drop(old);
    env.cleanup().await;
}

/// `seckill migrate --contract` is refused while a session of an older release is connected
/// (named as releases before V25 name theirs), then drops the old tables and their mirrors once
/// none is, audited, the by-day tables losing nothing; this release creates orders after it as
/// before, and a second contract has nothing left to drop.
#[tokio::test]
async fn the_contract_waits_for_older_releases_then_drops_the_old_tables() {
    let env = TestEnv::without_topics().await;
    env.activity(2511, 1, 10).await;
    let group = env.names().order_create_group;
    let topic = env.names().order_create_topic;
    let h = seckill::roles::consume::order_create::OrderCreateHandler::new(
        env.pool(2).await,
        &env.settings,
        1,
    );
    let before = common::event(2511, 1, 1, 300);
    h.process(&[common::delivery_of(&topic, &before)])
        .await
        .unwrap();

    // A session of an older release: the contract is refused and names it.
    let mut cfg = seckill::pg::pg_config(&env.settings.pg).unwrap();
    cfg.application_name("seckill-consume@OLD");
    let (older, conn) = cfg.connect(tokio_postgres::NoTls).await.unwrap();
    let conn = tokio::spawn(conn);
    let refused = common::cli(&env, &["migrate", "--contract"]);
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(!refused.status.success(), "{said}");
    assert!(said.contains("seckill-consume@OLD x1"), "{said}");
    assert_eq!(
        env.count("SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename IN ('consumer_inbox', 'event_outbox')").await,
        2
    );
    drop(older);
    let _ = conn.await;

    let done = common::cli(&env, &["migrate", "--contract"]);
    let said = String::from_utf8_lossy(&done.stdout).to_string();
    assert!(
        done.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert!(said.contains("(rows that differed: 0)"), "{said}");
    assert_eq!(
        env.count("SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename IN ('consumer_inbox', 'event_outbox')").await,
        0
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
             WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal
               AND c.relname IN ('consumer_inbox_by_day', 'event_outbox_by_day')"
        )
        .await,
        0,
        "the mirrors are gone"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM admin_audit WHERE action = 'schema_contract' AND detail ->> 'differed' = '0'").await,
        1
    );
    // Nothing of the by-day tables went, and orders are made as before.
    let after = common::event(2511, 1, 2, 300);
    h.process(&[common::delivery_of(&topic, &after)])
        .await
        .unwrap();
    for e in [&before, &after] {
        assert_eq!(
            env.count(&format!(
                "SELECT count(*) FROM consumer_inbox_by_day
                 WHERE consumer_group = '{group}' AND message_id = '{}' AND decision = 'CREATED'",
                e.message_id
            ))
            .await,
            1
        );
        assert_eq!(
            env.count(&format!(
                "SELECT count(*) FROM event_outbox_by_day WHERE aggregate_id = '{}'",
                e.order_id
            ))
            .await,
            2
        );
    }
    let again = common::cli(&env, &["migrate", "--contract"]);
    assert!(String::from_utf8_lossy(&again.stdout).contains("contract: nothing left to drop"));
    env.cleanup().await;
}
