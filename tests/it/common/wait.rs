//! Waiting for the pipeline to get somewhere, without a fixed sleep: polls with a bound.

use std::time::{Duration, Instant};

use super::*;

/// Waits until every Redis reservation of SKU 1 is recorded in PostgreSQL and the invariants
/// hold, then asserts the SKU sold out exactly (`stock` valid orders).
pub async fn sold_out_converged(
    env: &TestEnv,
    stock: i32,
    activity: i64,
) -> seckill::invariants::Report {
    eventually(
        240,
        "the pipeline converged with every invariant holding",
        || async {
            let r = env.invariants(activity, 1).await;
            r.ok() && r.figures.unrecorded == 0
        },
    )
    .await;
    let r = env.invariants(activity, 1).await;
    assert_eq!(
        r.figures.valid_orders,
        i64::from(stock),
        "sold out exactly: {:?}",
        r.figures
    );
    r
}

/// Polls `f` until it returns true or `secs` pass.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if f().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {secs}s waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `group` has consumed every message on `topic`: lag 0, as the broker reads it
/// from the group's committed offsets (a consumer commits them every few seconds).
pub async fn caught_up(env: &TestEnv, group: &str, topic: &str) {
    let probe = seckill::mq::rocketmq::LagProbe::new(
        &seckill::mq::runtime().unwrap(),
        &env.settings.mq.name_server,
    )
    .await
    .unwrap();
    eventually(60, &format!("{group} caught up on {topic}"), || async {
        matches!(probe.lag(group, topic).await, Ok(lag) if lag.messages == 0)
    })
    .await;
}

/// Waits until the order-create group has consumed every message on its topic and no
/// reservation of the activity waits for a re-send. From then on nothing can create another
/// order for it, so a count taken after this proves an absence without a fixed sleep.
pub async fn quiescent(env: &TestEnv, activity_id: i64) {
    let names = env.settings.names();
    let redis = env.redis().await;
    eventually(60, "no reservation waits for a re-send", || async {
        redis.recovery().pending_count(activity_id).await.unwrap() == 0
    })
    .await;
    caught_up(env, &names.order_create_group, &names.order_create_topic).await;
}

/// Waits until `url` answers 2xx.
pub async fn wait_ready(url: String) {
    eventually(30, &url.clone(), || {
        let url = url.clone();
        async move {
            reqwest::get(&url)
                .await
                .map(|r| r.status().is_success())
                .unwrap_or(false)
        }
    })
    .await;
}
