//! The two delivery modes side by side: ORDER_PAID and ORDER_CANCELED reach a consumer the same
//! (topic, ids, version, payload, each once) through the outbox and as transaction messages; a
//! half message the broker does not store sends the event through the outbox; reconcile finds a
//! lost ORDER_PAID in transaction mode and frees a stranded one.

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use super::expire_every_order;
use crate::common::{
    caught_up, collect_events, created_orders, eventually, free_port, notify_payment, TestEnv,
};
use seckill::config::EventDelivery;
use seckill::domain::events::order_paid_event_id;
use seckill::mq::Delivery;
use seckill::roles::scan::Relay;
use seckill::services::half_messages::DEADLINE_PROPERTY;
use serde_json::json;

/// The properties the pipeline sets (lower case; the broker's own are upper case).
fn our_properties(d: &Delivery) -> BTreeSet<String> {
    d.properties
        .keys()
        .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c == '_') && !k.starts_with('_'))
        .map(str::to_owned)
        .collect()
}

/// One payment in `mode`, its notification sent twice: the ORDER_PAID consumers get, checked
/// against the event's row. Returns the properties it carried.
async fn paid_event_in(mode: EventDelivery, activity: i64) -> BTreeSet<String> {
    let mut env = TestEnv::with_topics().await;
    env.settings.events.order_paid = Some(mode);
    env.activity(activity, 1, 5).await;
    let orders = created_orders(&env, activity, &[1]).await;
    let oid = orders[0].order_id.clone();
    let names = env.names();
    let (collector, consumer, group) = collect_events(&env).await;
    let api = common::start_api(env.settings.clone()).await;

    let (status, body) = notify_payment(&api.base, &oid, "pay-1", 100).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["repeat"], json!(false));
    // The provider re-sends (it did not see the answer): the same answer, no second event.
    let (status, body) = notify_payment(&api.base, &oid, "pay-1", 100).await;
    assert_eq!((status.as_u16(), &body["repeat"]), (200, &json!(true)));

    // The relay sends what the outbox holds (the order's ORDER_CREATED in both modes; its
    // ORDER_PAID only in outbox mode).
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let relay = Relay::new(env.pool(2).await, publisher, Arc::new(env.settings.clone()));
    relay.relay_once().await.unwrap();

    eventually(30, "ORDER_PAID delivered", || async {
        !collector.paid(&oid).is_empty()
    })
    .await;
    caught_up(&env, &group, &names.order_event_topic).await;
    let paid = collector.paid(&oid);
    assert_eq!(paid.len(), 1, "{mode:?}: delivered exactly once");
    let d = &paid[0];

    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let event_id = order_paid_event_id(&oid, 2);
    let row = client
        .query_one(
            "SELECT payload, status, delivery, aggregate_version, topic FROM event_outbox
             WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .unwrap();
    let (payload, status, delivery): (serde_json::Value, String, String) =
        (row.get(0), row.get(1), row.get(2));
    assert_eq!(status, "SENT", "{mode:?}: the row is marked sent");
    assert_eq!(delivery, mode.label());
    assert_eq!(row.get::<_, Option<i32>>(3), Some(2));
    // What a consumer relies on: the topic, tag and key, the event id it deduplicates on,
    // the version it orders by, and the payload, exactly as the row holds them.
    assert_eq!(d.topic, row.get::<_, String>(4));
    assert_eq!(d.topic, names.order_event_topic);
    assert_eq!(&d.properties["message_id"], event_id);
    assert_eq!(&d.properties["event_type"], "ORDER_PAID");
    assert_eq!(&d.properties["aggregate_version"], "2");
    let body: serde_json::Value = serde_json::from_slice(&d.body).unwrap();
    assert_eq!(body, payload, "{mode:?}: the payload is the row's");
    assert_eq!(body["payment_id"], "pay-1");
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID'")
            .await,
        1,
        "one event row for one payment"
    );
    assert!(consumer.shutdown().await);
    api.stop.cancel();
    api.server.await.unwrap().unwrap();
    env.cleanup().await;
    our_properties(d)
}

#[tokio::test]
async fn order_paid_reaches_consumers_the_same_in_both_modes() {
    let outbox = paid_event_in(EventDelivery::Outbox, 1401).await;
    let transaction = paid_event_in(EventDelivery::Transaction, 1402).await;
    // The transaction message carries its local transaction's deadline besides (for the
    // check-back); nothing a consumer reads differs.
    let mut expected = outbox.clone();
    expected.insert(DEADLINE_PROPERTY.to_string());
    assert_eq!(transaction, expected, "outbox mode carried {outbox:?}");
}

#[tokio::test]
async fn a_half_message_the_broker_does_not_store_sends_the_event_through_the_outbox() {
    let mut env = TestEnv::without_topics().await;
    env.activity(1411, 1, 5).await;
    let orders = created_orders(&env, 1411, &[1]).await;
    let oid = orders[0].order_id.clone();
    // No name server there: no half message can be stored.
    env.settings.events.order_paid = Some(EventDelivery::Transaction);
    env.settings.mq.name_server = format!("127.0.0.1:{}", free_port());
    let api = common::start_api(env.settings.clone()).await;
    let (status, body) = notify_payment(&api.base, &oid, "pay-1", 100).await;
    assert_eq!(
        status, 200,
        "the payment does not wait for the broker: {body}"
    );
    let pool = env.pool(1).await;
    let row = pool
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT status, delivery FROM event_outbox WHERE event_id = $1",
            &[&order_paid_event_id(&oid, 2)],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        ("PENDING".to_string(), "outbox".to_string()),
        "the relay sends it once the broker is back"
    );
    api.stop.cancel();
    api.server.await.unwrap().unwrap();
    env.cleanup().await;
}

/// Two expired orders cancelled in one batch of the timeout cancel in `mode`: the
/// ORDER_CANCELED consumers get, checked against the rows. Returns the properties carried.
async fn canceled_events_in(mode: EventDelivery, activity: i64) -> BTreeSet<String> {
    use seckill::roles::timeout_cancel::TimeoutCancelHandler;
    let mut env = TestEnv::with_topics().await;
    env.settings.events.order_canceled = Some(mode);
    env.activity(activity, 1, 5).await;
    let orders = created_orders(&env, activity, &[1, 2]).await;
    let names = env.names();
    let (collector, consumer, group) = collect_events(&env).await;
    let pool = env.pool(3).await;
    expire_every_order(&pool).await;
    let mut handler = TimeoutCancelHandler::new(pool.clone(), &env.settings, 2);
    let mut producer = None;
    if mode == EventDelivery::Transaction {
        let tx = seckill::services::half_messages::start(&env.settings, pool.clone(), 64)
            .await
            .unwrap();
        producer = Some(tx.clone());
        handler = handler.with_transactions(tx, 2_000);
    }
    let sweep = handler.sweep_once(Duration::ZERO, 32).await.unwrap();
    assert_eq!((sweep.found, sweep.canceled), (2, 2));
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let relay = Relay::new(env.pool(2).await, publisher, Arc::new(env.settings.clone()));
    relay.relay_once().await.unwrap();

    let client = pool.get().await.unwrap();
    let mut carried = BTreeSet::new();
    for ids in &orders {
        let oid = &ids.order_id;
        eventually(30, "ORDER_CANCELED delivered", || async {
            !collector.tagged("ORDER_CANCELED", oid).is_empty()
        })
        .await;
        caught_up(&env, &group, &names.order_event_topic).await;
        let got = collector.tagged("ORDER_CANCELED", oid);
        assert_eq!(got.len(), 1, "{mode:?}: delivered exactly once");
        let event_id = format!("{oid}.v2.ORDER_CANCELED");
        let row = client
            .query_one(
                "SELECT payload, status, delivery FROM event_outbox WHERE event_id = $1",
                &[&event_id],
            )
            .await
            .unwrap();
        let payload: serde_json::Value = row.get(0);
        assert_eq!(row.get::<_, String>(1), "SENT");
        assert_eq!(row.get::<_, String>(2), mode.label());
        assert_eq!(&got[0].properties["message_id"], event_id);
        assert_eq!(&got[0].properties["aggregate_version"], "2");
        let body: serde_json::Value = serde_json::from_slice(&got[0].body).unwrap();
        assert_eq!(body, payload, "{mode:?}: the payload is the row's");
        carried = our_properties(&got[0]);
    }
    // The releases go through the outbox in both modes.
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'RELEASE_RESERVATION' AND delivery = 'outbox'")
            .await,
        2
    );
    if let Some(tx) = producer {
        tx.shutdown().await;
    }
    assert!(consumer.shutdown().await);
    env.cleanup().await;
    carried
}

#[tokio::test]
async fn order_canceled_reaches_consumers_the_same_in_both_modes() {
    let outbox = canceled_events_in(EventDelivery::Outbox, 1408).await;
    let transaction = canceled_events_in(EventDelivery::Transaction, 1409).await;
    let mut expected = outbox.clone();
    expected.insert(DEADLINE_PROPERTY.to_string());
    assert_eq!(transaction, expected, "outbox mode carried {outbox:?}");
}

#[tokio::test]
async fn reconcile_finds_a_lost_order_paid_in_transaction_mode_and_frees_a_stranded_one() {
    use seckill::roles::ops::reconcile::reconcile;
    let mut env = TestEnv::with_topics().await;
    env.settings.events.order_paid = Some(EventDelivery::Transaction);
    env.activity(1404, 1, 5).await;
    let orders = created_orders(&env, 1404, &[1, 2]).await;
    let (lost, stranded) = (orders[0].order_id.clone(), orders[1].order_id.clone());
    let api = common::start_api(env.settings.clone()).await;
    for (i, oid) in [&lost, &stranded].into_iter().enumerate() {
        let (status, body) = notify_payment(&api.base, oid, &format!("pay-{i}"), 100).await;
        assert_eq!(status, 200, "{body}");
    }
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    // One event row lost; another left TRANSACTION by a producer that died before marking
    // it, long ago (the broker has stopped asking about it).
    c.execute(
        "DELETE FROM event_outbox WHERE event_id = $1",
        &[&order_paid_event_id(&lost, 2)],
    )
    .await
    .unwrap();
    c.execute(
        "UPDATE event_outbox SET status = 'TRANSACTION', created_at = now() - interval '700 seconds'
         WHERE event_id = $1",
        &[&order_paid_event_id(&stranded, 2)],
    )
    .await
    .unwrap();
    let redis = env.redis().await;
    let args = common::reconcile_now();
    let report = reconcile(&env.settings, &**c, &redis, &args).await.unwrap();
    let found = |k: &str| {
        let f = report.findings.iter().find(|f| f.kind == k).unwrap();
        (f.found, f.emitted)
    };
    assert_eq!(found("missing_order_paid"), (1, 1));
    assert_eq!(found("transaction_past_horizon"), (1, 1));
    for oid in [&lost, &stranded] {
        let status: String = c
            .query_one(
                "SELECT status FROM event_outbox WHERE event_id = $1",
                &[&order_paid_event_id(oid, 2)],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(status, "PENDING", "{oid}: handed to the relay");
    }
    // The relay sends both under their ids; a second run finds nothing.
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let relay = Relay::new(env.pool(2).await, publisher, Arc::new(env.settings.clone()));
    relay.relay_once().await.unwrap();
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID' AND status = 'SENT'")
            .await,
        2
    );
    let again = reconcile(&env.settings, &**c, &redis, &args).await.unwrap();
    assert_eq!(again.drift(), 0, "{:?}", again.findings);
    api.stop.cancel();
    api.server.await.unwrap().unwrap();
    env.cleanup().await;
}
