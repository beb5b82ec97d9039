//! Every long-running role many times at once, on Redis Cluster: two `api`, three `consume`,
//! two `scan`, two `timeout-cancel`, each on its own ports, and `seckill reconcile` run by two
//! hosts at the same moment. A sale through both APIs with payments and expiry: nothing is done
//! twice and nothing is lost (docs/SCALING.md).

use crate::common;

use crate::common::{cli_async, eventually, spawn_listening, wait_ready, Proc, TestEnv};
use futures::StreamExt;

const STOCK: i32 = 60;
const BUYERS: i64 = 150;
/// Seconds a buyer has to pay: short, so the unpaid orders expire during the test.
const PAY_WINDOW: &str = "6";

#[tokio::test]
async fn every_role_twice_or_more_sells_pays_and_cancels_each_order_once() {
    let env = TestEnv::with_topics().await.on_redis_cluster();
    env.activity(7600, 1, STOCK).await;
    let mut procs: Vec<(Proc, u16)> = Vec::new();
    for _ in 0..2 {
        procs.push(spawn_listening(&env, &["api"], "SECKILL__API__LISTEN", &[]));
    }
    let apis: Vec<u16> = procs.iter().map(|(_, p)| *p).collect();
    for _ in 0..3 {
        procs.push(spawn_listening(
            &env,
            &["consume", "--workers", "2"],
            "SECKILL__CONSUMER__METRICS_LISTEN",
            &[
                ("SECKILL__PG__CONSUME_INSTANCES", "3"),
                ("SECKILL__CONSUMER__PAY_WINDOW_SECS", PAY_WINDOW),
            ],
        ));
    }
    for _ in 0..2 {
        procs.push(spawn_listening(
            &env,
            &["scan"],
            "SECKILL__SCAN__METRICS_LISTEN",
            &[],
        ));
        procs.push(spawn_listening(
            &env,
            &["timeout-cancel"],
            "SECKILL__TIMEOUT__METRICS_LISTEN",
            &[("SECKILL__PG__TIMEOUT_CANCEL_INSTANCES", "2")],
        ));
    }
    for (_, port) in &procs {
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    }

    // The sale: buyers alternate between the two APIs, 16 at a time.
    let answers: Vec<u16> = futures::stream::iter(1..=BUYERS)
        .map(|user| {
            let base = format!("http://127.0.0.1:{}", apis[(user % 2) as usize]);
            async move {
                let (status, _) = common::reserve_as(&base, 7600, 1, user, "once").await;
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
        (STOCK as usize, (BUYERS - i64::from(STOCK)) as usize),
        "{answers:?}"
    );
    eventually(60, "an order for every reservation", || async {
        env.count("SELECT count(*) FROM orders").await == i64::from(STOCK)
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
        let base = format!("http://127.0.0.1:{}", apis[i % 2]);
        let (status, body) = common::notify_payment(&base, order, &format!("pay-{i}"), 100).await;
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
        let r = env.invariants(7600, 1).await;
        r.ok()
            && r.figures.unrecorded == 0
            && r.figures.valid_orders == paid as i64
            && r.figures.redis_remaining == i64::from(STOCK) - paid as i64
    })
    .await;
    let r = env.invariants(7600, 1).await;
    assert!(r.ok(), "{:?}", r.violations);
    assert_eq!(r.figures.pg_remaining, i64::from(STOCK) - paid as i64);
    // Every outbox event was sent and none twice: one row per id, all SENT.
    eventually(30, "the outbox drained", || async {
        env.count("SELECT count(*) FROM event_outbox WHERE status <> 'SENT'")
            .await
            == 0
    })
    .await;

    // Reconcile on two cron hosts at the same moment: both find no drift.
    let (a, b) = tokio::join!(
        cli_async(&env, &["reconcile", "--grace-secs", "0", "--fail-on-drift"]),
        cli_async(&env, &["reconcile", "--grace-secs", "0", "--fail-on-drift"]),
    );
    for out in [a, b] {
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    for (mut p, _) in procs {
        assert!(p.terminate(40).await.success(), "a role exited non-zero");
    }
    env.cleanup().await;
}
