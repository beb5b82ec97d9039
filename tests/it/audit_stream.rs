//! The audit stream (docs/architecture/messages.md#the-audit-stream): the group
//! `CG_SECKILL_AUDIT_V1` in `seckill consume` appends every order event to `audit_events`, one
//! row per event however often it is delivered, in a partition of the day its order was minted.

use std::collections::BTreeSet;

use chrono::Utc;
use seckill::mq::{Delivery, Properties};
use seckill::roles::consume::audit::AuditHandler;

use crate::common::{self, Role, TestEnv};

/// Message ids of `sql`'s first column.
async fn ids(env: &TestEnv, sql: &str) -> BTreeSet<String> {
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let rows = c.query(sql, &[]).await.unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

/// After a sale with payments and expiries, the audit record holds exactly the order events
/// the outbox sent: the same ids, each once, each with its order's activity.
#[tokio::test]
async fn after_a_sale_the_audit_record_holds_every_order_event_once() {
    let env = TestEnv::with_topics().await;
    env.activity(7900, 1, 20).await;
    let pay_window = ("SECKILL__CONSUMER__PAY_WINDOW_SECS", "4".to_string());
    let api = Role::api().spawn(&env);
    let roles = [
        Role::scan().spawn(&env),
        Role::consume(2).vars(&[pay_window]).spawn(&env),
        Role::timeout_cancel().spawn(&env),
    ];
    common::ready(std::iter::once(&api).chain(&roles)).await;
    common::sale::sell_pay_and_expire(&env, &[api.port], 7900, 20, 30).await;

    let topic = env.names().order_event_topic;
    let sent = format!("SELECT event_id FROM event_outbox WHERE topic = '{topic}'");
    let events = ids(&env, &sent).await;
    assert_eq!(events.len(), 40, "20 created, 10 paid, 10 cancelled");
    common::eventually(30, "every order event in the audit record", || async {
        ids(&env, "SELECT message_id FROM audit_events").await == events
    })
    .await;
    assert_eq!(env.count("SELECT count(*) FROM audit_events").await, 40);
    assert_eq!(
        env.count(
            "SELECT count(*) FROM audit_events a JOIN orders o USING (order_id)
             WHERE a.activity_id = o.activity_id AND a.payload->>'event_id' = a.message_id"
        )
        .await,
        40,
        "each row names its order's activity and carries the event as published"
    );
    // The audit group's backlog beside the projection's, on the same topic.
    common::assert_metrics(
        &format!("http://127.0.0.1:{}/metrics", roles[1].ops),
        &[
            "mq_consumer_lag_messages{topic=\"audit\"} 0",
            "mq_consumer_lag_seconds{topic=\"audit\"}",
            "mq_consumer_lag_seconds{topic=\"order_event\"}",
        ],
    )
    .await;
    let [scan, consume, cancel] = roles;
    for (mut p, secs) in [
        (api.proc, 20),
        (scan.proc, 20),
        (cancel.proc, 20),
        (consume.proc, 40),
    ] {
        assert!(p.terminate(secs).await.success());
    }
    env.cleanup().await;
}

fn delivery(order_id: &str, event_id: &str, body: &str) -> Delivery {
    Delivery {
        topic: "T_SECKILL_ORDER_EVENT_V1".into(),
        tags: "ORDER_PAID".into(),
        keys: order_id.into(),
        properties: Properties::from([("message_id", event_id)]),
        body: body.as_bytes().to_vec(),
        reconsume_times: 0,
        queue_id: 0,
        queue_offset: 1,
        store_timestamp_ms: Utc::now().timestamp_millis(),
        broker_msg_id: format!("b-{event_id}"),
        broker_name: "broker-a".into(),
    }
}

/// A redelivered event adds nothing, a body that is not JSON is quarantined with its raw bytes,
/// and an old order's event lands in its own day's partition, made for it.
#[tokio::test]
async fn a_redelivered_event_is_recorded_once_and_a_bad_body_is_quarantined() {
    let env = TestEnv::without_topics().await;
    let handler = AuditHandler::new(env.pool(2).await, "CG_AUDIT_TEST".into());
    // An order minted on 2026-01-02 (its ULID's time).
    let old = format!("ord_{}", ulid::Ulid::from_parts(1_767_312_000_000, 1));
    let body = |event: &str| {
        format!(
            r#"{{"event_id":"{event}","order_id":"{old}","activity_id":5,"aggregate_version":2}}"#
        )
    };
    let paid = format!("{old}.v2.ORDER_PAID");
    let batch = vec![
        delivery(&old, &paid, &body(&paid)),
        delivery(&old, "junk", "{not json"),
    ];
    assert_eq!(handler.process(&batch).await.unwrap(), 1);
    // The broker delivers it again (another copy, another broker id): nothing added.
    let again = vec![delivery(&old, &paid, &body(&paid))];
    assert_eq!(handler.process(&again).await.unwrap(), 0);
    assert_eq!(env.count("SELECT count(*) FROM audit_events").await, 1);
    assert_eq!(
        env.count(
            "SELECT count(*) FROM audit_events_p20260102
             WHERE message_id LIKE '%.v2.ORDER_PAID' AND activity_id = 5 AND aggregate_version = 2"
        )
        .await,
        1
    );
    assert_eq!(
        env.count(
            "SELECT count(*) FROM quarantined_messages
             WHERE consumer_group = 'CG_AUDIT_TEST' AND raw_body = '{not json'"
        )
        .await,
        1
    );
    env.cleanup().await;
}

/// An event the audit record cannot take (its table locked past every retry) is dead-lettered
/// by the broker and recorded in `dlq_messages` under the audit group like any group's; replayed
/// once the cause is gone, it reaches the record, once.
///
/// One story: the replay acts on the dead letter the locked table produced.
#[tokio::test]
async fn an_event_the_record_refuses_every_time_is_dead_lettered_and_replayable() {
    let env = TestEnv::with_topics().await;
    let names = env.names();
    // Every attempt waits on the locked table past the statement timeout.
    let locker_pool = env.pool(1).await;
    let mut locker = locker_pool.get().await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE audit_events IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let consume = Role::consume(1)
        .vars(&[
            ("SECKILL__CONSUMER__MAX_RECONSUME_TIMES", "1".to_string()),
            ("SECKILL__PG__STATEMENT_TIMEOUT_MS", "200".to_string()),
        ])
        .spawn(&env);
    common::ready([&consume]).await;

    let order = format!("ord_{}", ulid::Ulid::new());
    let event_id = format!("{order}.v1.ORDER_CREATED");
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let sent = publisher
        .send(
            seckill::mq::OutMessage {
                topic: names.order_event_topic.clone(),
                tag: "ORDER_CREATED".into(),
                keys: vec![order.clone()],
                properties: vec![("message_id".into(), event_id.clone())],
                body: format!(
                    r#"{{"event_id":"{event_id}","order_id":"{order}","activity_id":7901,"aggregate_version":1,"schema_version":{}}}"#,
                    seckill::domain::SCHEMA_VERSION
                )
                .into_bytes(),
                deliver_time_ms: None,
                sharding_key: None,
            },
            3000,
        )
        .await;
    assert!(
        matches!(sent, seckill::mq::SendOutcome::Confirmed { .. }),
        "{sent:?}"
    );
    let audit_dead = format!(
        "SELECT count(*) FROM dlq_messages WHERE consumer_group = '{}' AND message_id = '{event_id}'",
        names.audit_group
    );
    common::eventually(90, "the audit group's dead letter is recorded", || async {
        env.count(&audit_dead).await == 1
    })
    .await;
    lock.rollback().await.unwrap();
    assert_eq!(env.count("SELECT count(*) FROM audit_events").await, 0);

    let listed = common::cli(&env, &["dlq", "list", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let id = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["consumer_group"] == names.audit_group.as_str())
        .expect("the audit group's dead letter is listed")["dlq_id"]
        .as_i64()
        .unwrap()
        .to_string();
    let out = common::cli_async(
        &env,
        &[
            "dlq",
            "replay",
            "--id",
            &id,
            "--reason",
            "lock gone",
            "--actor",
            "tester",
        ],
    )
    .await;
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    common::eventually(30, "the replayed event in the record", || async {
        ids(&env, "SELECT message_id FROM audit_events").await == BTreeSet::from([event_id.clone()])
    })
    .await;
    let mut consume = consume.proc;
    assert!(consume.terminate(40).await.success());
    env.cleanup().await;
}
