//! Faults between the half message and its end, in the real binary aborted at a failpoint
//! (docs/architecture/invariants.md): the API killed after the half before its transaction
//! (ROLLBACK, nothing delivered), after its commit before the end (COMMIT, delivered once),
//! PostgreSQL unreachable during the check-backs (UNKNOWN, asked again, then COMMIT), and a
//! timeout-cancel batch killed after its commit (every event of the batch committed).

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::expire_every_order;
use crate::common::{
    caught_up, collect_events, created_orders, eventually, free_port, notify_payment, spawn,
    TestEnv,
};
use seckill::config::EventDelivery;
use seckill::domain::events::order_paid_event_id;
use seckill::mq::rocketmq::{RocketTransactionProducer, TransactionOptions};
use seckill::mq::{Delivery, LocalOutcome, TransactionChecker, TransactionPublisher};
use seckill::services::half_messages::PgChecker;
use serde_json::json;

/// The answers the check-backs of one event got.
struct Answers {
    inner: PgChecker,
    event_id: String,
    seen: Mutex<Vec<LocalOutcome>>,
}

#[async_trait::async_trait]
impl TransactionChecker for Answers {
    async fn check(&self, msg: &Delivery) -> LocalOutcome {
        let answer = self.inner.check(msg).await;
        if msg.properties.get("message_id") == Some(&self.event_id) {
            self.seen.lock().unwrap().push(answer);
        }
        answer
    }
}

impl Answers {
    fn seen(&self) -> Vec<LocalOutcome> {
        self.seen.lock().unwrap().clone()
    }
}

/// A member of the test's transaction producer group that only answers check-backs, from
/// `pool`.
async fn answering(
    env: &TestEnv,
    pool: deadpool_postgres::Pool,
    event_id: &str,
) -> (RocketTransactionProducer, Arc<Answers>) {
    let answers = Arc::new(Answers {
        inner: PgChecker::new(pool, Duration::from_secs(3)),
        event_id: event_id.to_string(),
        seen: Mutex::default(),
    });
    let names = env.names();
    let producer = RocketTransactionProducer::start(
        &seckill::mq::runtime().unwrap(),
        TransactionOptions {
            name_srv: env.settings.mq.name_server.clone(),
            group: names.transaction_producer_group,
            topics: vec![names.order_event_topic],
            send_timeout_ms: 3_000,
            retries: 0,
            outcome_wait: Duration::from_secs(4),
            in_flight: 1,
            check_threads: 2,
            check_timeout: Duration::from_secs(4),
        },
        answers.clone(),
    )
    .await
    .unwrap();
    (producer, answers)
}

/// `seckill api` in transaction mode with `failpoints`; its port.
async fn api_process(env: &TestEnv, failpoints: &str) -> (common::Proc, u16) {
    let port = free_port();
    let p = spawn(
        env,
        &["api"],
        failpoints,
        &[
            ("SECKILL__API__LISTEN", format!("127.0.0.1:{port}")),
            ("SECKILL__EVENTS__ORDER_PAID", "transaction".to_string()),
        ],
    );
    common::wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    (p, port)
}

/// A notification to an API that dies on it: no answer.
async fn notify_dying(port: u16, order_id: &str) {
    let body =
        json!({"order_id": order_id, "payment_id": "pay-1", "amount_cents": 100}).to_string();
    let secret = &env_secret();
    let sig =
        seckill::auth::signature::sign(secret, chrono::Utc::now().timestamp(), body.as_bytes());
    let r = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/v1/payments/notifications"))
        .header("content-type", "application/json")
        .header("seckill-signature", sig)
        .body(body)
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    assert!(r.is_err(), "the API answered instead of dying: {r:?}");
}

fn env_secret() -> secrecy::SecretString {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    seckill::config::Settings::load_from(&dir)
        .unwrap()
        .payments
        .webhook_secrets[0]
        .clone()
}

#[tokio::test]
async fn a_producer_killed_after_the_half_before_its_transaction_is_rolled_back_by_the_check() {
    let env = TestEnv::with_topics().await;
    env.activity(1405, 1, 5).await;
    let orders = created_orders(&env, 1405, &[1]).await;
    let oid = orders[0].order_id.clone();
    let event_id = order_paid_event_id(&oid, 2);
    let (collector, consumer, group) = collect_events(&env).await;
    let (mut api, port) = api_process(&env, "tx-after-half-before-local=return").await;
    notify_dying(port, &oid).await;
    api.wait_exit(10).await;

    // Another member of the group is asked about the half, and answers ROLLBACK once the
    // deadline passed: the order is unpaid and no row exists.
    let (producer, answers) = answering(&env, env.pool(2).await, &event_id).await;
    eventually(60, "the broker asked and got ROLLBACK", || async {
        answers.seen().contains(&LocalOutcome::Rollback)
    })
    .await;
    assert!(!answers.seen().contains(&LocalOutcome::Commit));
    let names = env.names();
    caught_up(&env, &group, &names.order_event_topic).await;
    assert!(collector.paid(&oid).is_empty(), "nothing delivered");
    assert_eq!(
        env.count("SELECT count(*) FROM orders WHERE status = 'PAID'")
            .await,
        0
    );

    // The provider re-sends to a healthy instance: paid, and ORDER_PAID delivered once.
    let mut settings = env.settings.clone();
    settings.events.order_paid = Some(EventDelivery::Transaction);
    let healthy = common::start_api(settings).await;
    let (status, body) = notify_payment(&healthy.base, &oid, "pay-1", 100).await;
    assert_eq!(
        (status.as_u16(), &body["repeat"]),
        (200, &json!(false)),
        "{body}"
    );
    eventually(30, "ORDER_PAID delivered", || async {
        !collector.paid(&oid).is_empty()
    })
    .await;
    caught_up(&env, &group, &names.order_event_topic).await;
    eprintln!("evidence: check-back answers {:?}", answers.seen());
    assert_eq!(collector.paid(&oid).len(), 1);
    healthy.stop.cancel();
    healthy.server.await.unwrap().unwrap();
    producer.shutdown().await;
    assert!(consumer.shutdown().await);
    env.cleanup().await;
}

/// The producer killed after its local commit, before the commit message: the check-back
/// answers COMMIT, from a checker whose PostgreSQL is first unreachable when `stall_first`.
async fn killed_after_commit(activity: i64, stall_first: bool) {
    let env = TestEnv::with_topics().await;
    env.activity(activity, 1, 5).await;
    let orders = created_orders(&env, activity, &[1]).await;
    let oid = orders[0].order_id.clone();
    let event_id = order_paid_event_id(&oid, 2);
    let (collector, consumer, group) = collect_events(&env).await;
    let (mut api, port) = api_process(&env, "tx-after-commit-before-end=return").await;
    notify_dying(port, &oid).await;
    api.wait_exit(10).await;
    assert_eq!(
        env.count(
            "SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID' AND status = 'TRANSACTION'"
        )
        .await,
        1,
        "committed, never marked"
    );

    let proxy = common::StallProxy::start("127.0.0.1:5432").await;
    let mut pg = env.settings.pg.clone();
    pg.url = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        proxy.addr.port()
    )
    .into();
    let pool = seckill::pg::connect_pool(&pg, 2).await.unwrap();
    proxy.stall(stall_first);
    let (producer, answers) = answering(&env, pool, &event_id).await;
    if stall_first {
        eventually(
            60,
            "the broker asked while PostgreSQL was unreachable",
            || async { answers.seen().len() >= 2 },
        )
        .await;
        assert!(
            answers.seen().iter().all(|a| *a == LocalOutcome::Unknown),
            "{:?}",
            answers.seen()
        );
        assert!(collector.paid(&oid).is_empty(), "UNKNOWN delivers nothing");
        proxy.stall(false);
    }
    eventually(60, "the broker asked and got COMMIT", || async {
        answers.seen().contains(&LocalOutcome::Commit)
    })
    .await;
    eventually(30, "ORDER_PAID delivered", || async {
        !collector.paid(&oid).is_empty()
    })
    .await;
    let names = env.names();
    caught_up(&env, &group, &names.order_event_topic).await;
    let paid = collector.paid(&oid);
    assert_eq!(paid.len(), 1, "delivered once");
    assert_eq!(paid[0].properties["message_id"], event_id);
    assert!(!answers.seen().contains(&LocalOutcome::Rollback));
    eprintln!("evidence: check-back answers {:?}", answers.seen());
    producer.shutdown().await;
    assert!(consumer.shutdown().await);
    env.cleanup().await;
}

#[tokio::test]
async fn a_producer_killed_after_its_commit_before_the_end_is_committed_by_the_check() {
    killed_after_commit(1406, false).await;
}

#[tokio::test]
async fn a_check_back_while_postgresql_is_unreachable_answers_unknown_and_is_asked_again() {
    killed_after_commit(1407, true).await;
}

#[tokio::test]
async fn a_timeout_cancel_killed_after_its_commit_has_its_batch_committed_by_the_checks() {
    let env = TestEnv::with_topics().await;
    env.activity(1410, 1, 5).await;
    let orders = created_orders(&env, 1410, &[1, 2]).await;
    let pool = env.pool(1).await;
    expire_every_order(&pool).await;
    let (collector, consumer, group) = collect_events(&env).await;
    // The sweep cancels both in one batch, then the process dies before ending the halves.
    let port = free_port();
    let mut cancel = spawn(
        &env,
        &["timeout-cancel"],
        "tx-cancel-after-commit-before-end=return",
        &[
            (
                "SECKILL__TIMEOUT__METRICS_LISTEN",
                format!("127.0.0.1:{port}"),
            ),
            ("SECKILL__EVENTS__ORDER_CANCELED", "transaction".to_string()),
        ],
    );
    cancel.wait_exit(60).await;
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_CANCELED' AND status = 'TRANSACTION'")
            .await,
        2,
        "both committed, never marked"
    );
    let first = format!("{}.v2.ORDER_CANCELED", orders[0].order_id);
    let (producer, answers) = answering(&env, env.pool(2).await, &first).await;
    eventually(60, "the broker asked and got COMMIT", || async {
        answers.seen().contains(&LocalOutcome::Commit)
    })
    .await;
    let names = env.names();
    for ids in &orders {
        let oid = &ids.order_id;
        eventually(60, "ORDER_CANCELED delivered", || async {
            !collector.tagged("ORDER_CANCELED", oid).is_empty()
        })
        .await;
    }
    caught_up(&env, &group, &names.order_event_topic).await;
    for ids in &orders {
        assert_eq!(collector.tagged("ORDER_CANCELED", &ids.order_id).len(), 1);
    }
    eprintln!("evidence: check-back answers {:?}", answers.seen());
    producer.shutdown().await;
    assert!(consumer.shutdown().await);
    env.cleanup().await;
}
