//! The fast lane against the real services (docs/architecture/roles.md#the-fast-lane): a consumer
//! that starts behind sheds the reservations that would expire before their turn, ahead of the
//! queue, gives their units back through compensation, and orders the valid ones.

use std::time::Duration;

use crate::common::*;

/// The fast lane sheds from an aged backlog the reservations that would expire before their order
/// and those already expired, and their units come back once; the valid ones become orders.
///
/// One story: the backlog ages before the consumer starts, and what the consumer sheds and orders
/// are the reservations of that backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_near_expiry_sheds_the_doomed_and_gives_their_units_back() {
    let env = TestEnv::with_topics().await;
    // Reservations valid 6 s (under the 5 s margin once 2.5 s behind), 300 s, and 1 s
    // (expired by the time the consumer starts).
    let (expiring, valid, expired) = (901, 902, 903);
    env.activity_valid_for(expiring, &[(1, 50)], 1, 6).await;
    env.activity_valid_for(valid, &[(1, 50)], 1, 300).await;
    env.activity_valid_for(expired, &[(1, 50)], 1, 1).await;
    let api = start_api(env.settings.clone()).await;
    for activity in [expiring, valid, expired] {
        for user in 1..=10 {
            let (status, body) = reserve_as(
                &api.base,
                activity,
                1,
                user,
                &format!("req-{activity}-{user}"),
            )
            .await;
            assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{body}");
        }
    }
    // No consumer yet: the backlog ages past the lane's threshold (2 s).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let (mut scan, _) = spawn_listening(&env, &["scan"], "SECKILL__SCAN__METRICS_LISTEN", &[]);
    let port = free_port();
    let mut consume = spawn(
        &env,
        &["consume", "--workers", "2"],
        "",
        &[
            (
                "SECKILL__CONSUMER__METRICS_LISTEN",
                format!("127.0.0.1:{port}"),
            ),
            ("SECKILL__CONSUMER__FAST_LANE_BACKLOG_MS", "2000".into()),
            ("SECKILL__CONSUMER__FAST_LANE_MARGIN_MS", "5000".into()),
        ],
    );
    eventually(60, "every reservation decided", || async {
        env.count("SELECT count(*) FROM reservations").await == 30
    })
    .await;
    let reasons = |activity: i64| {
        let env = &env;
        async move {
            env.count(&format!(
                "SELECT count(*) FROM reservations WHERE activity_id = {activity} \
                 AND status = 'REJECTED' AND reject_reason = \
                 (CASE WHEN {activity} = 901 THEN 'EXPIRING' ELSE 'EXPIRED' END)"
            ))
            .await
        }
    };
    assert_eq!(reasons(expiring).await, 10, "shed while still valid");
    assert_eq!(reasons(expired).await, 10, "past their validity");
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        10,
        "the valid ones ordered"
    );
    assert_eq!(
        env.count(&format!(
            "SELECT count(*) FROM orders WHERE activity_id = {valid}"
        ))
        .await,
        10
    );
    // The fast lane did it, not the batches reaching them in turn.
    assert_eq!(
        metric(port, "order_fast_lane_total", r#"reason="EXPIRING""#).await,
        10.0
    );
    assert_eq!(
        metric(port, "order_fast_lane_total", r#"reason="EXPIRED""#).await,
        10.0
    );
    // The shed units come back to Redis through compensation, once.
    for activity in [expiring, expired] {
        eventually(60, "the shed units back in Redis", || async {
            let r = env.invariants(activity, 1).await;
            r.ok() && r.figures.redis_remaining == 50 && r.figures.pending_compensations == 0
        })
        .await;
    }
    let r = env.invariants(valid, 1).await;
    assert!(r.ok(), "{:?}", r.violations);
    assert_eq!(r.figures.valid_orders, 10);
    assert!(consume.terminate(40).await.success());
    assert!(scan.terminate(20).await.success());
    api.stop.cancel();
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_the_lane_off_a_backlog_waits_its_turn() {
    let env = TestEnv::with_topics().await;
    env.activity_valid_for(904, &[(1, 50)], 1, 6).await;
    let api = start_api(env.settings.clone()).await;
    for user in 1..=10 {
        let (status, _) = reserve_as(&api.base, 904, 1, user, &format!("req-{user}")).await;
        assert_eq!(status, reqwest::StatusCode::ACCEPTED);
    }
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let (mut consume, port) = spawn_consume(&env, "2", "");
    eventually(60, "every reservation decided", || async {
        env.count("SELECT count(*) FROM reservations").await == 10
    })
    .await;
    // Still valid when reached: ordered, nothing shed.
    assert_eq!(env.count("SELECT count(*) FROM orders").await, 10);
    assert_eq!(metric(port, "order_fast_lane_total", "").await, 0.0);
    assert!(consume.terminate(40).await.success());
    api.stop.cancel();
    env.cleanup().await;
}
