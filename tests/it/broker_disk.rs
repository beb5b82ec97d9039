//! The full-disk drill (docs/RUNBOOK.md#alert-seckillbrokerdiskfull): the only broker of a
//! sale has its disk filled mid-sale (`scripts/broker-drill.sh`: a broker of its own on a
//! small tmpfs). It refuses every send; the reservations taken meanwhile are kept, since a
//! refusal is not known to be final (docs/architecture/hot-path.md#uncertain-sends), and re-sent
//! once the disk is freed; the sale sells out exactly, nothing lost or doubled; and the broker
//! alerts fire on the figures the scan role exported while the disk was full.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;

use crate::common::{self, eventually, gauge, metric, TestEnv};
use crate::sale_faults::{buy, finish, script_with, start_roles};

/// The drill broker's address (`scripts/broker-drill.sh`).
const DRILL_BROKER: &str = "127.0.0.1:10941";
const STOCK: i32 = 200;

fn drill(args: &[&str]) -> std::process::ExitStatus {
    script_with("broker-drill.sh", args, &[])
}

/// Buyers `users`, 8 at a time, each as [`buy`] asks; how many got a 202.
async fn buyers(
    api_port: u16,
    users: std::ops::RangeInclusive<i64>,
    answers: &Mutex<BTreeMap<String, usize>>,
) -> usize {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let url = format!("http://127.0.0.1:{api_port}/v1/activities/990/skus/1/reservations");
    futures::stream::iter(users)
        .map(|u| buy(&client, &url, u, answers))
        .buffer_unordered(8)
        .filter(|ok| futures::future::ready(*ok))
        .count()
        .await
}

/// The shipped alert rules applied (by `promtool test rules`) to the broker's figures as the
/// scan role exported them, held for ten minutes: the alerts firing at the end, by name and
/// severity.
fn alerts_firing_on(broker: &str, ratio: f64, writeable: f64, flush_error: f64) -> String {
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/prometheus/alerts.yml");
    let series = |name: &str, v: f64| {
        format!("      - series: '{name}{{job=\"seckill-scan\",broker=\"{broker}\"}}'\n        values: '{v}x15'\n")
    };
    let test = format!(
        "rule_files:\n  - {rules}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n{}{}{}    promql_expr_test:\n      - expr: count by (alertname, severity) (ALERTS{{alertstate=\"firing\"}})\n        eval_time: 10m\n        exp_samples:\n          - labels: '{{alertname=\"SeckillBrokerDiskFull\",severity=\"critical\"}}'\n            value: 1\n          - labels: '{{alertname=\"SeckillBrokerDiskFull\",severity=\"warning\"}}'\n            value: 1\n          - labels: '{{alertname=\"SeckillBrokerNotWriteable\",severity=\"critical\"}}'\n            value: 1\n",
        series("mq_broker_disk_used_ratio", ratio),
        series("mq_broker_writeable", writeable),
        series("mq_broker_flush_error", flush_error),
        rules = rules.display(),
    );
    let file = std::env::temp_dir().join(format!("broker-drill-alerts-{}.yml", std::process::id()));
    std::fs::write(&file, test).unwrap();
    let out = std::process::Command::new("promtool")
        .args(["test", "rules"])
        .arg(&file)
        .output()
        .expect("promtool (Debian package `prometheus`; make test installs it)");
    let _ = std::fs::remove_file(&file);
    if out.status.success() {
        "SeckillBrokerDiskFull (warning, critical), SeckillBrokerNotWriteable (critical)".into()
    } else {
        panic!(
            "the broker alerts did not fire as expected on ratio {ratio}, writeable {writeable}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

#[tokio::test]
#[ignore = "fills a broker's disk: run by `make test-faults`, one test at a time"]
async fn a_broker_whose_disk_fills_mid_sale_refuses_sends_and_loses_nothing() {
    assert!(drill(&["up", "256"]).success(), "drill broker started");
    let mut env = TestEnv::without_topics().await;
    // The sale's topics on the drill broker alone: every send goes to the disk that fills.
    env.settings.mq.broker_addr = DRILL_BROKER.into();
    seckill::roles::ops::topics::create_all(&env.settings)
        .await
        .expect("topics on the drill broker");
    env.activity(990, 1, STOCK).await;
    let roles = start_roles(&env, 1, "").await;
    let answers = Mutex::new(BTreeMap::new());
    let before = buyers(roles.api_port, 1..=100, &answers).await;
    assert_eq!(
        before,
        100,
        "the disk has room: {:?}",
        answers.lock().unwrap()
    );

    assert!(drill(&["fill", "95"]).success(), "disk filled");
    let writeable = format!("mq_broker_writeable{{broker=\"{DRILL_BROKER}\"}}");
    let ratio = format!("mq_broker_disk_used_ratio{{broker=\"{DRILL_BROKER}\"}}");
    let flush = format!("mq_broker_flush_error{{broker=\"{DRILL_BROKER}\"}}");
    eventually(
        30,
        "the scan role sees the drill broker refusing writes",
        || async { gauge(roles.scan_port, &writeable).await == Some(0.0) },
    )
    .await;
    let full_ratio = gauge(roles.scan_port, &ratio).await.expect("disk ratio");
    let full_flush = gauge(roles.scan_port, &flush).await.unwrap_or(0.0);
    assert!(full_ratio >= 0.90, "disk ratio while full: {full_ratio}");
    let unknown_before = metric(roles.api_ops, "mq_publish_total", r#"outcome="unknown""#).await;
    // Buyers while the disk is full: their reservations are taken in Redis and kept.
    let during = buyers(roles.api_port, 101..=150, &answers).await;
    let refused =
        metric(roles.api_ops, "mq_publish_total", r#"outcome="unknown""#).await - unknown_before;
    eprintln!(
        "while full: {during} accepted, {refused} sends refused, disk {full_ratio:.3}; answers {:?}",
        answers.lock().unwrap()
    );
    // It bit: the broker refused the sends (not one of them stored), and nothing was ordered
    // from them yet.
    assert!(refused > 0.0, "no send was refused: the fault did not bite");
    let fired = alerts_firing_on(DRILL_BROKER, full_ratio, 0.0, full_flush);
    eprintln!("alerts firing on the exported figures: {fired}");

    assert!(drill(&["free"]).success(), "disk freed");
    eventually(30, "the drill broker takes writes again", || async {
        gauge(roles.scan_port, &writeable).await == Some(1.0)
    })
    .await;
    let after = buyers(roles.api_port, 151..=400, &answers).await;
    eprintln!(
        "accepted {before} + {during} + {after}; answers {:?}",
        answers.lock().unwrap()
    );
    let report = common::sold_out_converged(&env, STOCK, 990).await;
    assert!(report.ok(), "{:?}", report.violations);
    // The kept reservations were sent again by the scanner once the disk had room.
    let resent = metric(roles.scan_port, "reservation_resend_total", "").await;
    eprintln!("evidence: {refused} refused sends, {resent} re-sends");
    assert!(resent > 0.0, "the refused reservations were never re-sent");
    finish(roles, env).await;
    assert!(drill(&["down"]).success(), "drill broker stopped");
}
