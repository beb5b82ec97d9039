//! Timers wait in the outbox until shortly before they are due
//! (docs/architecture/recovery.md#outbox-relay): the relay sends an order's ORDER_CREATED at once
//! and its CANCEL_IF_UNPAID only `scan.timer_lead_secs` before the payment deadline, once.

use std::sync::Arc;

use crate::common::{created_orders, eventually, TestEnv};
use seckill::roles::scan::Relay;

#[tokio::test]
async fn a_timer_waits_in_the_outbox_until_its_lead_then_is_sent_once() {
    let mut env = TestEnv::with_topics().await;
    env.settings.consumer.pay_window_secs = 15;
    env.settings.scan.timer_lead_secs = 10;
    env.activity(1310, 1, 5).await;
    created_orders(&env, 1310, &[1]).await;
    let relay = Relay::new(
        env.pool(2).await,
        seckill::mq::connect_publisher(&env.settings).await.unwrap(),
        Arc::new(env.settings.clone()),
    );
    let timer = |status: &str| {
        format!(
            "SELECT count(*) FROM event_outbox WHERE tag = 'CANCEL_IF_UNPAID' AND status = '{status}'"
        )
    };

    relay.relay_once().await.unwrap();
    assert_eq!(
        env.count(
            "SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_CREATED' AND status = 'SENT'"
        )
        .await,
        1,
        "the event goes at once"
    );
    assert_eq!(env.count(&timer("PENDING")).await, 1, "the timer is held");
    let pool = env.pool(1).await;
    let backlog = seckill::pg::outbox::backlog(&**pool.get().await.unwrap(), 10.0)
        .await
        .unwrap();
    assert_eq!((backlog.due, backlog.not_yet_due), (0, 1));
    assert!(backlog.oldest_due_age_secs < 1.0);

    // About 5 s later (deadline 15 s, lead 10 s) it is due: sent once, with its deliver time.
    let (relay, env_ref) = (&relay, &env);
    eventually(30, "the timer is sent", || async move {
        relay.relay_once().await.unwrap();
        env_ref.count(&timer("SENT")).await == 1
    })
    .await;
    assert_eq!(
        env.count(
            "SELECT count(*) FROM event_outbox WHERE tag = 'CANCEL_IF_UNPAID' AND attempts = 1
               AND sent_at >= deliver_at - interval '11 seconds'"
        )
        .await,
        1,
        "sent once, no earlier than its lead (1 s of clock slack)"
    );
    env.cleanup().await;
}
