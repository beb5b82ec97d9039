//! The outbox relay (docs/architecture/recovery.md#outbox-relay): an order's immediate events
//! go out in one batch call in version order and its timers one by one; a row the broker
//! refuses goes dead after its last attempt and stays dead.

use std::sync::Arc;
use std::time::Duration;

use crate::common::TestEnv;
use seckill::roles::scan::Relay;

#[tokio::test]
async fn an_outbox_row_that_never_sends_goes_dead_after_its_last_attempt() {
    let mut env = TestEnv::without_topics().await;
    env.settings.scan.relay_max_attempts = 2;
    env.settings.scan.relay_backoff_base_ms = 1;
    env.settings.scan.relay_backoff_cap_ms = 1;
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    // A topic the broker does not have: every send is a definite failure.
    c.execute(
        "INSERT INTO event_outbox (event_id, topic, tag, message_key, payload)
         VALUES ('evt-dead', 'NO_SUCH_TOPIC_FOR_SECKILL_TESTS', 'ORDER_PAID', 'ord_x', '{\"event_type\":\"ORDER_PAID\"}')",
        &[],
    )
    .await
    .unwrap();
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let relay = Relay::new(env.pool(2).await, publisher, Arc::new(env.settings.clone()));
    assert_eq!(relay.relay_once().await.unwrap(), 1);
    let (s, a, e) = outbox_status(&c).await;
    assert_eq!((s.as_str(), a), ("PENDING", 1), "retried after a failure");
    assert!(e.is_some());
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(relay.relay_once().await.unwrap(), 1);
    let (s, a, _) = outbox_status(&c).await;
    assert_eq!((s.as_str(), a), ("DEAD", 2), "dead after the last attempt");
    assert_eq!(
        relay.relay_once().await.unwrap(),
        0,
        "a dead row is not sent again"
    );
    // The broker refused it (no such topic): it waits for an operator, the relay's own probe
    // never brings it back.
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE dead_reason = 'REFUSED'")
            .await,
        1
    );
    assert!(!relay.probe_dead().await.unwrap());
    drop(c);
    env.cleanup().await;
}

async fn outbox_status(c: &deadpool_postgres::Object) -> (String, i32, Option<String>) {
    let r = c
        .query_one("SELECT status, attempts, last_error FROM event_outbox", &[])
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// Counts the broker calls the relay makes through the real producer.
struct CallLog {
    inner: Arc<dyn seckill::mq::Publisher>,
    /// (method, messages) of each call.
    calls: std::sync::Mutex<Vec<(&'static str, Vec<seckill::mq::OutMessage>)>>,
}

#[async_trait::async_trait]
impl seckill::mq::Publisher for CallLog {
    async fn send(
        &self,
        msg: seckill::mq::OutMessage,
        timeout_ms: u64,
    ) -> seckill::mq::SendOutcome {
        self.calls.lock().unwrap().push(("send", vec![msg.clone()]));
        self.inner.send(msg, timeout_ms).await
    }
    async fn send_batch(
        &self,
        msgs: Vec<seckill::mq::OutMessage>,
        timeout_ms: u64,
    ) -> Vec<seckill::mq::SendOutcome> {
        self.calls
            .lock()
            .unwrap()
            .push(("send_batch", msgs.clone()));
        self.inner.send_batch(msgs, timeout_ms).await
    }
}

#[tokio::test]
async fn the_relay_sends_immediate_events_in_one_batch_call_in_version_order_and_timers_one_by_one()
{
    let env = TestEnv::with_topics().await;
    let names = env.names();
    let pool = env.pool(2).await;
    let c = pool.get().await.unwrap();
    let orders = 10;
    for i in 0..orders {
        let order = format!("ord_relay_{i}");
        for (version, tag) in [(1, "ORDER_CREATED"), (2, "ORDER_PAID")] {
            c.execute(
                "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload)
                 VALUES ($1, $2, $3, $4, $4, $5, jsonb_build_object('event_type', $3::text))",
                &[&format!("{order}.v{version}"), &names.order_event_topic, &tag, &order, &version],
            )
            .await
            .unwrap();
        }
        c.execute(
            "INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id, payload, deliver_at)
             VALUES ($1, $2, 'CANCEL_IF_UNPAID', $3, $3, '{\"event_type\":\"CANCEL_ORDER_IF_UNPAID\"}', now() + interval '10 minutes')",
            &[&format!("{order}.CANCEL_IF_UNPAID"), &names.order_timeout_topic, &order],
        )
        .await
        .unwrap();
    }
    let inner = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let log = Arc::new(CallLog {
        inner,
        calls: Default::default(),
    });
    let relay = Relay::new(
        env.pool(2).await,
        log.clone(),
        Arc::new(env.settings.clone()),
    );
    assert_eq!(relay.relay_once().await.unwrap(), orders * 3);

    let calls = log.calls.lock().unwrap().clone();
    let batches: Vec<_> = calls.iter().filter(|(k, _)| *k == "send_batch").collect();
    let singles: Vec<_> = calls.iter().filter(|(k, _)| *k == "send").collect();
    assert_eq!(batches.len(), 1, "the order events go out in one call");
    let batch = &batches[0].1;
    assert_eq!(batch.len(), orders * 2);
    assert!(batch.iter().all(|m| m.deliver_time_ms.is_none()));
    for i in 0..orders {
        let at = |v: i32| {
            batch
                .iter()
                .position(|m| {
                    m.keys == [format!("ord_relay_{i}")]
                        && m.properties
                            .contains(&("aggregate_version".into(), v.to_string()))
                })
                .expect("both versions in the batch")
        };
        assert!(at(1) < at(2), "an order's events leave in version order");
    }
    assert_eq!(singles.len(), orders, "a timer per call");
    assert!(singles.iter().all(|(_, m)| m[0].deliver_time_ms.is_some()));

    let rows = c
        .query("SELECT status, broker_msg_id FROM event_outbox", &[])
        .await
        .unwrap();
    let ids: std::collections::HashSet<String> = rows
        .iter()
        .map(|r| {
            assert_eq!(r.get::<_, String>(0), "SENT");
            r.get(1)
        })
        .collect();
    assert_eq!(ids.len(), orders * 3, "each row has its own broker id");
    assert!(!ids.contains(""));
    drop(c);
    env.cleanup().await;
}
