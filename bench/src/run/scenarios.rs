//! The scenarios of one `make bench` run, in the order they run (BENCHMARKS.md, "What is
//! measured, and against what"): the broker's raw rate, the order consumer on a backlog, the
//! relay on the events that left, the API (batched and unbatched sends, the trust layer, sold
//! out, the sale and its front door, many SKUs, duplicates, open loop), then the same routes
//! answered straight from PostgreSQL.

use std::time::{Duration, Instant};

use super::procs::{poll_until, wait_ready};
use super::tables::{like_pgbench_start, reset_order_tables};
use super::{Run, API, API_READY, BASELINE, BASELINE_READY, CONSUME_METRICS, SCAN_READY};
use crate::lines::quotient;
use crate::ratios::{median_at, Line};
use crate::tokens::Provisioned;
use anyhow::Context;

fn s(v: impl ToString) -> String {
    v.to_string()
}

/// Starts the API (with the current overrides) and waits until it is ready.
async fn api(run: &mut Run) -> anyhow::Result<()> {
    run.procs.start("api", &["api"], None)?;
    wait_ready(API_READY).await
}

/// The order consumer alone on a backlog: filled while no consumer runs, then drained by a
/// fresh one at nice 0, as pgbench runs (its rate against the database's, like for like).
pub(super) async fn backlog(
    run: &mut Run,
    label: &str,
    stock: i64,
    messages: usize,
    consume_args: &[&str],
) -> anyhow::Result<Line> {
    backlog_over(run, label, (stock, 1), messages, consume_args).await
}

/// [`backlog`] spread over `skus` SKUs of `stock` units each, in turn.
pub(super) async fn backlog_over(
    run: &mut Run,
    label: &str,
    (stock, skus): (i64, usize),
    messages: usize,
    consume_args: &[&str],
) -> anyhow::Result<Line> {
    let a = run.procs.activity(stock, skus).await?;
    run.procs.stop("consume").await;
    let base = |mode: &str| {
        vec![
            s("backlog"),
            s("--activity-id"),
            s(a),
            s("--skus"),
            s(skus),
            s("--messages"),
            s(messages),
            s(mode),
        ]
    };
    run.procs
        .bench_line(&format!("backlog-{label}-fill"), &base("--fill-only"))
        .await?;
    like_pgbench_start(run).await?;
    let mut all = vec!["consume"];
    all.extend_from_slice(consume_args);
    run.procs.start("consume", &all, Some(0))?;
    let mut drain = base("--drain-only");
    drain.extend([s("--summary-prefix"), format!("BACKLOG_{label}")]);
    // The CPU each process spends per order: the consumer, PostgreSQL, the broker, Redis.
    drain.extend(run.procs.cpu_args().await);
    let line = run
        .procs
        .bench_line(&format!("backlog-{label}"), &drain)
        .await?;
    run.procs.stop("consume").await;
    Ok(line)
}

/// Waits (up to 3 minutes) until the relay has published every outbox row due now, so a
/// scenario's figures carry its own background work, not its predecessors'.
pub(super) async fn quiesce(run: &Run) {
    let sql = "SELECT count(*) FROM {s}.event_outbox_by_day \
               WHERE status = 'PENDING' AND next_attempt_at <= now()";
    let started = Instant::now();
    let quiet = poll_until(
        Duration::from_secs(180),
        Duration::from_millis(200),
        || async move { run.count(sql).await == 0 },
    )
    .await;
    if quiet {
        eprintln!(
            "[bench] quiet: outbox drained ({:.1} s)",
            started.elapsed().as_secs_f64()
        );
    } else {
        eprintln!("[bench] outbox still has pending rows; measuring anyway");
    }
}

/// The arguments every `seckill-bench load` of the run shares: where, which SKU, how much.
fn load_args(
    run: &Run,
    api: &str,
    (a, sku): (i64, i64),
    requests: usize,
    buyers: usize,
) -> Vec<String> {
    let mut args = vec![s("load"), s("--api"), s(api), s("--activity-id"), s(a)];
    args.extend([s("--sku-id"), s(sku), s("--requests"), s(requests)]);
    args.extend([
        s("--buyers"),
        s(buyers),
        s("--concurrency"),
        s(run.concurrency),
    ]);
    args
}

/// One `seckill-bench load` through the API: `(activity, sku, skus, requests, buyers)`.
async fn api_bench(
    run: &Run,
    label: &str,
    (a, sku, skus, requests, buyers): (i64, i64, usize, usize, usize),
    extra: &[String],
) -> anyhow::Result<Line> {
    quiesce(run).await;
    let mut args = load_args(run, API, (a, sku), requests, buyers);
    let tail = [
        "--skus",
        &s(skus),
        "--scenario",
        label,
        "--summary-prefix",
        "BENCH",
    ];
    args.extend(tail.map(s));
    args.extend(run.procs.cpu_args().await);
    args.extend_from_slice(extra);
    run.procs.bench_line(&format!("bench-{label}"), &args).await
}

/// Accepted reservations/s through a fresh API, every request a new buyer (the activity holds
/// as many units as requests: every one must be accepted); `one_send_each` turns batched
/// sends off. `env` applies to the API and the load generator alike.
async fn accept_run(
    run: &mut Run,
    label: &str,
    one_send_each: bool,
    a: i64,
    env: &[(&str, &str)],
    extra: &[&str],
) -> anyhow::Result<Line> {
    let mut vars = env.to_vec();
    if one_send_each {
        vars.push(("SECKILL__MQ__SEND_BATCH_MAX", "1"));
    }
    run.procs.set_env(&vars);
    api(run).await?;
    let n = run.sizes.api_requests;
    let mut args = vec![
        s("--dup-request-share"),
        s(0),
        s("--repeat-buyer-share"),
        s(0),
        s("--stock"),
        s(n),
    ];
    args.extend(extra.iter().map(s));
    let line = api_bench(run, label, (a, 1, 1, n, n), &args).await;
    run.procs.stop("api").await;
    run.procs.set_env(&[]);
    line
}

/// The sale through the whole pipeline, then through the front door alone (the consumer
/// stopped: the API, Redis and the broker have the cores), after which the consumer turns
/// that backlog into orders. Needs api, consume and scan running.
async fn sale_pair(run: &mut Run) -> anyhow::Result<()> {
    let z = run.sizes;
    eprintln!(
        "[bench] the sale: {} requests by {} buyers for {} units",
        z.sale_requests, z.sale_buyers, z.sale_stock
    );
    pg_statements(run, None).await;
    let a = run.procs.activity(z.sale_stock, 1).await?;
    let sale_shape = |a| (a, 1, 1, z.sale_requests, z.sale_buyers);
    let sale = api_bench(run, "hot-sku", sale_shape(a), &[]).await?;
    run.keep("SALE", sale);
    let statements = run.procs.dir.join("sale-pg-statements.txt");
    pg_statements(run, Some(&statements)).await;
    // The order roles' own view of this run, before the consumer is stopped for the next one.
    if let Ok(r) = reqwest::get(CONSUME_METRICS).await {
        let text = r.text().await.unwrap_or_default();
        std::fs::write(run.procs.dir.join("consume-sale.metrics"), text)?;
    }
    eprintln!("[bench] the same sale, the front door alone (the consumer stopped)");
    run.procs.stop("consume").await;
    let a = run.procs.activity(z.sale_stock, 1).await?;
    let front = api_bench(
        run,
        "hot-sku-front-door",
        sale_shape(a),
        &[s("--load-only")],
    )
    .await?;
    let accepted = front.num("accepted").unwrap_or(0.0) as i64;
    run.keep("SALE_FRONT", front);
    run.procs.restart_consume().await?;
    run.wait_recorded(&[a], accepted).await;
    Ok(())
}

/// The same sale answered by the direct-PostgreSQL server (started with stock for `a`).
async fn baseline_sale(run: &mut Run, a: i64) -> anyhow::Result<()> {
    let z = run.sizes;
    let line = baseline_load(
        run,
        "baseline-sale",
        a,
        z.sale_requests,
        z.sale_buyers,
        &[s("--stock"), s(z.sale_stock)],
    )
    .await?;
    run.keep("BASE_SALE", line);
    Ok(())
}

/// One `seckill-bench load --load-only` against the baseline server.
async fn baseline_load(
    run: &Run,
    label: &str,
    a: i64,
    requests: usize,
    buyers: usize,
    extra: &[String],
) -> anyhow::Result<Line> {
    let mut args = load_args(run, BASELINE, (a, 1), requests, buyers);
    args.extend(["--load-only", "--scenario", label].map(s));
    args.extend_from_slice(extra);
    run.procs.bench_line(label, &args).await
}

/// Where PostgreSQL's time goes during the sale, when the server has pg_stat_statements
/// loaded (the bench does not change the server's settings): `None` resets the statistics,
/// `Some(file)` saves the top statements by total time.
async fn pg_statements(run: &Run, save: Option<&std::path::Path>) {
    let loaded = match run.pg.query_one("SHOW shared_preload_libraries", &[]).await {
        Ok(row) => row.get::<_, String>(0).contains("pg_stat_statements"),
        Err(_) => false,
    };
    let ready = loaded
        && run
            .pg
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await
            .is_ok();
    if !ready {
        return;
    }
    let Some(file) = save else {
        let _ = run
            .pg
            .batch_execute("SELECT pg_stat_statements_reset()")
            .await;
        return;
    };
    let rows = run
        .pg
        .query(
            "SELECT calls, round(total_exec_time::numeric, 1)::text,
                    round((total_exec_time / calls)::numeric, 3)::text, rows, wal_bytes::text,
                    left(regexp_replace(query, '\\s+', ' ', 'g'), 110)
             FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 25",
            &[],
        )
        .await;
    let mut text = String::from("calls | total_ms | mean_ms | rows | wal_bytes | query\n");
    for r in rows.unwrap_or_default() {
        let (calls, total, mean, n, wal, q): (i64, String, String, i64, String, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5));
        text.push_str(&format!("{calls} | {total} | {mean} | {n} | {wal} | {q}\n"));
    }
    let _ = std::fs::write(file, text);
}

/// `make bench-sale`: the sale's three runs alone.
pub async fn only_sale(run: &mut Run) -> anyhow::Result<()> {
    run.procs.restart_consume().await?;
    run.procs.start("scan", &["scan"], None)?;
    wait_ready(SCAN_READY).await?;
    api(run).await?;
    sale_pair(run).await?;
    run.procs.stop_all().await;
    let a = chrono::Utc::now().timestamp();
    let stock = format!("{a}:1:{}", run.sizes.sale_stock);
    run.procs
        .start_baseline(&[s("--pool"), s(16), s("--stock"), stock])?;
    wait_ready(BASELINE_READY).await?;
    baseline_sale(run, a).await
}

/// `make bench-relay`: the relay as `make bench` measures it: the broker's raw rate (its
/// baseline), the order backlogs whose events it relays, then the relay.
pub async fn only_relay(run: &mut Run) -> anyhow::Result<()> {
    broker(run).await?;
    order_consumer(run).await?;
    super::relay::relay(run).await
}

/// `make bench-orders`: the order consumer alone on a backlog, batched, as `make bench`
/// measures it (`B_BATCH`), for the figures beside pgbench's batch.
pub async fn only_orders(run: &mut Run) -> anyhow::Result<()> {
    eprintln!("[bench] order consumer on a backlog, one hot SKU");
    let z = run.sizes;
    run.procs
        .set_env(&[("SECKILL__SCAN__TIMER_LEAD_SECS", "86400")]);
    batched_rounds(run, (z.backlog * 2) as i64, z.backlog).await?;
    run.procs.set_env(&[]);
    Ok(())
}

/// pgbench's batch, then the consumer draining a backlog of `messages`, `Sizes::order_rounds`
/// times back to back; the round whose ratio is the median is kept (`PGBENCH_BATCH` and
/// `B_BATCH`), every round's ratio beside it and the other rounds' verdicts (`ORDER_ROUNDS`).
/// The machine's speed moves by as much as 2× within an hour and a drain lasts seconds: a
/// floor measured minutes before the drain, or a single pair, says more about the machine's
/// moment than about the code.
/// Every drain starts on order tables emptied as pgbench's are before each of its runs
/// ([`reset_order_tables`]), not on the rows of the rounds before it while the floor starts
/// afresh each time.
async fn batched_rounds(run: &mut Run, stock: i64, messages: usize) -> anyhow::Result<()> {
    let mut rounds = Vec::new();
    let batch = run.settings.consumer.batch_size;
    for r in 1..=run.sizes.order_rounds {
        eprintln!("[bench] round {r}: pgbench's batch, then the consumer's drain");
        let floor = run
            .procs
            .pgbench_batch(&format!("limits-batch-r{r}"), batch)
            .await?;
        reset_order_tables(run).await?;
        let drain = backlog(run, "batched", stock, messages, &[]).await?;
        rounds.push((floor, drain));
    }
    let ratios: Vec<f64> = rounds
        .iter()
        .map(|(floor, drain)| {
            let (d, f) = (
                drain.num("orders_per_s"),
                floor.num("pgbench_batch_orders_per_s"),
            );
            quotient(d, f).unwrap_or(f64::NAN)
        })
        .collect();
    let at = median_at(&ratios).context("no round ran")?;
    let listed: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    eprintln!(
        "[bench] order_vs_pgbench_batch by round: {} (the median kept: round {})",
        listed.join(", "),
        at + 1
    );
    let (floor, drain) = rounds.swap_remove(at);
    // The other rounds' verdicts and broken invariants count too (the kept one's are B_BATCH's).
    let verdict = if rounds.iter().all(|(_, d)| d.ok()) {
        "OK"
    } else {
        "FAILED"
    };
    let violations: f64 = rounds
        .iter()
        .map(|(_, d)| d.num("violations").unwrap_or(1.0))
        .sum();
    run.keep("PGBENCH_BATCH", floor);
    run.keep("B_BATCH", drain);
    run.keep(
        "ORDER_ROUNDS",
        Line::parse(&format!(
            "ORDER_ROUNDS {verdict} rounds={} median_round={} ratios={} violations={violations}",
            ratios.len(),
            at + 1,
            listed.join("/")
        )),
    );
    Ok(())
}

/// The whole of `make bench` after the limits.
pub async fn whole(run: &mut Run, keys: &[Provisioned]) -> anyhow::Result<()> {
    broker(run).await?;
    order_consumer(run).await?;
    super::relay::relay(run).await?;
    send_path(run, keys).await?;
    through_the_api(run).await?;
    super::fair::fairness(run).await?;
    baseline(run, keys).await
}

/// The broker's raw send rate, one message per call and batched.
async fn broker(run: &mut Run) -> anyhow::Result<()> {
    eprintln!("[bench] broker raw send rate");
    for (name, batch, senders) in [("BROKER1", 1, 16), ("BROKER32", 32, 4)] {
        let args = [
            s("broker"),
            s("--batch"),
            s(batch),
            s("--senders"),
            s(senders),
            s("--seconds"),
            s(5),
        ];
        let line = run.procs.bench_line(&name.to_lowercase(), &args).await?;
        run.keep(name, line);
    }
    Ok(())
}

/// The order consumer on a backlog, one hot SKU: batched, with `--workers` far past the
/// budget, and one order per transaction. These orders' timers are written due at once (a
/// lead longer than the pay window), so the relay then relays both kinds of event, as a relay
/// catching up on a backlog does.
async fn order_consumer(run: &mut Run) -> anyhow::Result<()> {
    eprintln!("[bench] order consumer on a backlog, one hot SKU");
    let z = run.sizes;
    let lead = ("SECKILL__SCAN__TIMER_LEAD_SECS", "86400");
    run.procs.set_env(&[lead]);
    let stock = (z.backlog * 2) as i64;
    // Each round starts on emptied order tables, so the relay below measures the outbox of one
    // batched drain (the last round's) with the two drains after it, as in a run without rounds.
    batched_rounds(run, stock, z.backlog).await?;
    let line = backlog(run, "workers64", stock, z.backlog, &["--workers", "64"]).await?;
    run.keep("B_WIDE", line);
    run.procs
        .set_env(&[lead, ("SECKILL__CONSUMER__BATCH_SIZE", "1")]);
    let stock = (z.backlog_single * 2) as i64;
    let line = backlog(run, "single", stock, z.backlog_single, &[]).await?;
    run.keep("B_SINGLE", line);
    run.procs.set_env(&[]);
    run.procs.restart_consume().await
}

/// The send path alone (the consumer stopped: the load generator, the API, Redis and the
/// broker have the cores): batched against one send each, then the trust layer's cost in two
/// alternating pairs (a pair moves by 10-20 % from run to run here). With the consumer
/// stopped, the order queue's lag passes the fail-closed bound (a fifth of the validity) within
/// the first runs on a slow machine, and every request after it is refused: every run here gets
/// the whole validity. Then the front door's ceilings (wrk, bench/src/run/ceilings.rs).
async fn send_path(run: &mut Run, keys: &[Provisioned]) -> anyhow::Result<()> {
    run.procs.stop("consume").await;
    let n = run.sizes.api_requests as i64;
    let only = ["--load-only"];
    let open = ("SECKILL__API__FAIL_CLOSED_SHARE", "1.0");
    let mut activities = Vec::new();
    for (name, label, single) in [
        ("I_BATCHED", "accept-batched-send-path", false),
        ("I_SINGLE", "accept-unbatched-send-path", true),
    ] {
        let a = run.procs.activity(n, 1).await?;
        activities.push(a);
        eprintln!("[bench] {label}: accepted reservations/s");
        let line = accept_run(run, label, single, a, &[open], &only).await?;
        run.keep(name, line);
    }
    let off = [open, ("SECKILL__AUTH__BUYERS", "body")];
    let on = [
        open,
        ("SECKILL__API__BUYER_RATE_PER_SEC", "5"),
        ("SECKILL__API__BUYER_BURST", "10"),
        ("SECKILL__API__ADDRESS_RATE_PER_SEC", "10000000"),
        ("SECKILL__API__ADDRESS_BURST", "10000000"),
    ];
    for (name, label, env) in [
        ("T_OFF", "accept-trust-off-1", &off[..]),
        ("T_ON", "accept-trust-on-1", &on[..]),
        ("T_OFF2", "accept-trust-off-2", &off[..]),
        ("T_ON2", "accept-trust-on-2", &on[..]),
    ] {
        let a = run.procs.activity(n, 1).await?;
        activities.push(a);
        let line = accept_run(run, label, false, a, env, &only).await?;
        run.keep(name, line);
    }
    run.procs.restart_consume().await?;
    // The next scenarios start once the consumer has turned that backlog into orders.
    let accepted: f64 = ["I_BATCHED", "I_SINGLE", "T_OFF", "T_ON", "T_OFF2", "T_ON2"]
        .iter()
        .filter_map(|n| run.lines.get(n)?.num("accepted"))
        .sum();
    run.wait_recorded(&activities, accepted as i64).await;
    super::ceilings::api_ceilings(run, keys).await
}

/// Through the API with the whole pipeline running: batched and unbatched sends, sold-out
/// answers from Redis and from the API's memory, the sale and its front door, many SKUs,
/// duplicate-heavy traffic (every order then paid), an open loop.
async fn through_the_api(run: &mut Run) -> anyhow::Result<()> {
    let z = run.sizes;
    let n = z.api_requests;
    for (name, label, single) in [
        ("A_BATCHED", "accept-batched", false),
        ("A_SINGLE", "accept-unbatched", true),
    ] {
        let a = run.procs.activity(n as i64, 1).await?;
        let line = accept_run(run, label, single, a, &[], &[]).await?;
        run.keep(name, line);
    }
    // Sold out: every answer from Redis (the API's memory off), then with it on.
    for (name, label, memory) in [
        ("SOLDOUT_REDIS", "sold-out-redis", false),
        ("SOLDOUT", "sold-out", true),
    ] {
        if !memory {
            run.procs
                .set_env(&[("SECKILL__API__SOLD_OUT_POLL_MS", "0")]);
        }
        api(run).await?;
        run.procs.set_env(&[]);
        let a = run.procs.activity(0, 1).await?;
        let line = api_bench(run, label, (a, 1, 1, n, n), &[]).await?;
        run.keep(name, line);
        if !memory {
            run.procs.stop("api").await;
        }
    }
    sale_pair(run).await?;
    let a = run.procs.activity(z.sale_stock / 10, 20).await?;
    let line = api_bench(run, "many-skus", (a, 1, 20, n / 2, n / 2), &[]).await?;
    run.keep("MANY", line);
    let a = run.procs.activity(z.sale_stock, 1).await?;
    let dups = [
        "--dup-request-share",
        "0.4",
        "--repeat-buyer-share",
        "0.3",
        "--pay-share",
        "1.0",
    ]
    .map(s);
    let line = api_bench(run, "duplicates", (a, 1, 1, n / 2, n / 8), &dups).await?;
    run.keep("DUPS", line);
    let a = run.procs.activity(z.sale_stock, 1).await?;
    let rate = [s("--rate"), s(2000)];
    let line = api_bench(run, "open-loop", (a, 1, 1, n / 2, n / 2), &rate).await?;
    run.keep("OPEN", line);
    run.procs.stop_all().await;
    Ok(())
}

/// The baseline a team would otherwise build: the same route, one statement straight to
/// PostgreSQL: sold-out answers, purchases, and the same sale.
async fn baseline(run: &mut Run, keys: &[Provisioned]) -> anyhow::Result<()> {
    let z = run.sizes;
    let buy_a = chrono::Utc::now().timestamp();
    let sale_a = buy_a + 1;
    run.procs.start_baseline(&[
        s("--pool"),
        s(16),
        s("--stock"),
        s("1:1:0"),
        s("--stock"),
        format!("{buy_a}:1:2000000000"),
        s("--stock"),
        format!("{sale_a}:1:{}", z.sale_stock),
    ])?;
    wait_ready(BASELINE_READY).await?;
    eprintln!("[bench] baseline (direct PostgreSQL over HTTP): sold-out answers and purchases");
    let n = z.api_requests;
    let line = baseline_load(run, "baseline-sold-out", 1, n, n, &[s("--stock"), s(0)]).await?;
    run.keep("BASE_SOLDOUT", line);
    let buy = [
        "--stock",
        "2000000000",
        "--dup-request-share",
        "0",
        "--repeat-buyer-share",
        "0",
    ]
    .map(s);
    let line = baseline_load(run, "baseline-buy", buy_a, n / 3, n / 3, &buy).await?;
    run.keep("BASE_BUY", line);
    super::ceilings::baseline_ceiling(run, keys, BASELINE, 1).await?;
    baseline_sale(run, sale_a).await
}
