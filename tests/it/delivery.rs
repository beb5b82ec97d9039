//! ORDER_PAID delivered either way (docs/architecture/messages.md#delivering-events): through the
//! outbox and its relay (`events.order_paid = "outbox"`), or as a RocketMQ transaction message
//! (`"transaction"`). Consumers get the same message in both; reconcile finds a missing one in
//! either; the check-back answers from PostgreSQL alone, and the faults between the half
//! message and its end are covered by it: a producer killed before its local transaction
//! (ROLLBACK, nothing delivered), killed after its commit (COMMIT, delivered once), and
//! PostgreSQL unreachable while the broker asks (UNKNOWN, asked again).

use crate::common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{
    caught_up, collect_events, created_orders, eventually, free_port, notify_payment, spawn,
    TestEnv,
};
use seckill::config::EventDelivery;
use seckill::domain::events::order_paid_event_id;
use seckill::mq::rocketmq::{RocketTransactionProducer, TransactionOptions};
use seckill::mq::{Delivery, LocalOutcome, TransactionChecker, TransactionPublisher};
use seckill::roles::half_messages::{PgChecker, DEADLINE_PROPERTY};
use seckill::roles::scan::Relay;
use serde_json::json;

/// The properties the pipeline sets (lower case; the broker's own are upper case).
fn our_properties(d: &Delivery) -> BTreeSet<String> {
    d.properties
        .keys()
        .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c == '_') && !k.starts_with('_'))
        .map(str::to_owned)
        .collect()
}

/// One payment in `mode`, its notification sent twice: the ORDER_PAID consumers get, checked
/// against the event's row. Returns the properties it carried.
async fn paid_event_in(mode: EventDelivery, activity: i64) -> BTreeSet<String> {
    let mut env = TestEnv::with_topics().await;
    env.settings.events.order_paid = Some(mode);
    env.activity(activity, 1, 5).await;
    let orders = created_orders(&env, activity, &[1]).await;
    let oid = orders[0].order_id.clone();
    let names = env.names();
    let (collector, consumer, group) = collect_events(&env).await;
    let api = common::start_api(env.settings.clone()).await;

    let (status, body) = notify_payment(&api.base, &oid, "pay-1", 100).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["repeat"], json!(false));
    // The provider re-sends (it did not see the answer): the same answer, no second event.
    let (status, body) = notify_payment(&api.base, &oid, "pay-1", 100).await;
    assert_eq!((status.as_u16(), &body["repeat"]), (200, &json!(true)));

    // The relay sends what the outbox holds (the order's ORDER_CREATED in both modes; its
    // ORDER_PAID only in outbox mode).
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let relay = Relay::new(env.pool(2).await, publisher, Arc::new(env.settings.clone()));
    relay.relay_once().await.unwrap();

    eventually(30, "ORDER_PAID delivered", || async {
        !collector.paid(&oid).is_empty()
    })
    .await;
    caught_up(&env, &group, &names.order_event_topic).await;
    let paid = collector.paid(&oid);
    assert_eq!(paid.len(), 1, "{mode:?}: delivered exactly once");
    let d = &paid[0];

    let pool = env.pool(1).await;
    let client = pool.get().await.unwrap();
    let event_id = order_paid_event_id(&oid, 2);
    let row = client
        .query_one(
            "SELECT payload, status, delivery, aggregate_version, topic FROM event_outbox
             WHERE event_id = $1",
            &[&event_id],
        )
        .await
        .unwrap();
    let (payload, status, delivery): (serde_json::Value, String, String) =
        (row.get(0), row.get(1), row.get(2));
    assert_eq!(status, "SENT", "{mode:?}: the row is marked sent");
    assert_eq!(delivery, mode.label());
    assert_eq!(row.get::<_, Option<i32>>(3), Some(2));
    // What a consumer relies on: the topic, tag and key, the event id it deduplicates on,
    // the version it orders by, and the payload, exactly as the row holds them.
    assert_eq!(d.topic, row.get::<_, String>(4));
    assert_eq!(d.topic, names.order_event_topic);
    assert_eq!(&d.properties["message_id"], event_id);
    assert_eq!(&d.properties["event_type"], "ORDER_PAID");
    assert_eq!(&d.properties["aggregate_version"], "2");
    let body: serde_json::Value = serde_json::from_slice(&d.body).unwrap();
    assert_eq!(body, payload, "{mode:?}: the payload is the row's");
    assert_eq!(body["payment_id"], "pay-1");
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID'")
            .await,
        1,
        "one event row for one payment"
    );
    assert!(consumer.shutdown().await);
    api.stop.cancel();
    api.server.await.unwrap().unwrap();
    env.cleanup().await;
    our_properties(d)
}

#[tokio::test]
async fn order_paid_reaches_consumers_the_same_in_both_modes() {
    let outbox = paid_event_in(EventDelivery::Outbox, 1401).await;
    let transaction = paid_event_in(EventDelivery::Transaction, 1402).await;
    // The transaction message carries its local transaction's deadline besides (for the
    // check-back); nothing a consumer reads differs.
    let mut expected = outbox.clone();
    expected.insert(DEADLINE_PROPERTY.to_string());
    assert_eq!(transaction, expected, "outbox mode carried {outbox:?}");
}

#[tokio::test]
async fn a_half_message_the_broker_does_not_store_sends_the_event_through_the_outbox() {
    let mut env = TestEnv::without_topics().await;
    env.activity(1411, 1, 5).await;
    let orders = created_orders(&env, 1411, &[1]).await;
    let oid = orders[0].order_id.clone();
    // No name server there: no half message can be stored.
    env.settings.events.order_paid = Some(EventDelivery::Transaction);
    env.settings.mq.name_server = format!("127.0.0.1:{}", free_port());
    let api = common::start_api(env.settings.clone()).await;
    let (status, body) = notify_payment(&api.base, &oid, "pay-1", 100).await;
    assert_eq!(
        status, 200,
        "the payment does not wait for the broker: {body}"
    );
    let pool = env.pool(1).await;
    let row = pool
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT status, delivery FROM event_outbox WHERE event_id = $1",
            &[&order_paid_event_id(&oid, 2)],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        ("PENDING".to_string(), "outbox".to_string()),
        "the relay sends it once the broker is back"
    );
    api.stop.cancel();
    api.server.await.unwrap().unwrap();
    env.cleanup().await;
}

/// Two expired orders cancelled in one batch of the timeout cancel in `mode`: the
/// ORDER_CANCELED consumers get, checked against the rows. Returns the properties carried.
async fn canceled_events_in(mode: EventDelivery, activity: i64) -> BTreeSet<String> {
    use seckill::roles::timeout_cancel::TimeoutCancelHandler;
    let mut env = TestEnv::with_topics().await;
    env.settings.events.order_canceled = Some(mode);
    env.activity(activity, 1, 5).await;
    let orders = created_orders(&env, activity, &[1, 2]).await;
    let names = env.names();
    let (collector, consumer, group) = collect_events(&env).await;
    let pool = env.pool(3).await;
    expire_every_order(&pool).await;
    let mut handler = TimeoutCancelHandler::new(pool.clone(), &env.settings, 2);
    let mut producer = None;
    if mode == EventDelivery::Transaction {
        let tx = seckill::roles::half_messages::start(&env.settings, pool.clone(), 64)
            .await
            .unwrap();
        producer = Some(tx.clone());
        handler = handler.with_transactions(tx, 2_000);
    }
    let sweep = handler.sweep_once(Duration::ZERO, 32).await.unwrap();
    assert_eq!((sweep.found, sweep.canceled), (2, 2));
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let relay = Relay::new(env.pool(2).await, publisher, Arc::new(env.settings.clone()));
    relay.relay_once().await.unwrap();

    let client = pool.get().await.unwrap();
    let mut carried = BTreeSet::new();
    for ids in &orders {
        let oid = &ids.order_id;
        eventually(30, "ORDER_CANCELED delivered", || async {
            !collector.tagged("ORDER_CANCELED", oid).is_empty()
        })
        .await;
        caught_up(&env, &group, &names.order_event_topic).await;
        let got = collector.tagged("ORDER_CANCELED", oid);
        assert_eq!(got.len(), 1, "{mode:?}: delivered exactly once");
        let event_id = format!("{oid}.v2.ORDER_CANCELED");
        let row = client
            .query_one(
                "SELECT payload, status, delivery FROM event_outbox WHERE event_id = $1",
                &[&event_id],
            )
            .await
            .unwrap();
        let payload: serde_json::Value = row.get(0);
        assert_eq!(row.get::<_, String>(1), "SENT");
        assert_eq!(row.get::<_, String>(2), mode.label());
        assert_eq!(&got[0].properties["message_id"], event_id);
        assert_eq!(&got[0].properties["aggregate_version"], "2");
        let body: serde_json::Value = serde_json::from_slice(&got[0].body).unwrap();
        assert_eq!(body, payload, "{mode:?}: the payload is the row's");
        carried = our_properties(&got[0]);
    }
    // The releases go through the outbox in both modes.
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'RELEASE_RESERVATION' AND delivery = 'outbox'")
            .await,
        2
    );
    if let Some(tx) = producer {
        tx.shutdown().await;
    }
    assert!(consumer.shutdown().await);
    env.cleanup().await;
    carried
}

#[tokio::test]
async fn order_canceled_reaches_consumers_the_same_in_both_modes() {
    let outbox = canceled_events_in(EventDelivery::Outbox, 1408).await;
    let transaction = canceled_events_in(EventDelivery::Transaction, 1409).await;
    let mut expected = outbox.clone();
    expected.insert(DEADLINE_PROPERTY.to_string());
    assert_eq!(transaction, expected, "outbox mode carried {outbox:?}");
}

/// A check-back's message: the event `event_id` of order `order_id`, due by `deadline_ms`,
/// with the payload `{"v": 1}`.
fn check_of(order_id: &str, event_id: &str, deadline_ms: i64) -> Delivery {
    Delivery {
        keys: order_id.to_string(),
        body: br#"{"v": 1}"#.to_vec(),
        properties: seckill::mq::Properties::from([
            ("message_id".to_string(), event_id.to_string()),
            (DEADLINE_PROPERTY.to_string(), deadline_ms.to_string()),
        ]),
        ..Default::default()
    }
}

#[tokio::test]
async fn the_check_back_answers_from_postgresql_alone() {
    let env = TestEnv::without_topics().await;
    env.activity(1403, 1, 5).await;
    let orders = created_orders(&env, 1403, &[1]).await;
    let oid = orders[0].order_id.clone();
    let event_id = order_paid_event_id(&oid, 2);
    let checker = PgChecker::new(env.pool(2).await, Duration::from_secs(3));
    let now_ms = chrono::Utc::now().timestamp_millis();
    let ahead = now_ms + 60_000;
    let past = now_ms - 1;

    // No row: UNKNOWN while the local transaction may still commit, ROLLBACK once it cannot.
    assert_eq!(
        checker.check(&check_of(&oid, &event_id, ahead)).await,
        LocalOutcome::Unknown
    );
    assert_eq!(
        checker.check(&check_of(&oid, &event_id, past)).await,
        LocalOutcome::Rollback
    );
    // A message without its deadline or event id cannot be decided.
    let mut bare = check_of(&oid, &event_id, past);
    bare.properties.remove(DEADLINE_PROPERTY);
    assert_eq!(checker.check(&bare).await, LocalOutcome::Unknown);

    // A local transaction that changed the order and wrote its row, not yet committed: a
    // check past the deadline waits for it instead of answering ROLLBACK, and answers COMMIT
    // once it commits.
    let pool = env.pool(1).await;
    let mut local = pool.get().await.unwrap();
    let tx = local.transaction().await.unwrap();
    tx.execute(
        "UPDATE orders SET status = 'PAID', version = 2, payment_id = 'pay-x', paid_at = now()
         WHERE order_id = $1",
        &[&oid],
    )
    .await
    .unwrap();
    tx.execute(
        r#"INSERT INTO event_outbox (event_id, topic, tag, message_key, aggregate_id,
                                   aggregate_version, payload, activity_id, status, delivery)
         VALUES ($1, 't', 'ORDER_PAID', $2, $2, 2, '{"v": 1}', 1403, 'TRANSACTION', 'transaction')"#,
        &[&event_id, &oid],
    )
    .await
    .unwrap();
    let checker = Arc::new(checker);
    let asking = {
        let (checker, msg) = (checker.clone(), check_of(&oid, &event_id, past));
        tokio::spawn(async move { checker.check(&msg).await })
    };
    let watcher = env.pool(1).await;
    eventually(10, "the check waits for the order's row lock", || async {
        let c = watcher.get().await.unwrap();
        let waiting: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE '%FROM orders WHERE order_id = $1 FOR SHARE%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        waiting > 0
    })
    .await;
    assert!(!asking.is_finished(), "it did not answer before the commit");
    tx.commit().await.unwrap();
    assert_eq!(asking.await.unwrap(), LocalOutcome::Commit);

    // A lock held past the check's lock timeout: UNKNOWN (the broker asks again), not a guess.
    let tx = local.transaction().await.unwrap();
    tx.execute(
        "UPDATE orders SET updated_at = now() WHERE order_id = $1",
        &[&oid],
    )
    .await
    .unwrap();
    tx.execute("DELETE FROM event_outbox WHERE event_id = $1", &[&event_id])
        .await
        .unwrap();
    assert_eq!(
        checker.check(&check_of(&oid, &event_id, past)).await,
        LocalOutcome::Unknown
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        checker.check(&check_of(&oid, &event_id, past)).await,
        LocalOutcome::Commit,
        "the row is still there"
    );
    // The row holds another payload under this id (another attempt's event): this half's
    // transaction did not write it, whatever the deadline.
    let mut other = check_of(&oid, &event_id, ahead);
    other.body = br#"{"v": 2}"#.to_vec();
    assert_eq!(checker.check(&other).await, LocalOutcome::Rollback);
    env.cleanup().await;
}

#[tokio::test]
async fn reconcile_finds_a_lost_order_paid_in_transaction_mode_and_frees_a_stranded_one() {
    use seckill::roles::ops::reconcile::reconcile;
    let mut env = TestEnv::with_topics().await;
    env.settings.events.order_paid = Some(EventDelivery::Transaction);
    env.activity(1404, 1, 5).await;
    let orders = created_orders(&env, 1404, &[1, 2]).await;
    let (lost, stranded) = (orders[0].order_id.clone(), orders[1].order_id.clone());
    let api = common::start_api(env.settings.clone()).await;
    for (i, oid) in [&lost, &stranded].into_iter().enumerate() {
        let (status, body) = notify_payment(&api.base, oid, &format!("pay-{i}"), 100).await;
        assert_eq!(status, 200, "{body}");
    }
    let pool = env.pool(1).await;
    let c = pool.get().await.unwrap();
    // One event row lost; another left TRANSACTION by a producer that died before marking
    // it, long ago (the broker has stopped asking about it).
    c.execute(
        "DELETE FROM event_outbox WHERE event_id = $1",
        &[&order_paid_event_id(&lost, 2)],
    )
    .await
    .unwrap();
    c.execute(
        "UPDATE event_outbox SET status = 'TRANSACTION', created_at = now() - interval '700 seconds'
         WHERE event_id = $1",
        &[&order_paid_event_id(&stranded, 2)],
    )
    .await
    .unwrap();
    let redis = env.redis().await;
    let args = common::reconcile_now();
    let report = reconcile(&env.settings, &**c, &redis, &args).await.unwrap();
    let found = |k: &str| {
        let f = report.findings.iter().find(|f| f.kind == k).unwrap();
        (f.found, f.emitted)
    };
    assert_eq!(found("missing_order_paid"), (1, 1));
    assert_eq!(found("transaction_past_horizon"), (1, 1));
    for oid in [&lost, &stranded] {
        let status: String = c
            .query_one(
                "SELECT status FROM event_outbox WHERE event_id = $1",
                &[&order_paid_event_id(oid, 2)],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(status, "PENDING", "{oid}: handed to the relay");
    }
    // The relay sends both under their ids; a second run finds nothing.
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let relay = Relay::new(env.pool(2).await, publisher, Arc::new(env.settings.clone()));
    relay.relay_once().await.unwrap();
    assert_eq!(
        env.count("SELECT count(*) FROM event_outbox WHERE tag = 'ORDER_PAID' AND status = 'SENT'")
            .await,
        2
    );
    let again = reconcile(&env.settings, &**c, &redis, &args).await.unwrap();
    assert_eq!(again.drift(), 0, "{:?}", again.findings);
    api.stop.cancel();
    api.server.await.unwrap().unwrap();
    env.cleanup().await;
}

// Faults between the half message and its end ------------------------------------------------

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

/// Every order of the test past its deadline a minute ago.
async fn expire_every_order(pool: &deadpool_postgres::Pool) {
    pool.get()
        .await
        .unwrap()
        .execute(
            "UPDATE orders SET expires_at = now() - interval '1 minute'",
            &[],
        )
        .await
        .unwrap();
}
