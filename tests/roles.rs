//! The real binaries as operators run them: `seckill api` and `seckill consume` as separate
//! processes configured through `SECKILL__...` variables, their /readyz and /metrics, and
//! SIGTERM: the consumer stops mid-load, drains, exits 0, and a restarted consumer finishes
//! the work with no order lost or doubled.

// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{eventually, TestEnv};
use serde_json::json;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process that is killed if the test fails before stopping it.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(env: &TestEnv, args: &[&str], extra: &[(&str, String)]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test")
        .env("SECKILL__ENV", &env.settings.env)
        .env("SECKILL__PG__SCHEMA", &env.settings.pg.schema)
        .env("SECKILL__REDIS__KEY_PREFIX", &env.settings.redis.key_prefix)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    Proc(cmd.spawn().expect("binary starts"))
}

fn terminate(proc: &mut Proc, secs: u64) -> std::process::ExitStatus {
    let child = &mut proc.0;
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("process did not exit within {secs}s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

async fn wait_ready(url: &str) {
    let url = url.to_string();
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

#[tokio::test]
async fn roles_serve_metrics_and_a_consumer_stopped_mid_load_loses_and_doubles_nothing() {
    let env = TestEnv::new(true).await;
    env.activity(700, 1, 150).await;
    let (api_port, c1_port, c2_port) = (free_port(), free_port(), free_port());
    let mut api = spawn(
        &env,
        &["api"],
        &[("SECKILL__API__LISTEN", format!("127.0.0.1:{api_port}"))],
    );
    let mut consumer = spawn(
        &env,
        &["consume", "--workers", "2"],
        &[(
            "SECKILL__CONSUMER__METRICS_LISTEN",
            format!("127.0.0.1:{c1_port}"),
        )],
    );
    wait_ready(&format!("http://127.0.0.1:{api_port}/readyz")).await;
    wait_ready(&format!("http://127.0.0.1:{c1_port}/readyz")).await;

    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{api_port}/v1/activities/700/skus/1/reservations");
    let mut accepted = 0;
    for user in 1..=200 {
        let r = client
            .post(&url)
            .json(&json!({"user_id": user, "request_id": format!("r{user}"), "quantity": 1}))
            .send()
            .await
            .unwrap();
        if r.status() == reqwest::StatusCode::ACCEPTED {
            accepted += 1;
        }
        if user == 100 {
            // Stop the consumer while it is working through the first half.
            let status = terminate(&mut consumer, 40);
            assert!(status.success(), "consumer exit on SIGTERM: {status:?}");
        }
    }
    assert_eq!(accepted, 150);
    let metrics = reqwest::get(format!("http://127.0.0.1:{api_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "mq_publish_total",
        "reservation_total",
        "mq_publish_latency_seconds",
        "http_request_duration_seconds",
    ] {
        assert!(metrics.contains(name), "api /metrics lacks {name}");
    }

    // A new consumer finishes the work.
    let mut consumer = spawn(
        &env,
        &["consume", "--workers", "2"],
        &[(
            "SECKILL__CONSUMER__METRICS_LISTEN",
            format!("127.0.0.1:{c2_port}"),
        )],
    );
    wait_ready(&format!("http://127.0.0.1:{c2_port}/readyz")).await;
    eventually(90, "150 orders", || async {
        env.count("SELECT count(*) FROM orders").await == 150
    })
    .await;
    let metrics = reqwest::get(format!("http://127.0.0.1:{c2_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "mq_consume_total",
        "order_tx_latency_seconds",
        "pg_pool_wait_seconds",
        "worker_budget",
    ] {
        assert!(metrics.contains(name), "consumer /metrics lacks {name}");
    }
    assert!(terminate(&mut consumer, 40).success());
    assert!(terminate(&mut api, 20).success());

    let pool = env.pool(1).await;
    let report = seckill::invariants::check(
        &**pool.get().await.unwrap(),
        &env.redis().await,
        &env.settings.names().order_create_group,
        700,
        1,
    )
    .await
    .unwrap();
    assert!(report.ok(), "{:?}", report.violations);
    assert_eq!(report.figures.valid_orders, 150);
    env.cleanup().await;
}
