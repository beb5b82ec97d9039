//! The broker side failing mid-sale: one of two brokers killed and kept dead, the broker
//! restarted between a half message and its commit, and each of two name servers killed in turn.

use super::*;

/// The second master `SECKILL_MQ_BROKERS=2 scripts/rocketmq-up.sh` starts.
const BROKER_B: &str = "127.0.0.1:10921";

/// `scripts/rocketmq-up.sh` with a second master.
fn two_brokers_up() -> std::process::ExitStatus {
    script_with("rocketmq-up.sh", &[], &[("SECKILL_MQ_BROKERS", "2")])
}

/// Messages the second master stored for `topic` (its consume-queue files are there once it
/// took any).
fn stored_on_b(topic: &str) -> usize {
    let data = std::env::var("SECKILL_MQ_DATA_DIR").map_or_else(
        |_| Path::new(&std::env::var("HOME").unwrap()).join(".cache/seckill/rocketmq-data"),
        Into::into,
    );
    std::fs::read_dir(data.join("store-b/consumequeue").join(topic))
        .map(|queues| queues.count())
        .unwrap_or(0)
}

/// One of two brokers is SIGKILLed mid-sale while it holds an order backlog. The sale goes on
/// through the other, the scanner sends again what the dead one held, and its copies are absorbed
/// as duplicates when it returns.
///
/// One story: the kill comes once the backlog sits on both brokers, and the re-sends and the
/// duplicates after the restart are the messages that kill stranded.
#[tokio::test]
#[ignore = "starts and kills a second broker: run by `make test-faults`, one test at a time"]
async fn one_of_two_brokers_killed_mid_sale_loses_and_doubles_nothing() {
    assert!(two_brokers_up().success(), "second broker started");
    // Topics on both masters: sends and consumer groups spread over the two.
    let mut env = TestEnv::without_topics().await;
    env.settings.mq.broker_addr = format!("{},{BROKER_B}", env.settings.mq.broker_addr);
    seckill::roles::ops::topics::create_all(&env.settings)
        .await
        .expect("topics on both brokers");
    env.activity(983, 1, STOCK).await;
    let roles = start_roles(&env, 1, THROTTLED).await;
    let names = env.names();
    let topic = names.order_create_topic.clone();
    let probe = seckill::mq::rocketmq::LagProbe::new(
        &seckill::mq::runtime().unwrap(),
        &env.settings.mq.name_server,
    )
    .await
    .unwrap();
    let (api_port, api_ops) = (roles.api_port, roles.api_ops);
    let unconfirmed = || async move {
        metric(api_ops, "mq_publish_total", r#"outcome="unknown""#).await
            + metric(api_ops, "mq_publish_total", r#"outcome="definite_failure""#).await
    };
    let killed_at = std::cell::Cell::new(None);
    let consumer = std::cell::RefCell::new(None);
    let mut roles = roles;
    let mut first_consumer = roles.consumers.remove(0);
    let accepted = sale_with(&env, 983, api_port, || async {
        assert!(
            stored_on_b(&topic) > 0,
            "the second broker took none of the sale's messages before the kill"
        );
        // A consumer pulls ahead into its own cache, so a broker dies holding unconsumed
        // messages only while nobody pulls them: the consumer goes first, and the order
        // backlog builds on both brokers' queues.
        sigkill(&mut first_consumer.0);
        eventually(20, "an order backlog of 30 messages", || async {
            matches!(probe.lag(&names.order_create_group, &topic).await, Ok(l) if l.messages >= 30)
        })
        .await;
        sigkill_server("broker-b.pid");
        let at = std::time::Instant::now();
        killed_at.set(Some(at));
        // A new consumer, which finds only the live broker's queues.
        let (p, port) = start_consumer(&env, THROTTLED);
        wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
        *consumer.borrow_mut() = Some((p, port));
        // The sale goes on against the one broker left; the producer learns to route around
        // the dead one. How long sends keep failing after the kill (sampled every 100 ms).
        let (mut last, mut last_change) = (unconfirmed().await, Duration::ZERO);
        while at.elapsed() < Duration::from_secs(8) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = unconfirmed().await;
            if now > last {
                (last, last_change) = (now, at.elapsed());
            }
        }
        eprintln!(
            "measured: {last} sends unconfirmed in all; the last one {:.1} s after the kill",
            last_change.as_secs_f64()
        );
    })
    .await;
    roles.consumers.push(
        consumer
            .into_inner()
            .expect("a consumer started after the kill"),
    );
    assert!(accepted >= STOCK as usize, "accepted {accepted}");
    // The second broker stays dead: what it held reaches the consumers as the scanner's
    // copies through the live one.
    let report = common::sold_out_converged(&env, STOCK, 983).await;
    assert!(report.ok(), "{:?}", report.violations);
    let resent = metric(
        roles.scan_port,
        "reservation_unconsumed_resend_total",
        r#"outcome="confirmed""#,
    )
    .await;
    eprintln!(
        "measured: every reservation an order {:.1} s after the kill, the second broker still dead; \
         {resent} confirmed sends it held sent again",
        killed_at.get().unwrap().elapsed().as_secs_f64()
    );
    assert!(
        resent > 0.0,
        "the dead broker held no unconsumed order message: the fault did not bite"
    );
    // Back: its stranded copies are delivered and the inbox absorbs every one of them.
    let consumer_port = roles.consumers[0].1;
    let before = metric(consumer_port, "mq_duplicate_message_total", "").await;
    assert!(two_brokers_up().success(), "second broker restarted");
    eventually(
        120,
        "the returned broker's copies absorbed as duplicates",
        || async { metric(consumer_port, "mq_duplicate_message_total", "").await > before },
    )
    .await;
    eprintln!(
        "evidence: {} duplicates absorbed after the broker came back",
        metric(consumer_port, "mq_duplicate_message_total", "").await - before
    );
    let report = common::sold_out_converged(&env, STOCK, 983).await;
    assert!(report.ok(), "{:?}", report.violations);
    finish(roles, env).await;
    probe.shutdown().await;
    // Back to one broker for the other tests, and the second one's store gone.
    assert!(
        script_with("rocketmq-down.sh", &["--second-broker"], &[]).success(),
        "second broker stopped"
    );
}

#[tokio::test]
#[ignore = "kills the shared broker: run by `make test-faults`, one test at a time"]
async fn the_broker_restarted_between_a_half_message_and_its_commit_delivers_the_event_once() {
    let env = TestEnv::with_topics().await;
    env.activity(984, 1, 5).await;
    let orders = common::created_orders(&env, 984, &[1]).await;
    let oid = orders[0].order_id.clone();
    let event_id = seckill::domain::events::order_paid_event_id(&oid, 2);
    let (collector, consumer, group) = common::collect_events(&env).await;
    // The API in transaction mode holds 4 s between its local commit and the commit message
    // (its PostgreSQL bound raised to cover it): the broker is killed and restarted then.
    let (api_port, api_ops) = (free_port(), free_port());
    let mut api = spawn(
        &env,
        &["api"],
        "tx-after-commit-before-end=sleep(4000)",
        &[
            ("SECKILL__API__LISTEN", format!("127.0.0.1:{api_port}")),
            (
                "SECKILL__API__METRICS_LISTEN",
                format!("127.0.0.1:{api_ops}"),
            ),
            ("SECKILL__EVENTS__ORDER_PAID", "transaction".to_string()),
            ("SECKILL__PG__STATEMENT_TIMEOUT_MS", "10000".to_string()),
        ],
    );
    wait_ready(format!("http://127.0.0.1:{api_port}/readyz")).await;
    let paying = {
        let (base, oid) = (format!("http://127.0.0.1:{api_port}"), oid.clone());
        tokio::spawn(async move { common::notify_payment(&base, &oid, "pay-1", 100).await })
    };
    let in_transaction = format!(
        "SELECT count(*) FROM event_outbox WHERE event_id = '{event_id}' AND status = 'TRANSACTION'"
    );
    eventually(10, "the local transaction committed", || async {
        env.count(&in_transaction).await == 1
    })
    .await;
    let before = std::fs::read_to_string(run_dir().join("broker.pid")).unwrap();
    sigkill_server("broker.pid");
    assert_eq!(
        env.count(&in_transaction).await,
        1,
        "killed before the commit message (the row is marked after it)"
    );
    assert!(script("rocketmq-up.sh").success(), "broker restarted");
    let after = std::fs::read_to_string(run_dir().join("broker.pid")).unwrap();
    assert_ne!(before, after, "another broker process");
    let (status, body) = paying.await.unwrap();
    assert_eq!(status, 200, "{body}");

    // Delivered once: by the commit message if the new broker got it, else by its check-back.
    eventually(150, "ORDER_PAID delivered", || async {
        !collector.paid(&oid).is_empty()
    })
    .await;
    caught_up(&env, &group, &env.names().order_event_topic).await;
    let paid = collector.paid(&oid);
    assert_eq!(paid.len(), 1, "delivered once");
    assert_eq!(paid[0].properties["message_id"], event_id);
    let commits = metric(api_ops, "mq_transaction_end_total", r#"outcome="commit""#).await;
    let checks = metric(api_ops, "mq_transaction_check_total", r#"answer="commit""#).await;
    eprintln!(
        "evidence: broker pid {} -> {}, ends commit {commits}, check-backs commit {}",
        before.trim(),
        after.trim(),
        checks.abs()
    );
    assert_eq!(
        commits, 1.0,
        "the API ended the half with a commit after the restart"
    );
    let _ = api.terminate(20).await;
    assert!(consumer.shutdown().await);
    env.cleanup().await;
}

/// `seckill consume` given both name servers, throttled like the others.
fn consumer_of_both(env: &TestEnv) -> (Proc, u16) {
    let c = consumer_role(env);
    (c.proc, c.ops)
}

/// A throttled consumer that knows both name servers.
fn consumer_role(env: &TestEnv) -> Started {
    Role::consume(2)
        .failpoints(THROTTLED)
        .var("SECKILL__CONSUMER__BATCH_SIZE", 4)
        .var("SECKILL__MQ__NAME_SERVER", BOTH_NAME_SERVERS)
        .spawn(env)
}

/// `rocketmq-up.sh` with two name servers (a broker registered with one only is restarted).
fn both_name_servers() -> bool {
    script_with("rocketmq-up.sh", &[], &[("SECKILL_MQ_NAMESRVS", "2")]).success()
}

/// Waits until the name server at `addr`, asked alone, routes the order topic to the broker.
async fn routes_on(addr: &str, env: &TestEnv) {
    let names = env.names();
    let probe = seckill::mq::rocketmq::LagProbe::new(&seckill::mq::runtime().unwrap(), addr)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    eventually(60, "the restarted name server routes the topic", || async {
        probe
            .lag(&names.order_create_group, &names.order_create_topic)
            .await
            .is_ok()
    })
    .await;
    eprintln!(
        "{addr} routes the topic {:?} after its restart",
        started.elapsed()
    );
    probe.shutdown().await;
}

/// The two name servers `make services-up` starts, as a shop lists them.
const BOTH_NAME_SERVERS: &str = "127.0.0.1:9876;127.0.0.1:9877";

#[tokio::test]
#[ignore = "kills the shared name servers: run by `make test-faults`, one test at a time"]
async fn each_name_server_killed_in_turn_mid_sale_loses_and_doubles_nothing() {
    let env = TestEnv::with_topics().await;
    assert!(
        both_name_servers(),
        "both name servers up, the broker registered with both"
    );
    for (activity, stock) in [(985, STOCK), (986, 20), (987, 20)] {
        env.activity(activity, 1, stock).await;
    }
    const NAME_SERVER: &str = "SECKILL__MQ__NAME_SERVER";
    let api = Role::api().var(NAME_SERVER, BOTH_NAME_SERVERS).spawn(&env);
    let scan = Role::scan().var(NAME_SERVER, BOTH_NAME_SERVERS).spawn(&env);
    let first = consumer_role(&env);
    common::ready([&api, &scan, &first]).await;
    let (mut api, api_port, api_ops) = (api.proc, api.port, api.ops);
    let (mut scan, scan_port) = (scan.proc, scan.ops);
    let consumer = std::cell::RefCell::new((first.proc, first.ops));
    let orders = || env.count("SELECT count(*) FROM orders");
    // While one name server is dead: a new consumer finds its routes on the other alone, and
    // 20 buyers of another activity, sent by the API meanwhile, each become an order.
    let one_dead = |dead: &'static str, activity: i64| {
        let (consumer, env) = (&consumer, &env);
        async move {
            sigkill(&mut consumer.borrow_mut().0);
            let (p, port) = consumer_of_both(env);
            wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
            let base = format!("http://127.0.0.1:{api_port}");
            for user in 1..=20 {
                let (s, b) = common::reserve_as(&base, activity, 1, user, "one-dead").await;
                assert_eq!(s, reqwest::StatusCode::ACCEPTED, "{b}");
            }
            let created = format!("SELECT count(*) FROM orders WHERE activity_id = {activity}");
            eventually(60, "orders created with one name server dead", || async {
                env.count(&created).await == 20
            })
            .await;
            let down = metric(port, "mq_name_server_down_total", dead).await;
            eprintln!(
                "{dead} dead: 20 reservations sent and made orders by a consumer started then, \
                 which counted it down {down} time(s)"
            );
            assert!(down >= 1.0, "the new consumer saw {dead} down");
            *consumer.borrow_mut() = (p, port);
        }
    };
    let accepted = sale_with(&env, 985, api_port, || async {
        sigkill_server("namesrv.pid");
        eprintln!(
            "name server a (9876) SIGKILLed at {} orders",
            orders().await
        );
        one_dead("9876", 986).await;
        assert!(both_name_servers(), "name server a restarted");
        // A restarted name server knows no route until the broker registers again (every
        // 10 s here): the other one is killed only once this one answers for the topic.
        routes_on("127.0.0.1:9876", &env).await;
        sigkill_server("namesrv-b.pid");
        eprintln!(
            "name server b (9877) SIGKILLed at {} orders",
            orders().await
        );
        one_dead("9877", 987).await;
        assert!(both_name_servers(), "name server b restarted");
    })
    .await;
    assert!(accepted > 0);
    let report = common::sold_out_converged(&env, STOCK, 985).await;
    assert!(report.ok(), "{:?}", report.violations);
    for activity in [986, 987] {
        let r = env.invariants(activity, 1).await;
        assert!(r.ok() && r.figures.valid_orders == 20, "{activity}: {r:?}");
    }
    // The relay went on sending: every event due by now is out (the orders' cancel timers
    // wait in the outbox until near their deliver time).
    eventually(60, "the outbox sent what is due", || async {
        let due = "SELECT count(*) FROM event_outbox WHERE status = 'PENDING' \
                   AND next_attempt_at <= now()";
        env.count(due).await == 0
    })
    .await;
    let sent = env
        .count("SELECT count(*) FROM event_outbox WHERE status = 'SENT'")
        .await;
    assert!(sent >= STOCK as i64 + 40, "{sent} events sent");
    // It bit, and each long-running role saw both outages.
    for (role, port) in [("api", api_ops), ("scan", scan_port)] {
        let a = metric(port, "mq_name_server_down_total", "9876").await;
        let b = metric(port, "mq_name_server_down_total", "9877").await;
        eprintln!("evidence: {role} counted name server a down {a}, b down {b}");
        assert!(a >= 1.0 && b >= 1.0, "{role} saw both name servers go down");
    }
    let _ = api.terminate(20).await;
    let _ = scan.terminate(20).await;
    let mut last_consumer = consumer.into_inner();
    let _ = last_consumer.0.terminate(40).await;
    env.cleanup().await;
    // The shared broker back to the one name server the other tests use.
    assert!(
        script("rocketmq-up.sh").success(),
        "back to one name server"
    );
}
