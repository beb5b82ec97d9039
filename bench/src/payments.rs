//! `seckill-bench payments`: the payment path's ORDER_PAID delivered through the outbox and as
//! a RocketMQ transaction message, side by side (docs/architecture/messages.md#delivering-events).
//!
//! For each mode, on a schema and topics of its own: `--orders` unpaid orders are written
//! straight into PostgreSQL, the API (in this process, `events.order_paid` = the mode) and the
//! scan role (its relay, in both modes) are started, a consumer group of its own collects the
//! order-event topic, and `--concurrency` signed payment notifications at a time pay every
//! order. Figures: events/s from the first notification to the last ORDER_PAID delivered;
//! notification→delivery and notification→answer percentiles; PostgreSQL work per event
//! (transactions and rows written from `pg_stat_database`, read once idle backends have
//! reported them; WAL bytes from `pg_current_wal_lsn` deltas up to the last delivery). The modes alternate over `--rounds`.
//!
//! `PAYMENTS mode=… orders=… events_per_s=… deliver_p50_ms=… deliver_p99_ms=…
//! answer_p50_ms=… answer_p99_ms=… xacts_per_event=… rows_per_event=… wal_bytes_per_event=…
//! duplicates=…`, then `PAYMENTS_RATIOS transaction/outbox events_per_s=… deliver_p50=…
//! deliver_p99=… wal_bytes=…`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use hdrhistogram::Histogram;
use secrecy::SecretString;

use seckill::config::{BuyerIdentity, EventDelivery, Settings};
use seckill::mq::{BatchHandler, ConsumeDecision, Delivery};

#[derive(Debug, Clone, Args)]
pub struct PaymentsArgs {
    /// Orders paid per mode and round.
    #[arg(long, default_value_t = 2_000)]
    pub orders: usize,
    /// Notifications in flight at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Rounds; each runs both modes, alternating which goes first.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Give up waiting for deliveries after this long without one.
    #[arg(long, default_value_t = 60)]
    pub stall_secs: u64,
}

/// First delivery time of each ORDER_PAID, and how many copies came beyond the first.
#[derive(Default)]
struct Arrivals {
    first: Mutex<HashMap<String, Instant>>,
    duplicates: Mutex<u64>,
}

#[async_trait::async_trait]
impl BatchHandler for Arrivals {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let now = Instant::now();
        let mut first = self.first.lock().unwrap();
        for d in batch.iter().filter(|d| d.tags == "ORDER_PAID") {
            if first.insert(d.keys.clone(), now).is_some() {
                *self.duplicates.lock().unwrap() += 1;
            }
        }
        ConsumeDecision::Ack
    }
}

#[derive(Debug, Clone, Default)]
struct Figures {
    events_per_s: f64,
    deliver_p50_ms: f64,
    deliver_p99_ms: f64,
    answer_p50_ms: f64,
    answer_p99_ms: f64,
    xacts_per_event: f64,
    rows_per_event: f64,
    wal_bytes_per_event: f64,
    duplicates: u64,
}

pub async fn run(settings: Settings, args: PaymentsArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.orders > 0 && args.concurrency > 0 && args.rounds > 0,
        "--orders, --concurrency and --rounds must be positive"
    );
    let mut all: HashMap<&'static str, Vec<Figures>> = HashMap::new();
    for round in 0..args.rounds {
        let order = if round % 2 == 0 {
            [EventDelivery::Outbox, EventDelivery::Transaction]
        } else {
            [EventDelivery::Transaction, EventDelivery::Outbox]
        };
        for mode in order {
            let f = one_mode(&settings, mode, &args).await?;
            println!(
                "PAYMENTS mode={} round={round} orders={} events_per_s={:.0} deliver_p50_ms={:.1} \
                 deliver_p99_ms={:.1} answer_p50_ms={:.1} answer_p99_ms={:.1} xacts_per_event={:.2} \
                 rows_per_event={:.2} wal_bytes_per_event={:.0} duplicates={}",
                mode.label(),
                args.orders,
                f.events_per_s,
                f.deliver_p50_ms,
                f.deliver_p99_ms,
                f.answer_p50_ms,
                f.answer_p99_ms,
                f.xacts_per_event,
                f.rows_per_event,
                f.wal_bytes_per_event,
                f.duplicates
            );
            all.entry(mode.label()).or_default().push(f);
        }
    }
    let mean = |mode: &str, pick: fn(&Figures) -> f64| {
        let v = &all[mode];
        v.iter().map(pick).sum::<f64>() / v.len() as f64
    };
    let ratio = |pick: fn(&Figures) -> f64| mean("transaction", pick) / mean("outbox", pick);
    println!(
        "PAYMENTS_RATIOS transaction/outbox events_per_s={:.2} deliver_p50={:.2} deliver_p99={:.2} \
         answer_p50={:.2} answer_p99={:.2} xacts={:.2} rows={:.2} wal_bytes={:.2}",
        ratio(|f| f.events_per_s),
        ratio(|f| f.deliver_p50_ms),
        ratio(|f| f.deliver_p99_ms),
        ratio(|f| f.answer_p50_ms),
        ratio(|f| f.answer_p99_ms),
        ratio(|f| f.xacts_per_event),
        ratio(|f| f.rows_per_event),
        ratio(|f| f.wal_bytes_per_event),
    );
    Ok(true)
}

/// The settings of one mode's run: its own schema, topics and groups.
fn mode_settings(base: &Settings, mode: EventDelivery) -> anyhow::Result<Settings> {
    let mut s = base.clone();
    let tag = match mode {
        EventDelivery::Outbox => "OB",
        EventDelivery::Transaction => "TX",
    };
    s.env = format!("{}PAY{tag}", base.env);
    s.pg.schema = format!("{}_pay_{}", base.pg.schema, tag.to_lowercase());
    s.redis.key_prefix = format!("{}-pay-{}", base.redis.key_prefix, tag.to_lowercase());
    s.events.order_paid = Some(mode);
    s.api.listen = "127.0.0.1:0".parse()?;
    s.scan.metrics_listen = "127.0.0.1:0".parse()?;
    // The payment route does not read buyer tokens; the provider's secret is this run's.
    s.auth.buyers = BuyerIdentity::Body;
    if s.payments.webhook_secrets.is_empty() {
        s.payments.webhook_secrets = vec![SecretString::from(format!(
            "whsec-bench-{}",
            ulid::Ulid::new()
        ))];
    }
    s.validate()?;
    Ok(s)
}

/// PostgreSQL's counters: WAL position, committed transactions, rows written.
async fn pg_counters(client: &tokio_postgres::Client) -> anyhow::Result<(String, i64, i64)> {
    let r = client
        .query_one(
            "SELECT pg_current_wal_lsn()::text, xact_commit,
                    tup_inserted + tup_updated + tup_deleted
             FROM pg_stat_database WHERE datname = current_database()",
            &[],
        )
        .await?;
    Ok((r.get(0), r.get(1), r.get(2)))
}

/// One mode's run on a schema and topics of its own, left as it found them.
async fn one_mode(
    base: &Settings,
    mode: EventDelivery,
    args: &PaymentsArgs,
) -> anyhow::Result<Figures> {
    let s = mode_settings(base, mode)?;
    let (admin, conn) = seckill::pg::connect_one(&s.pg).await?;
    let conn = tokio::spawn(conn);
    drop_schema(&admin, &s).await?;
    seckill::pg::migrate_contracting_new(&s.pg).await?;
    let (plan, groups) = seckill::roles::ops::topics::create_all(&s).await?;
    let orders = unpaid_orders(&s, args.orders).await?;
    let roles = Roles::start(&s).await?;

    let before = pg_counters(&admin).await?;
    let started = Instant::now();
    let answered = pay_all(&s, &roles.base_url, orders, args.concurrency).await?;
    wait_delivered(&roles.arrivals, mode, args).await?;
    let first = roles.arrivals.first.lock().unwrap().clone();
    let last = first.values().max().copied().unwrap_or(started);
    let elapsed = last.duration_since(started).as_secs_f64();
    let wal_after = pg_counters(&admin).await?.0;
    // A backend that goes idle reports its counters only after 10 s (PostgreSQL's
    // PGSTAT_IDLE_INTERVAL): read them once that has passed.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let after = pg_counters(&admin).await?;
    let wal: f64 = admin
        .query_one(
            "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::float8",
            &[&wal_after, &before.0],
        )
        .await?
        .get(0);

    let mut deliver = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    let mut answer = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3)?;
    for (order, (sent, answered)) in &answered {
        if let Some(at) = first.get(order) {
            deliver.record(at.saturating_duration_since(*sent).as_micros().max(1) as u64)?;
        }
        answer.record(answered.duration_since(*sent).as_micros().max(1) as u64)?;
    }
    let n = args.orders as f64;
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    let figures = Figures {
        events_per_s: n / elapsed.max(1e-9),
        deliver_p50_ms: ms(&deliver, 0.5),
        deliver_p99_ms: ms(&deliver, 0.99),
        answer_p50_ms: ms(&answer, 0.5),
        answer_p99_ms: ms(&answer, 0.99),
        xacts_per_event: (after.1 - before.1) as f64 / n,
        rows_per_event: (after.2 - before.2) as f64 / n,
        wal_bytes_per_event: wal / n,
        duplicates: *roles.arrivals.duplicates.lock().unwrap(),
    };

    let collector = roles.stop().await;
    drop_schema(&admin, &s).await?;
    let topics: Vec<String> = plan.into_iter().map(|(t, _)| t).collect();
    seckill::mq::delete_topics(&s, &topics).await?;
    let mut groups: Vec<String> = groups.into_iter().map(|g| g.name).collect();
    groups.push(collector);
    seckill::mq::delete_groups(&s, &groups).await?;
    drop(admin);
    conn.abort();
    Ok(figures)
}

async fn drop_schema(admin: &tokio_postgres::Client, s: &Settings) -> anyhow::Result<()> {
    let sql = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", s.pg.schema);
    Ok(admin.batch_execute(&sql).await?)
}

/// `n` unpaid orders of a new activity, written straight into PostgreSQL; their ids.
async fn unpaid_orders(s: &Settings, n: usize) -> anyhow::Result<Vec<String>> {
    let (pool, activity) = (seckill::pg::connect_pool(&s.pg, 2).await?, 1_i64);
    let now = chrono::Utc::now();
    let mut c = pool.get().await?;
    let spec = seckill::pg::queries::ActivitySpec {
        activity_id: activity,
        name: "payments bench".into(),
        starts_at: now - chrono::Duration::seconds(1),
        ends_at: now + chrono::Duration::hours(1),
        reservation_valid_secs: 300,
        skus: vec![(1, n as i32, 100)],
        stock_buckets: 1,
    };
    let client: &mut tokio_postgres::Client = &mut c;
    seckill::pg::queries::create_activity(client, &spec, now).await?;
    let ids: Vec<seckill::domain::Ids> = (0..n)
        .map(|_| seckill::domain::Ids::generate(activity, 0))
        .collect();
    let orders: Vec<&str> = ids.iter().map(|i| i.order_id.as_str()).collect();
    let reservations: Vec<&str> = ids.iter().map(|i| i.reservation_id.as_str()).collect();
    let users: Vec<i64> = (1..=n as i64).collect();
    c.execute(
        "INSERT INTO orders (order_id, reservation_id, activity_id, sku_id, user_id, amount_cents,
                             status, expires_at, reserved_at)
         SELECT o, r, $1, 1, u, 100, 'CREATED', now() + interval '1 hour', now()
         FROM unnest($2::text[], $3::text[], $4::int8[]) AS t(o, r, u)",
        &[&activity, &orders, &reservations, &users],
    )
    .await?;
    Ok(ids.into_iter().map(|i| i.order_id).collect())
}

/// The roles of one mode, in this process: the API, the relay (scan), and a collector group
/// of its own on the order-event topic.
struct Roles {
    arrivals: Arc<Arrivals>,
    base_url: String,
    collector: String,
    consumer: seckill::mq::ConsumerHandle,
    api_stop: tokio_util::sync::CancellationToken,
    api: tokio::task::JoinHandle<anyhow::Result<()>>,
    scan_stop: tokio_util::sync::CancellationToken,
    scan: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Roles {
    async fn start(s: &Settings) -> anyhow::Result<Self> {
        let arrivals = Arc::new(Arrivals::default());
        let collector = format!("CG_{}_BENCH_COLLECTOR", s.env);
        let group = seckill::roles::ops::topics::tool_group(s, &collector);
        seckill::mq::create_groups(s, &[group]).await?;
        let consumer = seckill::mq::start_consumer(
            s,
            &collector,
            &s.names().order_event_topic,
            arrivals.clone(),
            4,
            32,
        )
        .await?;
        let scan_stop = tokio_util::sync::CancellationToken::new();
        let scan = tokio::spawn(seckill::roles::scan::run_until(
            s.clone(),
            scan_stop.clone(),
        ));
        let publisher = seckill::mq::connect_publisher(s).await?;
        let state = seckill::roles::api::build_state(Arc::new(s.clone()), publisher).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}", listener.local_addr()?);
        let api_stop = tokio_util::sync::CancellationToken::new();
        let api = tokio::spawn(seckill::roles::api::serve(
            listener,
            state,
            api_stop.clone(),
        ));
        // The consumer's first rebalance takes a moment; payments wait for it to hold queues.
        tokio::time::sleep(Duration::from_secs(3)).await;
        Ok(Self {
            arrivals,
            base_url,
            collector,
            consumer,
            api_stop,
            api,
            scan_stop,
            scan,
        })
    }

    /// Stops every role; the collector group's name, to delete.
    async fn stop(self) -> String {
        self.api_stop.cancel();
        let _ = self.api.await;
        self.scan_stop.cancel();
        let _ = self.scan.await;
        self.consumer.shutdown().await;
        self.collector
    }
}

/// Pays every order with a signed notification, `concurrency` in flight; for each order
/// answered 2xx, when it was sent and answered. Fails if any was not.
async fn pay_all(
    s: &Settings,
    base_url: &str,
    orders: Vec<String>,
    concurrency: usize,
) -> anyhow::Result<HashMap<String, (Instant, Instant)>> {
    let secret = s.payments.webhook_secrets[0].clone();
    let http = reqwest::Client::new();
    let answered: Arc<Mutex<HashMap<String, (Instant, Instant)>>> = Arc::default();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let orders = Arc::new(orders);
    let url = format!("{base_url}/v1/payments/notifications");
    let mut payers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (http, url, secret, answered, next, orders) = (
            http.clone(),
            url.clone(),
            secret.clone(),
            answered.clone(),
            next.clone(),
            orders.clone(),
        );
        payers.spawn(async move {
            let mut failed = 0usize;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(order) = orders.get(i) else { break };
                let body = serde_json::json!({
                    "order_id": order, "payment_id": format!("pay-{i}"), "amount_cents": 100,
                })
                .to_string();
                let sig = seckill::auth::signature::sign(
                    &secret,
                    chrono::Utc::now().timestamp(),
                    body.as_bytes(),
                );
                let sent = Instant::now();
                let r = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .header("seckill-signature", sig)
                    .body(body)
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status().is_success() => {
                        answered
                            .lock()
                            .unwrap()
                            .insert(order.clone(), (sent, Instant::now()));
                    }
                    _ => failed += 1,
                }
            }
            failed
        });
    }
    let mut failed = 0;
    while let Some(r) = payers.join_next().await {
        failed += r?;
    }
    anyhow::ensure!(failed == 0, "{failed} payment notifications failed");
    let answered = std::mem::take(&mut *answered.lock().unwrap());
    Ok(answered)
}

/// Every ORDER_PAID delivered, waiting while deliveries progress.
async fn wait_delivered(
    arrivals: &Arrivals,
    mode: EventDelivery,
    args: &PaymentsArgs,
) -> anyhow::Result<()> {
    let mut seen = 0;
    let mut progress = Instant::now();
    loop {
        let n = arrivals.first.lock().unwrap().len();
        if n >= args.orders {
            return Ok(());
        }
        if n > seen {
            (seen, progress) = (n, Instant::now());
        }
        anyhow::ensure!(
            progress.elapsed() < Duration::from_secs(args.stall_secs),
            "{}: {n} of {} ORDER_PAID delivered, none for {} s",
            mode.label(),
            args.orders,
            args.stall_secs
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
