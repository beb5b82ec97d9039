//! An operator's decision on one dead letter has one effect: a replay racing the normal
//! redelivery of the same message makes one order, and a discarded order-create dead letter,
//! after a dry run that changes nothing, withdraws its message and gives its unit back through
//! the compensation path exactly once (docs/architecture/recovery.md#dead-letters).

use crate::common;

use std::sync::Arc;

use crate::common::{delivery, event, reserve_only, TestEnv};
use seckill::mq::BatchHandler;
use seckill::pg::outbox;
use seckill::roles::consume::compensate::CompensationHandler;
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::scan::{event_from_reservation, outbox_message};

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

/// A dry run on an order-create dead letter changes nothing. Discarding it withdraws its message,
/// so a late copy makes no order, and its unit comes back once through compensation. It cannot be
/// discarded twice.
///
/// One story: the dry run, the discard, the late copy and the compensation all act on the one held
/// reservation and its dead letter, each on what the step before left.
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
    assert_eq!(redis.stock().sku_stock(955, 1).await.unwrap(), Some((5, 4)));
    comp.handle(vec![d.clone()]).await;
    comp.handle(vec![d]).await;
    let h = redis.reservation(955, &r.reservation_id).await.unwrap();
    assert_eq!(h["status"], "RELEASED", "{h:?}");
    assert_eq!(redis.stock().sku_stock(955, 1).await.unwrap(), Some((5, 5)));
    // Not twice.
    let out = run(&["dlq", "discard", &id, "--reason", "again"]);
    assert!(!out.status.success());
    drop(c);
    env.cleanup().await;
}
