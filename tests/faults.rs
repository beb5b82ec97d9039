//! Processes killed at the injection points of §29.3 (built with `--features failpoints`,
//! which `make test` uses): the real binary aborts at the failpoint like a SIGKILL, and the
//! recovery path finishes the work with exactly one effect.
#![cfg(feature = "failpoints")]
// The RocketMQ client's futures are deeply nested.
#![recursion_limit = "256"]

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{eventually, TestEnv};
use seckill::mq::{BatchHandler, ConsumeDecision, Delivery};
use seckill::roles::consume::OrderCreateHandler;
use serde_json::json;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn(env: &TestEnv, args: &[&str], failpoints: &str, extra: &[(&str, String)]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seckill"));
    cmd.args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("SECKILL_ENV", "test")
        .env("SECKILL__ENV", &env.settings.env)
        .env("SECKILL__PG__SCHEMA", &env.settings.pg.schema)
        .env("SECKILL__REDIS__KEY_PREFIX", &env.settings.redis.key_prefix)
        .env("FAILPOINTS", failpoints)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    Proc(cmd.spawn().expect("binary starts"))
}

async fn wait_exit(p: &mut Proc, secs: u64) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(s) = p.0.try_wait().unwrap() {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "process still alive after {secs}s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_ready(url: String) {
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
async fn api_killed_after_the_reservation_before_the_send_the_scanner_sends_it_once() {
    let env = TestEnv::new(true).await;
    env.activity(900, 1, 5).await;
    let port = free_port();
    let mut api = spawn(
        &env,
        &["api"],
        "api-after-reserve-before-send=return",
        &[("SECKILL__API__LISTEN", format!("127.0.0.1:{port}"))],
    );
    wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    let r = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{port}/v1/activities/900/skus/1/reservations"
        ))
        .json(&json!({"user_id": 5, "request_id": "killed", "quantity": 1}))
        .send()
        .await;
    assert!(r.is_err(), "the process died mid-request: {r:?}");
    let status = wait_exit(&mut api, 10).await;
    assert!(!status.success(), "aborted: {status:?}");

    let redis = env.redis().await;
    assert_eq!(
        redis.sku_stock(900, 1).await.unwrap(),
        Some((5, 4)),
        "reserved, not released"
    );
    assert_eq!(redis.pending_count(900).await.unwrap(), 1);
    let handler = Arc::new(OrderCreateHandler::new(env.pool(3).await, &env.settings, 2));
    let consumer = seckill::mq::start_order_create_consumer(&env.settings, handler, 2)
        .await
        .unwrap();
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let scanner = seckill::roles::scan::Scanner::new(
        redis.clone(),
        publisher,
        Arc::new(env.settings.clone()),
    );
    eventually(20, "the scanner sent it", || async {
        scanner.scan_once().await.unwrap().confirmed == 1
    })
    .await;
    eventually(30, "one order", || async {
        env.count("SELECT count(*) FROM orders").await == 1
    })
    .await;
    let census = redis.reservation_census(900, 1).await.unwrap();
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    let mid: String = c
        .query_one("SELECT message_id FROM reservations", &[])
        .await
        .unwrap()
        .get(0);
    let fields = redis
        .reservation(900, &census.reserved_ids[0])
        .await
        .unwrap();
    assert_eq!(
        fields["message_id"], mid,
        "the message_id minted before the crash"
    );
    let report = seckill::invariants::check(
        &**c,
        &redis,
        &env.settings.names().order_create_group,
        900,
        1,
    )
    .await
    .unwrap();
    assert!(report.ok(), "{:?}", report.violations);
    drop(c);
    consumer.shutdown().await;
    env.cleanup().await;
}

/// Counts what the broker hands over, then lets the real handler decide.
struct Counting {
    inner: OrderCreateHandler,
    seen: AtomicUsize,
}

#[async_trait::async_trait]
impl BatchHandler for Counting {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        self.seen.fetch_add(batch.len(), Ordering::SeqCst);
        self.inner.handle(batch).await
    }
}

#[tokio::test]
async fn consumer_killed_after_commit_before_ack_the_redelivery_hits_the_inbox() {
    let env = TestEnv::new(true).await;
    env.activity(901, 1, 5).await;
    let mport = free_port();
    let mut consumer = spawn(
        &env,
        &["consume", "--workers", "1"],
        "consume-after-commit-before-ack=return",
        &[(
            "SECKILL__CONSUMER__METRICS_LISTEN",
            format!("127.0.0.1:{mport}"),
        )],
    );
    wait_ready(format!("http://127.0.0.1:{mport}/readyz")).await;
    // One reservation through the real hot path, in-process.
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let state = seckill::roles::api::build_state(Arc::new(env.settings.clone()), publisher)
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(seckill::roles::api::serve(listener, state, stop.clone()));
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/activities/901/skus/1/reservations"))
        .json(&json!({"user_id": 8, "request_id": "r", "quantity": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::ACCEPTED);
    let status = wait_exit(&mut consumer, 30).await;
    assert!(!status.success(), "aborted after the commit: {status:?}");
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        1,
        "committed before the crash"
    );

    let handler = Arc::new(Counting {
        inner: OrderCreateHandler::new(env.pool(2).await, &env.settings, 1),
        seen: AtomicUsize::new(0),
    });
    let again = seckill::mq::start_order_create_consumer(&env.settings, handler.clone(), 1)
        .await
        .unwrap();
    eventually(60, "the un-ACKed message is redelivered", || async {
        handler.seen.load(Ordering::SeqCst) >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        env.count("SELECT count(*) FROM orders").await,
        1,
        "the inbox absorbed it"
    );
    assert_eq!(env.count("SELECT count(*) FROM consumer_inbox").await, 1);
    assert_eq!(env.count("SELECT count(*) FROM stock_ledger").await, 1);
    again.shutdown().await;
    stop.cancel();
    env.cleanup().await;
}
