//! PostgreSQL failing over mid-sale (docs/architecture/postgresql.md#failover), on a
//! pg_auto_failover pair of its own (`scripts/pg-ha.sh`: a monitor and two nodes on loopback
//! ports; the shared PostgreSQL is not touched). The roles get both hosts with
//! `target_session_attrs=read-write`; buyers buy and a payment provider pays every order it
//! sees while the primary is SIGKILLed and the manager promotes the standby. Judged from the
//! buyers' and the provider's own records and the books: `make test-faults`, one at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::StreamExt;

use crate::common::{self, eventually, metric, paid_2xx_not_paid, Proc, Provider, Role, TestEnv};
use crate::sale_faults::buy;

const STOCK: i32 = 240;
const BUYERS: i64 = 720;
/// A consumer slower than the buyers: an order backlog when the primary dies.
const THROTTLED: &str = "consume-inside-transaction=sleep(100)";

/// `scripts/pg-ha.sh ARGS`: its standard output; the test fails when it does.
fn pg_ha(args: &[&str]) -> String {
    let out = std::process::Command::new("bash")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-ha.sh"))
        .args(args)
        .output()
        .expect("scripts/pg-ha.sh runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "pg-ha.sh {args:?}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprint!("{stdout}");
    stdout
}

/// The `key=value` of the script's last `PG_HA` line.
fn field(out: &str, key: &str) -> String {
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with("PG_HA"))
        .unwrap_or("");
    let start = line
        .find(&format!("{key}="))
        .unwrap_or_else(|| panic!("no {key}= in {line}"));
    let rest = &line[start + key.len() + 1..];
    match rest.strip_prefix('\'') {
        Some(quoted) => quoted.split('\'').next().unwrap_or("").to_owned(),
        None => rest.split_whitespace().next().unwrap_or("").to_owned(),
    }
}

/// The pair up, in `mode` (sync or async), and its client URL.
fn pair_up(mode: &str) -> String {
    let url = field(&pg_ha(&["up"]), "url");
    pg_ha(&["mode", mode]);
    url
}

/// The roles against the pair: the API (payments only with a synchronous standby), the
/// scanner, a throttled consumer and, when orders are payable for `pay_window` seconds only,
/// timeout-cancel; each reads the primary every 200 ms.
struct Roles {
    api: Proc,
    api_port: u16,
    api_ops: u16,
    scan: Proc,
    scan_port: u16,
    consume: Proc,
    consume_port: u16,
    cancel: Option<Proc>,
}

async fn start_roles(env: &TestEnv, pay_window: Option<u64>) -> Roles {
    // Each role reads which node is primary every 200 ms.
    const CHECK: &str = "SECKILL__PG__PRIMARY_CHECK_MS";
    let api = Role::api()
        .var("SECKILL__PAYMENTS__REQUIRE_SYNC_STANDBY", true)
        .var(CHECK, 200)
        .spawn(env);
    let scan = Role::scan()
        .var("SECKILL__SCAN__UNCONSUMED_RESEND_MS", 3000)
        .var(CHECK, 200)
        .spawn(env);
    let consume = Role::consume(2)
        .failpoints(THROTTLED)
        .var("SECKILL__CONSUMER__BATCH_SIZE", 4)
        .var(
            "SECKILL__CONSUMER__PAY_WINDOW_SECS",
            pay_window.unwrap_or(env.settings.consumer.pay_window_secs),
        )
        .var(CHECK, 200)
        .spawn(env);
    let cancel = pay_window.map(|_| Role::timeout_cancel().var(CHECK, 200).spawn(env));
    common::ready([&api, &scan, &consume].into_iter().chain(&cancel)).await;
    Roles {
        api: api.proc,
        api_port: api.port,
        api_ops: api.ops,
        scan: scan.proc,
        scan_port: scan.ops,
        consume: consume.proc,
        consume_port: consume.ops,
        cancel: cancel.map(|c| c.proc),
    }
}

/// A read on whichever node is primary now; `None` while none answers (mid-failover).
async fn try_count(env: &TestEnv, sql: &str) -> Option<i64> {
    let pool = seckill::pg::connect_pool(&env.settings.pg, 1).await.ok()?;
    let client = pool.get().await.ok()?;
    client.query_one(sql, &[]).await.ok().map(|r| r.get(0))
}

/// Buyers 1..=`n`, 8 at a time; returns how many got a 202, once they are all answered.
fn buyers(api_port: u16, activity: i64, n: i64) -> (tokio::task::JoinHandle<()>, Arc<AtomicUsize>) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let url = format!("http://127.0.0.1:{api_port}/v1/activities/{activity}/skus/1/reservations");
    let accepted = Arc::new(AtomicUsize::new(0));
    let answers = Arc::new(Mutex::new(BTreeMap::<String, usize>::new()));
    let counted = accepted.clone();
    let load = tokio::spawn(async move {
        futures::stream::iter(1..=n)
            .for_each_concurrent(8, |user| {
                let (client, url, accepted, answers) = (
                    client.clone(),
                    url.clone(),
                    counted.clone(),
                    answers.clone(),
                );
                async move {
                    if buy(&client, &url, user, &answers).await {
                        accepted.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(60)).await;
                }
            })
            .await;
        eprintln!("buyers' answers: {:?}", answers.lock().unwrap());
    });
    (load, accepted)
}

/// Waits until the sale is under way: a quarter of the stock taken, orders behind the
/// acceptances (a backlog), and at least `paid` payments answered 2xx.
async fn mid_sale(env: &TestEnv, accepted: &AtomicUsize, provider: &Provider, paid: usize) {
    eventually(
        90,
        "a quarter sold, an order backlog, payments made",
        || async {
            let a = accepted.load(Ordering::SeqCst) as i64;
            let orders = try_count(env, "SELECT count(*) FROM orders")
                .await
                .unwrap_or(0);
            a >= i64::from(STOCK) / 4
                && orders > 0
                && orders < a
                && provider.paid_2xx.lock().unwrap().len() >= paid
        },
    )
    .await;
}

/// The first order committed after `killed_at`, on whichever primary; seconds after it.
async fn first_order_after(env: &TestEnv, killed_at: DateTime<Utc>) -> f64 {
    let first = Arc::new(Mutex::new(None));
    eventually(120, "an order created on the new primary", || async {
        let Ok(pool) = seckill::pg::connect_pool(&env.settings.pg, 1).await else {
            return false;
        };
        let Ok(client) = pool.get().await else {
            return false;
        };
        let row = client
            .query_one(
                "SELECT min(created_at) FROM orders WHERE created_at > $1",
                &[&killed_at],
            )
            .await;
        let at: Option<DateTime<Utc>> = row.ok().and_then(|r| r.get(0));
        *first.lock().unwrap() = at;
        at.is_some()
    })
    .await;
    let at = first.lock().unwrap().expect("an order after the kill");
    (at - killed_at).num_milliseconds() as f64 / 1000.0
}

async fn stop(mut roles: Roles, env: TestEnv) {
    let _ = roles.api.terminate(20).await;
    let _ = roles.scan.terminate(20).await;
    let _ = roles.consume.terminate(40).await;
    if let Some(mut p) = roles.cancel.take() {
        let _ = p.terminate(20).await;
    }
    env.cleanup().await;
    pg_ha(&["down"]);
}

#[tokio::test]
#[ignore = "runs a PostgreSQL pair of its own and kills its primary: run by `make test-faults`"]
async fn the_primary_killed_with_a_synchronous_standby_loses_no_order_and_no_paid_payment() {
    let url = pair_up("sync");
    let env = Arc::new(TestEnv::with_topics_on(&url).await);
    env.activity(991, 1, STOCK).await;
    let roles = start_roles(&env, None).await;
    let provider = Arc::new(Provider::paying("true"));
    let paying = tokio::spawn(provider.clone().run(env.clone(), roles.api_port));
    let (load, accepted) = buyers(roles.api_port, 991, BUYERS);
    mid_sale(&env, &accepted, &provider, 10).await;
    let before = pg_ha(&["status"]);
    let old = field(&before, "primary");
    let killed_at = Utc::now();
    let paid_before = provider.paid_2xx.lock().unwrap().len();
    pg_ha(&["kill-primary"]);
    let promoted = Instant::now();
    pg_ha(&["wait-promoted", &old, "90"]);
    eprintln!(
        "promoted {:.1} s after the kill",
        promoted.elapsed().as_secs_f64()
    );
    let first = first_order_after(&env, killed_at).await;
    load.await.unwrap();
    assert!(accepted.load(Ordering::SeqCst) >= STOCK as usize);
    let report = common::sold_out_converged(&env, STOCK, 991).await;
    assert!(report.ok(), "{:?}", report.violations);
    // The new primary has no synchronous standby until the old one rejoins: payments are
    // refused meanwhile (503 PAYMENT_NOT_DURABLE, sent again), then every order is paid.
    pg_ha(&["rejoin", &old]);
    eventually(90, "every order paid", || async {
        try_count(&env, "SELECT count(*) FROM orders WHERE status = 'CREATED'").await == Some(0)
    })
    .await;
    provider.stop.store(true, Ordering::SeqCst);
    paying.await.unwrap();
    let missing = paid_2xx_not_paid(&env, &provider).await;
    let paid_2xx = provider.paid_2xx.lock().unwrap().len();
    let answers = provider.answers.lock().unwrap().clone();
    // The roles knew: each saw another primary.
    let (api_seen, scan_seen) = (
        metric(roles.api_ops, "pg_failovers_seen_total", "").await,
        metric(roles.scan_port, "pg_failovers_seen_total", "").await,
    );
    let after = pg_ha(&["status"]);
    eprintln!(
        "PG_FAILOVER sync: first order on the new primary {first:.2} s after the kill; \
         {paid_before} payments 2xx before it, {paid_2xx} in all, {} not PAID; \
         failovers seen api={api_seen} scan={scan_seen}; old primary {old} now standby={}; \
         answers {answers:?}",
        missing.len(),
        field(&after, "standby"),
    );
    assert!(missing.is_empty(), "answered 2xx but not PAID: {missing:?}");
    assert!(
        api_seen >= 1.0 && scan_seen >= 1.0,
        "the roles saw no failover"
    );
    assert_eq!(
        field(&after, "standby"),
        old,
        "the old primary rejoined as the standby"
    );
    stop(
        roles,
        Arc::into_inner(env).expect("the provider has stopped"),
    )
    .await;
}

/// Orders payable this long in the asynchronous run: cancellations (and their units' releases)
/// commit throughout, in the lag window too.
const PAY_WINDOW_SECS: u64 = 3;

/// Order ids of the activity CANCELED on whichever node is primary now.
async fn canceled(env: &TestEnv) -> BTreeSet<String> {
    let Ok(pool) = seckill::pg::connect_pool(&env.settings.pg, 1).await else {
        return BTreeSet::new();
    };
    let Ok(client) = pool.get().await else {
        return BTreeSet::new();
    };
    client
        .query("SELECT order_id FROM orders WHERE status = 'CANCELED'", &[])
        .await
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default()
}

/// Every order cancelled (no payment could be answered), every unit back, the invariants
/// holding and Redis agreeing with PostgreSQL.
async fn all_cancelled_and_back(env: &TestEnv, activity: i64) -> seckill::invariants::SkuFigures {
    eventually(240, "every order cancelled and every unit back", || async {
        let r = env.invariants(activity, 1).await;
        r.ok() && r.figures.unrecorded == 0 && r.figures.valid_orders == 0
    })
    .await;
    common::assert_no_stock_drift(env).await;
    env.invariants(activity, 1).await.figures
}

/// The primary killed while its asynchronous standby lags: the new primary lacks orders and
/// cancellations, the lost cancellations are done again, every unit comes back, and no payment was
/// answered 2xx, so none is lost.
///
/// One story: the standby is paused during the sale and the primary killed after it, so what the
/// new primary lacks and what is done again follow from that one failover.
#[tokio::test]
#[ignore = "runs a PostgreSQL pair of its own and kills its primary: run by `make test-faults`"]
async fn the_primary_killed_with_a_lagging_asynchronous_standby_loses_no_order_and_answers_no_payment_it_may_lose(
) {
    let url = pair_up("async");
    let env = Arc::new(TestEnv::with_topics_on(&url).await);
    env.activity(992, 1, STOCK).await;
    let roles = start_roles(&env, Some(PAY_WINDOW_SECS)).await;
    let provider = Arc::new(Provider::paying("true"));
    let paying = tokio::spawn(provider.clone().run(env.clone(), roles.api_port));
    // Units keep coming back: buyers for about 20 s, past the failover.
    let (load, _) = buyers(roles.api_port, 992, 4 * BUYERS);
    eventually(90, "orders created and cancelled", || async {
        !canceled(&env).await.is_empty()
    })
    .await;
    let old = field(&pg_ha(&["status"]), "primary");
    // The standby stops receiving WAL; the primary commits on for two seconds.
    pg_ha(&["pause-standby"]);
    let count_orders = "SELECT count(*) FROM orders";
    let at_pause = try_count(&env, count_orders).await.unwrap_or(0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let at_kill = try_count(&env, count_orders).await.unwrap_or(0);
    let canceled_at_kill = canceled(&env).await;
    let killed_at = Utc::now();
    // The kill also lets the stopped receiver go (without reading more): a receiver left
    // stopped would hold the promotion.
    pg_ha(&["kill-primary"]);
    pg_ha(&["wait-promoted", &old, "90"]);
    let on_new = try_count(&env, count_orders).await.unwrap_or(0);
    let canceled_on_new = canceled(&env).await;
    let lost_cancels: Vec<String> = canceled_at_kill
        .difference(&canceled_on_new)
        .cloned()
        .collect();
    let first = first_order_after(&env, killed_at).await;
    load.await.unwrap();
    let figures = all_cancelled_and_back(&env, 992).await;
    provider.stop.store(true, Ordering::SeqCst);
    paying.await.unwrap();
    let missing = paid_2xx_not_paid(&env, &provider).await;
    let paid_2xx = provider.paid_2xx.lock().unwrap().len();
    let answers = provider.answers.lock().unwrap().clone();
    let all_canceled = canceled(&env).await;
    let (scan_seen, resent, again) = (
        metric(roles.scan_port, "pg_failovers_seen_total", "").await,
        metric(
            roles.scan_port,
            "reservation_awaiting_checked_total",
            r#"verdict="resent""#,
        )
        .await,
        metric(
            roles.consume_port,
            "compensation_total",
            r#"result="already_released""#,
        )
        .await,
    );
    eprintln!(
        "PG_FAILOVER async: orders {at_pause} at the pause, {at_kill} at the kill, {on_new} on \
         the new primary: it lacked {} orders' transactions and {} cancellations; scan saw \
         {scan_seen} failover(s) and sent {resent} watched reservations again; cancellations \
         done again, their releases found already done {again} time(s); first order {first:.2} s \
         after the kill; {} orders cancelled in all ({} rejected), every unit back, invariants \
         hold, stock drift 0; payments answered 2xx {paid_2xx}, not PAID {}; answers {answers:?}",
        (at_kill - on_new).max(0),
        lost_cancels.len(),
        all_canceled.len(),
        figures.rejected,
        missing.len(),
    );
    // It bit: the new primary lacked orders and cancellations the old one had committed.
    assert!(
        on_new < at_kill && !lost_cancels.is_empty(),
        "the standby lacked nothing: the fault bit nothing"
    );
    // Each lost cancellation was done again on the new primary (the timeout sweep).
    let undone: Vec<&String> = lost_cancels
        .iter()
        .filter(|id| !all_canceled.contains(*id))
        .collect();
    assert!(
        undone.is_empty(),
        "lost cancellations never done again: {undone:?}"
    );
    assert!(scan_seen >= 1.0, "the scanner saw no failover");
    // Without a synchronous standby no payment was answered 2xx: the provider was told to
    // send them again, so none could be lost.
    assert!(missing.is_empty(), "answered 2xx but not PAID: {missing:?}");
    assert_eq!(
        paid_2xx, 0,
        "a payment answered 2xx without a synchronous standby"
    );
    assert!(
        answers.keys().any(|k| k == "503 PAYMENT_NOT_DURABLE"),
        "payments were refused as not durable: {answers:?}"
    );
    pg_ha(&["rejoin", &old]);
    stop(
        roles,
        Arc::into_inner(env).expect("the provider has stopped"),
    )
    .await;
}
