//! Recovery paths on the real services (docs/architecture/recovery.md), one file per path:
//! `scanner` re-sends what the API never sent or the consumers never took, `relay` delivers the
//! outbox, `compensation` releases a reservation exactly once, `order_state` keeps the timeout
//! cancel and the payment from both winning and projects an order's status by version. What
//! more than one of them uses is here.

mod compensation;
mod order_state;
mod relay;
mod scanner;

/// A fixed reading of a consumer group's progress (the order-create group's for the scanner,
/// the compensation group's for the relay; the failover sweep's too).
pub(crate) struct Progress(pub(crate) Option<i64>);

#[async_trait::async_trait]
impl seckill::roles::scan::unconsumed::ProgressReader for Progress {
    async fn taken_until_ms(&self) -> Option<i64> {
        self.0
    }
}

/// Two reservations of `activity` (buyers 1 and 2) the broker confirmed at `sent_at` (epoch
/// ms); only the first copy is sent here and becomes an order, the second stays stranded (its
/// broker died holding it, or its order's commit was lost). Returns (taken, stranded).
pub(crate) async fn one_taken_one_stranded(
    env: &crate::common::TestEnv,
    redis: &seckill::redis::RedisStore,
    publisher: &std::sync::Arc<dyn seckill::mq::Publisher>,
    activity: i64,
    sent_at: i64,
) -> (seckill::domain::Ids, seckill::domain::Ids) {
    let (taken, stranded) = (
        crate::common::reserve_only(redis, activity, 1, 60_000).await,
        crate::common::reserve_only(redis, activity, 2, 60_000).await,
    );
    for ids in [&taken, &stranded] {
        let verdict = redis
            .sends()
            .mark_sent(
                activity,
                &ids.reservation_id,
                &ids.message_id,
                "b-1",
                sent_at,
            )
            .await
            .unwrap();
        assert_eq!(verdict, "OK");
    }
    let topic = env.names().order_create_topic;
    let fields = redis
        .reservation(activity, &taken.reservation_id)
        .await
        .unwrap();
    let event = seckill::roles::scan::event_from_reservation(&fields, 1).unwrap();
    let out = publisher
        .send(seckill::mq::order_create_message(&topic, &event), 3_000)
        .await;
    assert!(
        matches!(out, seckill::mq::SendOutcome::Confirmed { .. }),
        "{out:?}"
    );
    crate::common::eventually(30, "the first order", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    (taken, stranded)
}
