//! Compensation (docs/architecture/recovery.md#compensation): an expired reservation's release
//! goes through the outbox relay and gives the unit back exactly once, even sent twice and
//! delivered a third time; a batch of releases gives each unit back once; a release the
//! compensation consumers never took is sent again.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use super::Progress;
use crate::common::{delivery, delivery_of, eventually, reserve_only, TestEnv};
use chrono::Utc;
use seckill::domain::{Decision, RejectReason};
use seckill::domain::{Ids, OrderCreateRequested};
use seckill::pg::outbox;
use seckill::roles::consume::compensate::CompensationHandler;
use seckill::roles::consume::order_create::OrderCreateHandler;
use seckill::roles::scan::{outbox_message, Relay};

/// The reservation's message reaches the order consumer after its validity ended: rejected
/// as expired, its release (compensation task and outbox row) written.
async fn rejected_as_expired(
    env: &TestEnv,
    redis: &seckill::redis::RedisStore,
    activity_id: i64,
    ids: &Ids,
) {
    let fields = redis
        .reservation(activity_id, &ids.reservation_id)
        .await
        .unwrap();
    let mut event: OrderCreateRequested =
        seckill::roles::scan::event_from_reservation(&fields, 1).unwrap();
    event.reservation_valid_until = Utc::now() - chrono::Duration::seconds(1);
    event.reservation_created_at = event.reservation_valid_until - chrono::Duration::seconds(300);
    let order_handler = OrderCreateHandler::new(env.pool(2).await, &env.settings, 1);
    let d = delivery_of(&env.names().order_create_topic, &event);
    assert_eq!(
        order_handler.process(&[d]).await.unwrap(),
        vec![Decision::Rejected(RejectReason::Expired)]
    );
}

/// The compensation handler, and a consumer of the compensation topic running it.
async fn compensation_consumer(
    env: &TestEnv,
    redis: &seckill::redis::RedisStore,
) -> (
    Arc<CompensationHandler>,
    seckill::mq::rocketmq::ConsumerHandle,
) {
    let names = env.names();
    let comp = Arc::new(CompensationHandler {
        redis: redis.clone(),
        pool: env.pool(2).await,
        group: names.compensate_group.clone(),
    });
    let consumer = seckill::mq::start_consumer(
        &env.settings,
        &names.compensate_group,
        &names.compensate_topic,
        comp.clone(),
        2,
        16,
    )
    .await
    .unwrap();
    (comp, consumer)
}

#[tokio::test]
async fn an_expired_backlog_is_compensated_once_through_the_relay_even_when_redelivered() {
    let mut env = TestEnv::with_topics().await;
    env.settings.scan.relay_lease_secs = 1;
    env.activity(20, 1, 5).await;
    let redis = env.redis().await;
    let settings = Arc::new(env.settings.clone());
    let names = env.names();
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();

    // The reservation's message reaches the consumer after its validity ended.
    let ids = reserve_only(&redis, 20, 7, 60_000).await;
    assert_eq!(redis.stock().sku_stock(20, 1).await.unwrap(), Some((5, 4)));
    rejected_as_expired(&env, &redis, 20, &ids).await;
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 0);

    let (comp, consumer) = compensation_consumer(&env, &redis).await;

    // A relay sends the compensation event and dies before marking it SENT ...
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    let rows = outbox::claim(&**c, 10, 1.0).await.unwrap();
    assert_eq!(rows.len(), 1);
    let first = publisher.send(outbox_message(&rows[0]), 3000).await;
    assert!(
        matches!(first, seckill::mq::SendOutcome::Confirmed { .. }),
        "{first:?}"
    );
    // ... so after its lease another relay sends it again.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let relay = Relay::new(env.pool(2).await, publisher.clone(), settings.clone());
    assert_eq!(relay.relay_once().await.unwrap(), 1);
    assert_eq!(
        env.count(
            "SELECT count(*) FROM event_outbox WHERE status = 'SENT' AND broker_msg_id IS NOT NULL"
        )
        .await,
        1
    );

    eventually(30, "compensation done", || async {
        env.count("SELECT count(*) FROM compensation_tasks WHERE status = 'DONE'")
            .await
            == 1
    })
    .await;
    // And a third delivery straight to the handler.
    let payload = c
        .query_one("SELECT payload FROM event_outbox", &[])
        .await
        .unwrap()
        .get::<_, serde_json::Value>(0);
    let again = delivery(
        &names.compensate_topic,
        None,
        serde_json::to_vec(&payload).unwrap(),
    );
    assert_eq!(
        comp.process(std::slice::from_ref(&again)).await.unwrap(),
        ["already_released"]
    );
    // The relay's second send has been consumed too before the stock is read.
    common::caught_up(&env, &names.compensate_group, &names.compensate_topic).await;
    assert_eq!(
        redis.stock().sku_stock(20, 1).await.unwrap(),
        Some((5, 5)),
        "released exactly once"
    );
    let fields = redis.reservation(20, &ids.reservation_id).await.unwrap();
    assert_eq!(fields["status"], "RELEASED");
    // The buyer may try again.
    reserve_only(&redis, 20, 7, 60_000).await;
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_batch_of_releases_gives_each_unit_back_once_in_one_round_trip() {
    let env = TestEnv::without_topics().await;
    env.activity(21, 1, 5).await;
    let redis = env.redis().await;
    let names = env.names();
    let a = reserve_only(&redis, 21, 1, 60_000).await;
    let b = reserve_only(&redis, 21, 2, 60_000).await;
    assert_eq!(redis.stock().sku_stock(21, 1).await.unwrap(), Some((5, 3)));
    let release = |ids: &Ids| {
        let body = serde_json::json!({
            "schema_version": 1, "event_type": "RELEASE_RESERVATION",
            "event_id": format!("{}.RELEASE", ids.reservation_id),
            "reservation_id": ids.reservation_id, "order_id": ids.order_id,
            "activity_id": 21, "sku_id": 1, "user_id": 1, "reason": "NO_STOCK",
        });
        delivery(
            &names.compensate_topic,
            None,
            serde_json::to_vec(&body).unwrap(),
        )
    };
    let comp = CompensationHandler {
        redis: redis.clone(),
        pool: env.pool(1).await,
        group: names.compensate_group.clone(),
    };
    let batch = [
        release(&a),
        release(&b),
        release(&a),
        delivery(&names.compensate_topic, None, b"{".to_vec()),
    ];
    assert_eq!(
        comp.process(&batch).await.unwrap(),
        ["released", "released", "already_released", "quarantined"]
    );
    assert_eq!(redis.stock().sku_stock(21, 1).await.unwrap(), Some((5, 5)));
    // The whole batch again (a redelivery): nothing more comes back.
    let again = comp.process(&batch).await.unwrap();
    assert_eq!(
        again[..3],
        ["already_released", "already_released", "already_released"]
    );
    assert_eq!(redis.stock().sku_stock(21, 1).await.unwrap(), Some((5, 5)));
    env.cleanup().await;
}

#[tokio::test]
async fn a_confirmed_release_the_compensation_consumers_never_took_is_sent_again() {
    let mut env = TestEnv::with_topics().await;
    env.settings.scan.unconsumed_resend_ms = 1_000;
    env.activity(21, 1, 5).await;
    let redis = env.redis().await;
    let settings = Arc::new(env.settings.clone());
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    // An expired reservation: rejected, its release in the outbox.
    let ids = reserve_only(&redis, 21, 7, 60_000).await;
    rejected_as_expired(&env, &redis, 21, &ids).await;
    // The relay sent it 20 s ago to a broker that died holding it: SENT, never delivered.
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    let sent = c
        .execute(
            "UPDATE event_outbox SET status = 'SENT', sent_at = now() - interval '20 seconds',
                    broker_msg_id = 'on-a-dead-broker', created_at = now() - interval '20 seconds'
             WHERE tag = 'RELEASE_RESERVATION'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(sent, 1);
    c.execute(
        "UPDATE compensation_tasks SET created_at = now() - interval '20 seconds'",
        &[],
    )
    .await
    .unwrap();
    let (_, consumer) = compensation_consumer(&env, &redis).await;
    let relay_with = |progress: Option<i64>| {
        let (publisher, settings) = (publisher.clone(), settings.clone());
        let env = &env;
        async move {
            Relay::new(env.pool(2).await, publisher, settings)
                .with_release_progress(Arc::new(Progress(progress)))
        }
    };
    // No reading, or a group that has taken nothing since before the send: nothing is due.
    assert_eq!(
        relay_with(None).await.requeue_unconsumed().await.unwrap(),
        0
    );
    let behind = Utc::now().timestamp_millis() - 30_000;
    assert_eq!(
        relay_with(Some(behind))
            .await
            .requeue_unconsumed()
            .await
            .unwrap(),
        0
    );
    // Caught up, and the task still PENDING: sent again under the same event id.
    let relay = relay_with(Some(i64::MAX)).await;
    assert_eq!(relay.requeue_unconsumed().await.unwrap(), 1);
    assert_eq!(
        relay.requeue_unconsumed().await.unwrap(),
        0,
        "already back in line"
    );
    assert_eq!(relay.relay_once().await.unwrap(), 1);
    eventually(30, "the unit given back", || async {
        env.count("SELECT count(*) FROM compensation_tasks WHERE status = 'DONE'")
            .await
            == 1
    })
    .await;
    assert_eq!(redis.stock().sku_stock(21, 1).await.unwrap(), Some((5, 5)));
    // Done: nothing more to send, however old the row.
    c.execute(
        "UPDATE event_outbox SET sent_at = now() - interval '20 seconds'",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(relay.requeue_unconsumed().await.unwrap(), 0);
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}
