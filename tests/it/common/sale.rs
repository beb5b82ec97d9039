//! A whole sale with its payments and expiries, judged as every multi-role test judges one.

use futures::StreamExt;

use super::{eventually, TestEnv};

/// Sells `stock` units of `activity`'s SKU 1 to `buyers` buyers through the APIs on `apis` (in
/// turn), pays half the orders through them and lets the rest expire (the consumers' pay window
/// must be short), then asserts the verdict: exactly `stock` accepted and the rest sold out,
/// an order for every reservation, each unpaid order cancelled once and its unit back in
/// PostgreSQL and Redis, the invariants, every outbox event sent.
pub async fn sell_pay_and_expire(
    env: &TestEnv,
    apis: &[u16],
    activity: i64,
    stock: i32,
    buyers: i64,
) {
    // The sale: buyers take the APIs in turn, 16 at a time.
    let answers: Vec<u16> = futures::stream::iter(1..=buyers)
        .map(|user| {
            let base = format!("http://127.0.0.1:{}", apis[user as usize % apis.len()]);
            async move {
                let (status, _) = super::reserve_as(&base, activity, 1, user, "once").await;
                status.as_u16()
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let accepted = answers.iter().filter(|&&s| s == 202).count();
    let sold_out = answers.iter().filter(|&&s| s == 410).count();
    assert_eq!(
        (accepted, sold_out),
        (stock as usize, (buyers - i64::from(stock)) as usize),
        "{answers:?}"
    );
    eventually(60, "an order for every reservation", || async {
        env.count("SELECT count(*) FROM orders").await == i64::from(stock)
    })
    .await;

    // Half the buyers pay, through one API or the other; the rest let the window pass.
    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let orders: Vec<String> = client
        .query("SELECT order_id FROM orders ORDER BY order_id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let paid = orders.len() / 2;
    for (i, order) in orders.iter().take(paid).enumerate() {
        let base = format!("http://127.0.0.1:{}", apis[i % apis.len()]);
        let (status, body) = super::notify_payment(&base, order, &format!("pay-{i}"), 100).await;
        assert_eq!(status, 200, "{body}");
    }
    eventually(
        90,
        "every unpaid order cancelled after its window",
        || async {
            env.count("SELECT count(*) FROM orders WHERE status = 'CANCELED'")
                .await
                == (orders.len() - paid) as i64
        },
    )
    .await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE status = 'PAID'")
            .await,
        paid as i64
    );
    // Each cancellation's unit back once, in PostgreSQL and in Redis.
    eventually(60, "the cancelled units back in Redis", || async {
        let r = env.invariants(activity, 1).await;
        r.ok()
            && r.figures.unrecorded == 0
            && r.figures.valid_orders == paid as i64
            && r.figures.redis_remaining == i64::from(stock) - paid as i64
    })
    .await;
    let r = env.invariants(activity, 1).await;
    assert!(r.ok(), "{:?}", r.violations);
    assert_eq!(r.figures.pg_remaining, i64::from(stock) - paid as i64);
    // Every outbox event was sent and none twice: one row per id, all SENT.
    eventually(30, "the outbox drained", || async {
        env.count("SELECT count(*) FROM event_outbox WHERE status <> 'SENT'")
            .await
            == 0
    })
    .await;
}
