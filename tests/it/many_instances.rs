//! Every long-running role many times at once, on Redis Cluster: two `api`, three `consume`,
//! two `scan`, two `timeout-cancel`, each on its own ports, and `seckill reconcile` run by two
//! hosts at the same moment. A sale through both APIs with payments and expiry: nothing is done
//! twice and nothing is lost (docs/SCALING.md).

use crate::common;

use crate::common::{cli_async, spawn_listening, wait_ready, Proc, TestEnv};

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

    common::sale::sell_pay_and_expire(&env, &apis, 7600, STOCK, BUYERS).await;

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
