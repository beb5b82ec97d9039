//! The real binaries as operators run them: `seckill api` and `seckill consume` as separate
//! processes configured through `SECKILL__...` variables, their /readyz and /metrics, and
//! SIGTERM: the consumer stops mid-load with transactions in flight (it is throttled, so a
//! backlog exists), drains them, exits 0, and a restarted consumer finishes the work with no
//! order lost or doubled.

use crate::common;

use crate::common::{assert_metrics, eventually, free_port, spawn, wait_ready, Role, TestEnv};
use serde_json::json;

/// The API and a consumer as separate processes serve their metrics on the ops ports only; the
/// consumer stopped mid-load drains what it had in flight and exits 0, and a new one finishes
/// the backlog with no order lost or doubled.
/// One story: the metrics read are those of the sale the test runs, and the second consumer
/// finishes the backlog the first one's stop left.
#[tokio::test]
async fn roles_serve_metrics_and_a_consumer_stopped_mid_load_loses_and_doubles_nothing() {
    let env = TestEnv::with_topics().await;
    env.activity(700, 1, 150).await;
    let api = Role::api().spawn(&env);
    // Throttled (batches of 4, each transaction held 200 ms): it cannot keep up with the
    // buyers, so it is stopped with work in flight, not idle.
    let consumer = Role::consume(2)
        .failpoints("consume-inside-transaction=sleep(200)")
        .var("SECKILL__CONSUMER__BATCH_SIZE", 4)
        .spawn(&env);
    common::ready([&api, &consumer]).await;
    let (mut api, api_port, api_ops) = (api.proc, api.port, api.ops);
    let mut consumer = consumer.proc;

    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{api_port}/v1/activities/700/skus/1/reservations");
    let mut accepted = 0;
    for user in 1..=200 {
        let r = client
            .post(&url)
            .header("authorization", common::bearer(user))
            .json(&json!({"user_id": user, "request_id": format!("r{user}"), "quantity": 1}))
            .send()
            .await
            .unwrap();
        if r.status() == reqwest::StatusCode::ACCEPTED {
            accepted += 1;
        }
        if user == 100 {
            // Stop the consumer while it is working through the first half: a backlog exists,
            // and what it had in flight is committed during its drain.
            eventually(30, "the consumer is creating orders", || async {
                env.count("SELECT count(*) FROM orders").await > 0
            })
            .await;
            let at_stop = env.count("SELECT count(*) FROM orders").await;
            assert!(
                at_stop < accepted,
                "stopped with a backlog: {at_stop} orders for {accepted} accepted"
            );
            let status = consumer.terminate(40).await;
            assert!(status.success(), "consumer exit on SIGTERM: {status:?}");
            let after = env.count("SELECT count(*) FROM orders").await;
            // Two workers always busy with a backlog: the drain committed what was in flight.
            assert!(
                after > at_stop,
                "nothing in flight was drained: {at_stop} -> {after}"
            );
            eprintln!(
                "stopped at {at_stop} orders of {accepted} accepted; {after} after its drain"
            );
        }
    }
    assert_eq!(accepted, 150);
    assert_metrics(
        &format!("http://127.0.0.1:{api_ops}/metrics"),
        &[
            "mq_publish_total",
            "reservation_total",
            "mq_publish_latency_seconds",
            "http_request_duration_seconds",
        ],
    )
    .await;
    // The buyers' port serves the buyers, not the operators' figures.
    let on_buyers_port = reqwest::get(format!("http://127.0.0.1:{api_port}/metrics"))
        .await
        .unwrap();
    assert_eq!(on_buyers_port.status(), reqwest::StatusCode::NOT_FOUND);

    // A new consumer finishes the work.
    let consumer = Role::consume(2).spawn(&env);
    common::ready([&consumer]).await;
    let (mut consumer, c2_port) = (consumer.proc, consumer.ops);
    eventually(90, "150 orders", || async {
        env.count("SELECT count(*) FROM orders").await == 150
    })
    .await;
    assert_metrics(
        &format!("http://127.0.0.1:{c2_port}/metrics"),
        &[
            "mq_consume_total",
            "order_tx_latency_seconds",
            "pg_pool_wait_seconds",
            "worker_budget",
            "mq_consumer_ready{topic=\"order_create\"}",
            // Every group's backlog, its retry topic counted, and the live reservation->order
            // SLO with 3 s as a bucket boundary.
            "mq_consumer_lag_seconds{topic=\"order_create\"}",
            "mq_consumer_lag_seconds{topic=\"compensate\"}",
            "mq_consumer_lag_seconds{topic=\"order_event\"}",
            "mq_consumer_retry_lag_messages{topic=\"order_create\"}",
            "order_reservation_to_order_seconds_bucket{le=\"3\"}",
        ],
    )
    .await;
    assert!(consumer.terminate(40).await.success());
    assert!(api.terminate(20).await.success());

    let report = env.invariants(700, 1).await;
    assert!(report.ok(), "{:?}", report.violations);
    assert_eq!(report.figures.valid_orders, 150);
    env.cleanup().await;
}

#[tokio::test]
async fn timeout_cancel_exports_its_groups_backlog_with_the_retry_topic() {
    let env = TestEnv::with_topics().await;
    let port = free_port();
    let mut timeout_cancel = spawn(
        &env,
        &["timeout-cancel"],
        "",
        &[(
            "SECKILL__TIMEOUT__METRICS_LISTEN",
            format!("127.0.0.1:{port}"),
        )],
    );
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    eventually(20, "the order_timeout backlog on /metrics", || {
        let metrics = metrics.clone();
        async move {
            let text = match reqwest::get(&metrics).await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => return false,
            };
            text.contains("mq_consumer_lag_seconds{topic=\"order_timeout\"} 0")
                && text.contains("mq_consumer_retry_lag_messages{topic=\"order_timeout\"} 0")
        }
    })
    .await;
    assert!(timeout_cancel.terminate(30).await.success());
    env.cleanup().await;
}

#[tokio::test]
async fn a_scratch_environments_topics_are_deleted_only_when_confirmed() {
    let env = TestEnv::with_topics().await;
    let topic = env.names().order_create_topic;
    let probe = |id: &str| seckill::mq::OutMessage {
        topic: topic.clone(),
        tag: "PROBE".into(),
        properties: vec![("message_id".into(), id.into())],
        body: b"{}".to_vec(),
        ..Default::default()
    };
    let publisher = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    let sent = publisher.send(probe("before"), 3000).await;
    assert!(
        matches!(sent, seckill::mq::SendOutcome::Confirmed { .. }),
        "{sent:?}"
    );
    let refused = common::cli(&env, &["topics", "delete", "--confirm", "SOMETHING_ELSE"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--confirm"));
    let out = common::cli(&env, &["topics", "delete", "--confirm", &env.settings.env]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("topic {topic}: deleted")),
        "{stdout}"
    );
    assert!(stdout.contains("%RETRY%"), "{stdout}");
    // Gone from the broker and the name server: a new producer's send has nowhere to go.
    let after = seckill::mq::connect_publisher(&env.settings).await.unwrap();
    eventually(15, "no route to the deleted topic", || {
        let (after, msg) = (after.clone(), probe("after"));
        async move {
            matches!(
                after.send(msg, 3000).await,
                seckill::mq::SendOutcome::DefiniteFailure { .. }
            )
        }
    })
    .await;
    env.cleanup().await;
}

/// The settings of an environment file as systemd reads it, with every commented
/// `#SECKILL...=value` line turned on, as an operator filling it in would.
fn env_file_uncommented(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(|l| l.trim().trim_start_matches('#'))
        .filter(|l| l.starts_with("SECKILL"))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The shipped environment file, its placeholders filled in, starts every role: each turns ready
/// and exits cleanly on SIGTERM.
///
/// One story: the roles start from the file as filled in, so the check of its keys, the filling and
/// the start are one path.
#[tokio::test]
async fn the_shipped_environment_file_filled_in_starts_every_role() {
    let env = TestEnv::with_topics().await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("deploy/systemd/seckill.env.example")).unwrap();
    let mut vars = env_file_uncommented(&text);
    let keys: Vec<&str> = vars.iter().map(|(k, _)| k.as_str()).collect();
    for key in [
        "SECKILL_ENV",
        "SECKILL__PG__URL",
        "SECKILL__REDIS__URL",
        "SECKILL__MQ__NAME_SERVER",
        "SECKILL__MQ__BROKER_ADDR",
        "SECKILL__AUTH__JWKS_FILE",
        "SECKILL__API__ADMIN_TOKEN",
    ] {
        assert!(keys.contains(&key), "{key} is not in the file: {keys:?}");
    }
    // What the operator replaces: the secrets marked CHANGE_ME, the hosts (here this machine,
    // by name where the file names one: `localhost` resolves like `namesrv-a.internal` would)
    // and the JWKS file's path. Every other value stays as written.
    for (k, v) in vars.iter_mut() {
        *v = match k.as_str() {
            "SECKILL__PG__URL" => "host=localhost port=5432 user=postgres dbname=postgres".into(),
            "SECKILL__API__ADMIN_TOKEN" => "a".repeat(40),
            "SECKILL__AUTH__JWKS_FILE" => root
                .join("tests/fixtures/buyer-jwks.json")
                .display()
                .to_string(),
            _ => v
                .replace("namesrv-a.internal", "localhost")
                .replace("namesrv-b.internal", "127.0.0.1")
                .replace("redis.internal", "localhost")
                .replace("broker.internal", "localhost"),
        };
        assert!(!v.contains("CHANGE_ME"), "{k} still holds a placeholder");
    }
    // The file sends the payment secrets to /etc/seckill/prod.toml: the configuration
    // directory holds the shipped default.toml and that overlay, as the file shows it.
    let dir = std::env::temp_dir().join(format!("seckill-envfile-{}", env.settings.env));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(root.join("config/default.toml"), dir.join("default.toml")).unwrap();
    std::fs::write(
        dir.join("prod.toml"),
        "[payments]\nwebhook_secrets = [\"whsec_test_current_0123\", \"whsec_test_previous_012\"]\n",
    )
    .unwrap();
    let mut roles = Vec::new();
    for (args, listen_key) in [
        (&["api"][..], "SECKILL__API__METRICS_LISTEN"),
        (
            &["consume", "--workers", "1"][..],
            "SECKILL__CONSUMER__METRICS_LISTEN",
        ),
        (&["scan"][..], "SECKILL__SCAN__METRICS_LISTEN"),
        (&["timeout-cancel"][..], "SECKILL__TIMEOUT__METRICS_LISTEN"),
    ] {
        let ops = free_port();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_seckill"));
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SECKILL")) {
            cmd.env_remove(k);
        }
        cmd.args(args)
            .env("SECKILL_CONFIG_DIR", &dir)
            .envs(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            // This test's own environment name, schema and keys, and free ports: nothing the
            // file sets.
            .env("SECKILL__ENV", &env.settings.env)
            .env("SECKILL__PG__SCHEMA", &env.settings.pg.schema)
            .env("SECKILL__REDIS__KEY_PREFIX", &env.settings.redis.key_prefix)
            .env(listen_key, format!("127.0.0.1:{ops}"))
            .env("SECKILL__API__LISTEN", format!("127.0.0.1:{}", free_port()))
            .env(
                "SECKILL__API__ADMIN_LISTEN",
                format!("127.0.0.1:{}", free_port()),
            )
            .env("SECKILL__API__DRAIN_DELAY_MS", "0")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        roles.push((args[0], common::Proc(cmd.spawn().unwrap(), None), ops));
    }
    for (role, _, ops) in &roles {
        eprintln!("{role}: waiting for /readyz on {ops}");
        wait_ready(format!("http://127.0.0.1:{ops}/readyz")).await;
    }
    for (role, mut proc, _) in roles {
        let status = proc.terminate(30).await;
        assert!(status.success(), "{role} exit on SIGTERM: {status:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    env.cleanup().await;
}

#[tokio::test]
async fn the_scanner_exports_each_master_brokers_own_health() {
    let env = TestEnv::with_topics().await;
    // What this broker version says of itself, read as the scanner reads it.
    let probe = seckill::mq::rocketmq::LagProbe::new(
        &seckill::mq::runtime().unwrap(),
        &env.settings.mq.name_server,
    )
    .await
    .unwrap();
    let read = probe
        .broker_stats(&env.names().order_create_topic)
        .await
        .unwrap();
    assert!(!read.is_empty());
    let (broker, stats) = &read[0];
    let stats = stats.as_ref().unwrap();
    let ratio = stats.disk_used_ratio.expect("the broker reports its disk");
    assert!(ratio > 0.0 && ratio < 1.0, "{ratio}");
    assert_eq!(stats.writeable, Some(true), "{stats:?}");
    // The scan role exports them by broker.
    let port = free_port();
    let mut scan = spawn(
        &env,
        &["scan"],
        "",
        &[("SECKILL__SCAN__METRICS_LISTEN", format!("127.0.0.1:{port}"))],
    );
    wait_ready(format!("http://127.0.0.1:{port}/readyz")).await;
    let exported = [
        format!("mq_broker_disk_used_ratio{{broker=\"{broker}\"}}"),
        format!("mq_broker_writeable{{broker=\"{broker}\"}} 1"),
    ];
    let exported: Vec<&str> = exported.iter().map(String::as_str).collect();
    assert_metrics(&format!("http://127.0.0.1:{port}/metrics"), &exported).await;
    assert!(scan.terminate(20).await.success());
    env.cleanup().await;
}

/// A topic's queue count is raised by `topics create`, never lowered: a deployment upgraded
/// to a release with fewer default queues keeps the queues that hold its messages.
#[tokio::test]
async fn topics_create_raises_a_topics_queues_and_never_lowers_them() {
    let env = TestEnv::without_topics().await;
    let topic = env.names().order_create_topic.clone();
    let rt = seckill::mq::runtime().unwrap();
    let ns = env.settings.mq.name_server_list();
    let queues = || seckill::mq::rocketmq::topic_queues(&rt, &ns, &topic);
    assert_eq!(queues().await.unwrap(), 0, "no route before it is created");
    for (asked, kept) in [(8, 8), (4, 8), (12, 12), (8, 12)] {
        seckill::mq::create_topics(&env.settings, &[(topic.clone(), asked)])
            .await
            .unwrap();
        assert_eq!(queues().await.unwrap(), kept, "asked for {asked}");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn topics_create_makes_every_consumer_group_and_the_broker_makes_none_by_itself() {
    let env = TestEnv::without_topics().await;
    let out = common::cli_async(&env, &["topics", "create"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let rt = seckill::mq::runtime().unwrap();
    let ns = env.settings.mq.name_server_list();
    let broker = env.settings.mq.broker_addrs().next().unwrap().to_string();
    let plan = seckill::roles::ops::topics::group_plan(&env.settings);
    assert_eq!(
        plan.len(),
        11,
        "five source groups (the audit group among them), their DLQ intakes and the replay group"
    );
    let retries = env.settings.consumer.max_reconsume_times;
    for g in &plan {
        assert!(
            printed.contains(&format!("group {}: {retries} deliveries", g.name)),
            "{printed}"
        );
        let facts = seckill::mq::rocketmq::group_facts(&rt, &ns, &broker, &g.name)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("the broker holds group {}", g.name));
        assert_eq!(
            facts,
            seckill::mq::rocketmq::GroupFacts {
                retry_max_times: retries,
                retry_queue_nums: 1,
                broadcast: false,
                consume_enable: true,
            },
            "{}",
            g.name
        );
    }
    // The broker the project starts creates no group by itself.
    let auto = seckill::mq::rocketmq::broker_config_value(
        &rt,
        &ns,
        &broker,
        "autoCreateSubscriptionGroup",
    )
    .await
    .unwrap();
    assert_eq!(auto.as_deref(), Some("false"));
    // Deleting the environment removes its groups with its topics.
    let out = common::cli_async(&env, &["topics", "delete", "--confirm", &env.settings.env]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for g in &plan {
        let left = seckill::mq::rocketmq::group_facts(&rt, &ns, &broker, &g.name)
            .await
            .unwrap();
        assert_eq!(left, None, "{} deleted", g.name);
    }
    env.cleanup().await;
}
