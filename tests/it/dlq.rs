//! The DLQ loop's intake on the real broker: a message that fails every time lands in the
//! group's %DLQ% topic after its retries, is recorded in PostgreSQL with the error that
//! killed it, counts in the gauge's source, and can be listed and discarded (audited).

use crate::common;

use std::sync::Arc;

use crate::common::{delivery, event, eventually, reserve_only, TestEnv};
use seckill::mq::{order_create_message, BatchHandler};
use seckill::pg::outbox;
use seckill::roles::consume::compensate::CompensationHandler;
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::scan::{event_from_reservation, outbox_message};

#[tokio::test]
async fn a_message_failing_every_time_is_dead_lettered_recorded_and_discardable() {
    let mut env = TestEnv::with_topics().await;
    env.settings.consumer.max_reconsume_times = 1;
    env.settings.pg.statement_timeout_ms = 200;
    env.activity(950, 1, 5).await;
    let names = env.names();

    // Every attempt times out on the locked stock row: a transient failure, each time.
    let locker_pool = env.pool(1).await;
    let mut locker = locker_pool.get().await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.execute("SELECT 1 FROM stock_buckets FOR UPDATE", &[])
        .await
        .unwrap();

    let handler = Arc::new(OrderCreateHandler::new(env.pool(2).await, &env.settings, 1));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 1)
        .await
        .unwrap();
    let intakes =
        seckill::roles::consume::dlq_intake::start_intakes(&env.settings, env.pool(2).await)
            .await
            .unwrap();
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let e = event(950, 1, 42, 300);
    let sent = publisher
        .send(order_create_message(&names.order_create_topic, &e), 3000)
        .await;
    assert!(
        matches!(sent, seckill::mq::SendOutcome::Confirmed { .. }),
        "{sent:?}"
    );

    eventually(90, "the dead letter is recorded", || async {
        env.count("SELECT count(*) FROM dlq_messages").await == 1
    })
    .await;
    lock.rollback().await.unwrap();
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    assert_recorded(&c, &names, &e).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);

    // The operator's view and decisions, through the binary.
    let run = |args: &[&str]| common::cli(&env, args);
    let out = run(&["dlq", "list", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed[0]["message_id"], e.message_id.as_str());
    let id = listed[0]["dlq_id"].as_i64().unwrap().to_string();

    // The cause is fixed (the lock is gone): replay makes exactly one order, and so does a
    // second replay of the same dead letter.
    for _ in 0..2 {
        // It watches the inbox for the effect while this test's consumer works.
        let out = common::cli_async(
            &env,
            &[
                "dlq",
                "replay",
                "--id",
                &id,
                "--reason",
                "lock released",
                "--actor",
                "tester",
                "--verify-secs",
                "30",
            ],
        )
        .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eventually(30, "the replayed order", || async {
            env.count("SELECT count(*) FROM orders").await == 1
        })
        .await;
    }
    // Both replays consumed: a second order could no longer appear.
    let names = env.names();
    common::caught_up(&env, &names.order_create_group, &names.order_create_topic).await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        1,
        "one effect for two replays"
    );
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'REPLAY' AND outcome = 'CONFIRMED' AND replay_id LIKE 'rpl_%'").await,
        2
    );
    // Each replay's audit row says what came of it: the first made the order, the second
    // found the inbox already holding the message.
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'REPLAY' AND effect = 'APPLIED:CREATED' AND checks->>'already_applied' IS NULL").await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'REPLAY' AND effect = 'DUPLICATE' AND checks->>'already_applied' = 'SUCCEEDED/CREATED'").await,
        1
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_messages WHERE status = 'REPLAYED'")
            .await,
        1
    );

    replay_past_retention(&env, &c, &id).await;
    common::caught_up(&env, &names.order_create_group, &names.order_create_topic).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    // What the consume role exports as mq_dlq_replay_total{result}: the CLI is not scraped.
    assert_eq!(
        seckill::pg::dlq::replay_counts(&**c).await.unwrap(),
        vec![("confirmed".to_owned(), 3), ("refused".to_owned(), 1)]
    );

    discard_once(&env, &c, &id).await;

    drop(c);
    consumer.shutdown().await;
    for i in intakes {
        i.shutdown().await;
    }
    env.cleanup().await;
}

/// The dead letter's row: where it came from, why it died, its raw payload, OPEN.
async fn assert_recorded(
    c: &tokio_postgres::Client,
    names: &seckill::mq::Names,
    e: &seckill::domain::OrderCreateRequested,
) {
    let r = c
        .query_one(
            "SELECT consumer_group, topic, message_id, reservation_id, attempts, error_class, last_error, payload, status
             FROM dlq_messages",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.get::<_, String>(0), names.order_create_group);
    assert_eq!(r.get::<_, String>(1), names.order_create_topic);
    assert_eq!(
        r.get::<_, Option<String>>(2).as_deref(),
        Some(e.message_id.as_str())
    );
    assert_eq!(
        r.get::<_, Option<String>>(3).as_deref(),
        Some(e.reservation_id.as_str())
    );
    assert!(r.get::<_, i32>(4) >= 1);
    assert_eq!(r.get::<_, Option<String>>(5).as_deref(), Some("transient"));
    assert!(
        r.get::<_, Option<String>>(6)
            .unwrap_or_default()
            .contains("57014"),
        "the error that killed it"
    );
    assert_eq!(r.get::<_, Vec<u8>>(7), e.encode(), "raw payload kept");
    assert_eq!(r.get::<_, String>(8), "OPEN");
    assert_eq!(
        seckill::pg::dlq::open_stats(c).await.unwrap().0,
        1,
        "mq_dlq_messages = 1"
    );
}

/// Discard: only an OPEN dead letter, audited; a second discard is refused.
async fn discard_once(env: &TestEnv, c: &tokio_postgres::Client, id: &str) {
    let run = |args: &[&str]| common::cli(env, args);
    c.execute("UPDATE dlq_messages SET status = 'OPEN'", &[])
        .await
        .unwrap();
    let out = run(&[
        "dlq",
        "discard",
        id,
        "--reason",
        "test: done",
        "--actor",
        "tester",
    ]);
    assert!(out.status.success());
    assert_eq!(seckill::pg::dlq::open_stats(c).await.unwrap().0, 0);
    // Its message had become an order: the discard gives nothing back.
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE action = 'DISCARD' AND actor = 'tester' AND effect = 'ALREADY_DECIDED'")
            .await,
        1
    );
    assert!(!run(&["dlq", "discard", id, "--reason", "twice"])
        .status
        .success());
}

/// Older than the inbox retention: a replay is refused, unless forced (and audited as forced).
async fn replay_past_retention(env: &TestEnv, c: &tokio_postgres::Client, id: &str) {
    let run = |args: &[&str]| common::cli(env, args);
    c.execute(
        "UPDATE dlq_messages SET first_seen = now() - interval '30 days'",
        &[],
    )
    .await
    .unwrap();
    let out = run(&[
        "dlq", "replay", "--id", id, "--reason", "old", "--actor", "tester",
    ]);
    assert!(!out.status.success(), "refused");
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE outcome = 'REFUSED_OLDER_THAN_RETENTION'")
            .await,
        1
    );
    let out = run(&[
        "dlq",
        "replay",
        "--id",
        id,
        "--reason",
        "old, on purpose",
        "--actor",
        "tester",
        "--force",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE outcome = 'CONFIRMED_FORCED'")
            .await,
        1
    );
}

#[tokio::test]
async fn a_replay_racing_the_normal_redelivery_of_the_same_message_has_one_effect() {
    let env = TestEnv::without_topics().await;
    env.activity(951, 1, 5).await;
    let names = env.names();
    let h = Arc::new(OrderCreateHandler::new(env.pool(6).await, &env.settings, 4));
    let e = event(951, 1, 7, 300);
    let normal = common::delivery_of(&names.order_create_topic, &e);
    // What `dlq replay` publishes for this message: same message_id, a replay id and count.
    let row = seckill::pg::replay::ReplayRow {
        subject: seckill::pg::replay::Subject::DeadLetter(1),
        consumer_group: names.order_create_group.clone(),
        topic: names.order_create_topic.clone(),
        message_id: Some(e.message_id.clone()),
        reservation_id: Some(e.reservation_id.clone()),
        order_id: Some(e.order_id.clone()),
        payload: e.encode(),
        properties: serde_json::json!({"message_id": e.message_id, "TAGS": "CREATE_ORDER"}),
        first_seen: chrono::Utc::now(),
        status: "OPEN".into(),
    };
    let msg = seckill::roles::ops::dlq::replay_message(&row, "rpl_test");
    assert!(msg
        .properties
        .contains(&("replay_count".to_string(), "1".to_string())));
    let mut replayed = common::delivery(
        &names.order_create_topic,
        Some(&e.message_id),
        msg.body.clone(),
    );
    replayed.properties.extend(msg.properties.iter().cloned());
    let calls = (0..20).map(|i| {
        let (h, d) = (
            h.clone(),
            if i % 2 == 0 {
                normal.clone()
            } else {
                replayed.clone()
            },
        );
        async move { h.handle(vec![d]).await }
    });
    futures::future::join_all(calls).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM consumer_inbox").await, 1);
    env.cleanup().await;
}

#[tokio::test]
async fn discarding_an_order_create_dead_letter_gives_its_unit_back_once_after_a_dry_run() {
    let env = TestEnv::without_topics().await;
    env.activity(955, 1, 5).await;
    let names = env.names();
    let redis = env.redis().await;
    // A reservation whose message died: its unit and the buyer's slot are held in Redis.
    let r = reserve_only(&redis, 955, 7, 60_000).await;
    let event =
        event_from_reservation(&redis.reservation(955, &r.reservation_id).await.unwrap(), 1)
            .unwrap();
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let dlq_id: i64 = c
        .query_one(
            "INSERT INTO dlq_messages (consumer_group, topic, message_id, reservation_id, order_id,
                                       dlq_queue_id, dlq_queue_offset, attempts, payload, properties)
             VALUES ($1, $2, $3, $4, $5, 0, 0, 17, $6, $7) RETURNING dlq_id",
            &[
                &names.order_create_group,
                &names.order_create_topic,
                &event.message_id,
                &event.reservation_id,
                &event.order_id,
                &event.encode(),
                &serde_json::json!({ "message_id": event.message_id }),
            ],
        )
        .await
        .unwrap()
        .get(0);
    let id = dlq_id.to_string();
    let run = |args: &[&str]| common::cli(&env, args);

    // The dry run says what a replay would meet, and changes nothing.
    let out = run(&["dlq", "replay", "--id", &id, "--dry-run", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let checks: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        checks[0]["already_applied"],
        serde_json::Value::Null,
        "{checks}"
    );
    assert_eq!(checks[0]["reservation"], "RESERVED", "{checks}");
    assert_eq!(checks[0]["schema_known"], true, "{checks}");
    assert_eq!(checks[0]["older_than_inbox_retention"], false, "{checks}");
    assert_eq!(env.count("SELECT count(*) FROM dlq_audit").await, 0);
    let table = run(&["dlq", "replay", "--id", &id, "--dry-run"]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("RESERVED"));

    // Discarded: the message is withdrawn in the same transaction as the audit row.
    let out = run(&[
        "dlq", "discard", &id, "--reason", "bad data", "--actor", "tester",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("WITHDRAWN"));
    assert_eq!(
        env.count(
            "SELECT count(*) FROM dlq_audit WHERE action = 'DISCARD' AND effect = 'WITHDRAWN'"
        )
        .await,
        1
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM reservations WHERE reservation_id = '{}' AND status = 'REJECTED' AND reject_reason = 'WITHDRAWN'",
            event.reservation_id
        ))
        .await,
        1
    );
    // A copy of the message that still arrives creates nothing.
    let handler = OrderCreateHandler::new(env.pool(2).await, &env.settings, 1);
    let late = handler
        .process(&[common::delivery_of(&names.order_create_topic, &event)])
        .await
        .unwrap();
    assert_eq!(late, vec![seckill::domain::Decision::DuplicateMessage]);
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);

    // The unit goes back through the compensation path, exactly once.
    let rows = outbox::claim(&**c, 10, 1.0).await.unwrap();
    let released: Vec<_> = rows
        .iter()
        .filter(|r| r.topic == names.compensate_topic)
        .collect();
    assert_eq!(released.len(), 1, "{rows:?}");
    let msg = outbox_message(released[0]);
    let mut d = delivery(&names.compensate_topic, None, msg.body.clone());
    d.properties.extend(msg.properties.iter().cloned());
    let comp = CompensationHandler {
        redis: redis.clone(),
        pool: env.pool(1).await,
        group: names.compensate_group.clone(),
    };
    assert_eq!(redis.sku_stock(955, 1).await.unwrap(), Some((5, 4)));
    comp.handle(vec![d.clone()]).await;
    comp.handle(vec![d]).await;
    let h = redis.reservation(955, &r.reservation_id).await.unwrap();
    assert_eq!(h["status"], "RELEASED", "{h:?}");
    assert_eq!(redis.sku_stock(955, 1).await.unwrap(), Some((5, 5)));
    // Not twice.
    let out = run(&["dlq", "discard", &id, "--reason", "again"]);
    assert!(!out.status.success());
    drop(c);
    env.cleanup().await;
}

/// `seckill dlq groups`: open dead letters and quarantined messages that failed the same way
/// (ids and numbers aside) form one group with its count and oldest samples; handled ones
/// (replayed, discarded) are not work any more.
#[tokio::test]
async fn dead_letters_failing_the_same_way_form_one_group() {
    let env = TestEnv::without_topics().await;
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    c.batch_execute(
        r#"INSERT INTO dlq_messages (consumer_group, topic, dlq_queue_id, dlq_queue_offset, attempts,
                                     error_class, last_error, payload, status, first_seen) VALUES
             ('CG_A', 't', 0, 1, 17, 'PERMANENT', 'order ord_01A not found', '{"schema_version":1}', 'OPEN', now() - interval '3 minutes'),
             ('CG_A', 't', 0, 2, 17, 'PERMANENT', 'order ord_01B not found', '{"schema_version":1}', 'OPEN', now() - interval '2 minutes'),
             ('CG_A', 't', 0, 3, 17, 'PERMANENT', 'order ord_01C not found', '{"schema_version":1}', 'OPEN', now() - interval '1 minute'),
             ('CG_A', 't', 0, 4, 17, 'PERMANENT', 'order ord_01D not found', '{"schema_version":1}', 'DISCARDED', now()),
             ('CG_A', 't', 0, 5, 17, 'TRANSIENT', 'statement timeout after 2000 ms', 'not json', 'OPEN', now());
           INSERT INTO quarantined_messages (consumer_group, topic, reason, error, raw_body) VALUES
             ('CG_A', 't', 'UNSUPPORTED_SCHEMA', 'schema_version 9 is newer than 2', '{"schema_version":9}'),
             ('CG_A', 't', 'UNSUPPORTED_SCHEMA', 'schema_version 9 is newer than 2', '{"schema_version":9}');"#,
    )
    .await
    .unwrap();
    let groups = seckill::roles::ops::dlq::failure_groups(&c, None, 1000)
        .await
        .unwrap();
    let seen: Vec<(&str, &str, usize, Option<i64>, &str)> = groups
        .iter()
        .map(|g| {
            let (source, class) = (g.source, g.class.as_str());
            (source, class, g.count, g.schema_version, g.message.as_str())
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (
                "dead_letter",
                "PERMANENT",
                3,
                Some(1),
                "order <id> not found"
            ),
            (
                "quarantined",
                "UNSUPPORTED_SCHEMA",
                2,
                Some(9),
                "schema_version <n> is newer than <n>"
            ),
            (
                "dead_letter",
                "TRANSIENT",
                1,
                None,
                "statement timeout after <n> ms"
            ),
        ]
    );
    let oldest: Vec<i64> = c
        .query(
            "SELECT dlq_id FROM dlq_messages WHERE error_class = 'PERMANENT' AND status = 'OPEN'
             ORDER BY first_seen",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(groups[0].samples, oldest, "the oldest first");

    // The command prints the same groups as JSON.
    let out = common::command(&env, &["dlq", "groups", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let printed = printed.as_array().unwrap();
    assert_eq!(printed.len(), 3);
    assert_eq!(printed[0]["fingerprint"], groups[0].fingerprint.as_str());
    assert_eq!(printed[0]["count"], 3);
    drop(c);
    env.cleanup().await;
}

/// Records `m` as an OPEN dead letter of `group` the way the intake does (its properties,
/// tags and keys as the broker carried them), first seen `age_secs` ago.
async fn dead_letter(
    c: &tokio_postgres::Client,
    group: &str,
    m: &seckill::mq::OutMessage,
    offset: i64,
    error: &str,
    age_secs: f64,
) {
    let mut props: serde_json::Map<String, serde_json::Value> = m
        .properties
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    props.insert("TAGS".into(), m.tag.clone().into());
    props.insert("KEYS".into(), m.keys.join(" ").into());
    let message_id = props["message_id"].as_str().map(str::to_string);
    let reservation_id = props["reservation_id"].as_str().map(str::to_string);
    c.execute(
        "INSERT INTO dlq_messages (consumer_group, topic, message_id, reservation_id,
                                   dlq_queue_id, dlq_queue_offset, attempts, error_class,
                                   last_error, payload, properties, first_seen)
         VALUES ($1, $2, $3, $4, 0, $5, 17, 'transient', $6, $7, $8,
                 now() - make_interval(secs => $9))",
        &[
            &group,
            &m.topic,
            &message_id,
            &reservation_id,
            &offset,
            &error,
            &m.body,
            &serde_json::Value::Object(props),
            &age_secs,
        ],
    )
    .await
    .unwrap();
}

/// Projection dead letters for the users of `users` (each at the offset of its user id), all
/// failing with `error`, first seen a second ago.
async fn projection_dead_letters(
    c: &tokio_postgres::Client,
    names: &seckill::mq::Names,
    users: std::ops::Range<i64>,
    error: &str,
) {
    for user in users {
        let m = order_create_message(&names.order_event_topic, &event(1710, 1, user, 300));
        dead_letter(c, &names.projection_group, &m, user, error, 1.0).await;
    }
}

/// The batch ids the audit holds for `action`, with how many rows each.
async fn batches(c: &tokio_postgres::Client, action: &str) -> Vec<(String, i64)> {
    c.query(
        "SELECT replay_batch_id, count(*) FROM dlq_audit WHERE action = $1
         GROUP BY replay_batch_id ORDER BY min(audit_id)",
        &[&action],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

#[tokio::test]
async fn a_group_of_dead_letters_is_replayed_sample_first_under_one_batch_id_or_discarded_whole() {
    let env = TestEnv::with_topics().await;
    env.activity(1710, 1, 10).await;
    let names = env.names();
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    // Five order-create messages that died the same way (a lock timeout naming each order),
    // oldest first; and two of the projection that died another way.
    let events: Vec<_> = (1..=5).map(|u| event(1710, 1, u, 300)).collect();
    for (i, e) in events.iter().enumerate() {
        let m = order_create_message(&names.order_create_topic, e);
        let error = format!("canceling statement due to lock timeout on {}", e.order_id);
        dead_letter(
            &c,
            &names.order_create_group,
            &m,
            i as i64,
            &error,
            60.0 - i as f64,
        )
        .await;
    }
    projection_dead_letters(&c, &names, 10..12, "projection script error 7").await;
    let groups = seckill::roles::ops::dlq::failure_groups(&c, None, 1000)
        .await
        .unwrap();
    let fingerprint = |group: &str| {
        groups
            .iter()
            .find(|g| g.consumer_group == group)
            .unwrap()
            .fingerprint
            .clone()
    };
    let (orders_fp, projection_fp) = (
        fingerprint(&names.order_create_group),
        fingerprint(&names.projection_group),
    );
    let replay = |fp: String, verify: &'static str| {
        let env = &env;
        async move {
            common::cli_async(
                env,
                &[
                    "dlq",
                    "replay",
                    "--fingerprint",
                    &fp,
                    "--sample",
                    "2",
                    "--reason",
                    "lock fixed",
                    "--actor",
                    "tester",
                    "--verify-secs",
                    verify,
                    "--rate",
                    "200",
                ],
            )
            .await
        }
    };

    // No consumer runs: the sample is sent but never seen applied, so the rest is held back
    // and the command fails saying so.
    let out = replay(orders_fp.clone(), "2").await;
    assert!(!out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("2 not observed") && stdout.contains("3 held back"),
        "{stdout}"
    );
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_messages WHERE status = 'OPEN'")
            .await,
        5,
        "3 order-create dead letters and the 2 of the projection still open"
    );
    let first = batches(&c, "REPLAY").await;
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].1, 2, "one batch id on the sample's two audit rows");
    assert!(first[0].0.starts_with("rpb_"));

    // With the consumer running, the next replay of the group (the three still open) applies
    // its sample, then the rest, under a batch id of its own.
    let handler = Arc::new(OrderCreateHandler::new(env.pool(2).await, &env.settings, 1));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 1)
        .await
        .unwrap();
    let out = replay(orders_fp, "30").await;
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("3 confirmed (3 applied") && stdout.contains("0 held back"),
        "{stdout}"
    );
    let both = batches(&c, "REPLAY").await;
    assert_eq!(both.len(), 2);
    assert_eq!(both[1].1, 3);
    assert_ne!(both[0].0, both[1].0);
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM dlq_audit WHERE replay_batch_id = '{}' AND effect = 'APPLIED:CREATED'",
            both[1].0
        ))
        .await,
        3
    );
    // The first sample's messages were on the topic all along: the consumer made them too.
    eventually(30, "five orders", || async {
        env.count("SELECT count(*) FROM orders").await == 5
    })
    .await;

    // The projection's group has no inbox to watch: judged by its sends, recorded as such.
    let out = replay(projection_fp.clone(), "2").await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_audit WHERE effect = 'UNOBSERVABLE'")
            .await,
        2
    );

    // Discarding a whole group: every open member, one batch id, each audited.
    projection_dead_letters(&c, &names, 20..23, "projection script error 9").await;
    let out = common::cli(
        &env,
        &[
            "dlq",
            "discard",
            "--fingerprint",
            &projection_fp,
            "--reason",
            "stale views",
        ],
    );
    assert!(out.status.success(), "{out:?}");
    let discards = batches(&c, "DISCARD").await;
    assert_eq!(discards.len(), 1);
    assert_eq!(discards[0].1, 3);
    assert_eq!(
        env.count("SELECT count(*) FROM dlq_messages WHERE status = 'OPEN'")
            .await,
        0
    );
    let out = common::cli(
        &env,
        &[
            "dlq",
            "discard",
            "--fingerprint",
            "000000000000",
            "--reason",
            "x",
        ],
    );
    assert!(!out.status.success(), "an unknown fingerprint is an error");
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}
