//! `seckill scan`: the recovery loops that make every send eventually happen, and the
//! retention of settled bookkeeping rows.
//!
//! - `resend`: the reservation re-send scanner (Redis → broker);
//! - `unconsumed`: confirmed sends the consumers never took (a broker that died holding them)
//!   sent again;
//! - `relay`: the outbox relay (PostgreSQL → broker), woken by LISTEN/NOTIFY;
//! - `retention`: deletes settled inbox, outbox and task rows past their retention.
//!
//! Several `scan` processes may run at once: the leases keep them out of each other's way.

mod copies;
mod draws;
pub mod rebalance;
pub mod relay;
pub mod resend;
mod retention;
pub mod unconsumed;

pub use crate::pg::outbox::outbox_message;
pub use copies::event_from_reservation;
pub use relay::Relay;
pub use resend::{ScanStats, Scanner};

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::budget::pools;
use crate::config::Settings;
use crate::pg::primary::Failovers;
use crate::redis::RedisStore;
use crate::roles::runtime::RoleRuntime;

/// `seckill scan`.
pub async fn run(settings: Settings) -> anyhow::Result<()> {
    run_until(settings, CancellationToken::new()).await
}

/// [`run`], stopping also when `stop` fires (the benchmarks run the role in their process).
pub async fn run_until(settings: Settings, stop: CancellationToken) -> anyhow::Result<()> {
    let settings = Arc::new(settings);
    let sc = settings.scan.clone();
    let redis = RedisStore::connect(&settings.redis).await?;
    let pool = crate::pg::connect_pool(&settings.pg, pools::SCAN_RELAY).await?;
    let publisher = crate::mq::connect_publisher(&settings).await?;
    let role = RoleRuntime::start("scan", "scan.metrics_listen", sc.metrics_listen).await?;
    let (watchdog, shutdown) = (&role.watchdog, &role.shutdown);
    let wake = Arc::new(Notify::new());
    let listen = relay::listen(settings.clone(), wake.clone(), shutdown.clone());
    let listener = watchdog.spawn("outbox_listen", listen);
    // The scanner's own connection: it settles refused, uncertain reservations (rare).
    let settle_pool = crate::pg::connect_pool(&settings.pg, pools::SCAN_SCANNER).await?;
    let settle_watch = settle_pool.clone();
    let redis_for_resync = redis.clone();
    let mut scanner = Scanner::new(redis, settle_pool, publisher.clone(), settings.clone());
    let mut relay = Relay::new(pool, publisher, settings.clone());
    // One broker admin client for the role's readings (progress, drains, broker health):
    // its calls may overlap.
    let probe = Arc::new(
        crate::mq::LagProbe::new(&crate::mq::runtime()?, &settings.mq.name_server_list()).await?,
    );
    if sc.unconsumed_resend_ms > 0 {
        // What a dead broker holds goes out again through the live ones
        // (docs/architecture/messages.md#a-dead-brokers-messages).
        let names = settings.names();
        scanner = scanner.with_progress(Arc::new(unconsumed::BrokerProgress {
            probe: probe.clone(),
            group: names.order_create_group.clone(),
            topic: names.order_create_topic.clone(),
        }));
        relay = relay.with_release_progress(Arc::new(unconsumed::BrokerProgress {
            probe: probe.clone(),
            group: names.compensate_group.clone(),
            topic: names.compensate_topic.clone(),
        }));
    }
    let resync = resync_loop(&settings, redis_for_resync, probe.clone(), shutdown.clone()).await?;
    let resync_loop = watchdog.spawn("resync", resync);
    let health = broker_health_loop(&settings, probe, shutdown.clone());
    let health_loop = watchdog.spawn("broker_health", health);
    let poll = Duration::from_millis(sc.scanner_poll_ms);
    let failovers = role.watch_primary(&settle_watch, &settings.pg);
    let scanning = scan_loop(scanner, failovers, poll, shutdown.clone());
    let scan_loop = watchdog.spawn("resend", scanning);
    let relay_loop = watchdog.spawn("relay", relay_loop(relay, wake, shutdown.clone()));
    let (retention_loop, sizes_loop) = retention::start(&settings, watchdog, shutdown).await?;
    role.serving();
    info!(owner_metrics = %sc.metrics_listen, "scan started: reservation scanner and outbox relay");
    let died = tokio::select! {
        died = role.stop_requested() => died,
        _ = stop.cancelled() => None,
    };
    info!("stopping: finishing the current passes");
    role.ready.set(false);
    role.shutdown.cancel();
    let grace = Duration::from_secs(sc.shutdown_grace_secs);
    let _ = tokio::time::timeout(grace, async {
        let _ = scan_loop.await;
        let _ = relay_loop.await;
        let _ = retention_loop.await;
        let _ = sizes_loop.await;
        let _ = resync_loop.await;
        let _ = health_loop.await;
    })
    .await;
    let _ = listener.await;
    role.finish(died).await
}

/// How often the brokers' own health is read.
const BROKER_HEALTH_EVERY: Duration = Duration::from_secs(5);

/// Every [`BROKER_HEALTH_EVERY`], each master's disk, writes, flush and replicas as gauges
/// (docs/architecture/observability.md#broker-health).
fn broker_health_loop(
    settings: &Settings,
    probe: Arc<crate::mq::LagProbe>,
    stop: CancellationToken,
) -> impl std::future::Future<Output = ()> {
    let topic = settings.names().order_create_topic.clone();
    async move {
        while !stop.is_cancelled() {
            crate::mq::export_broker_stats(&probe, &topic).await;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(BROKER_HEALTH_EVERY) => {}
            }
        }
    }
}

/// The fenced activities' rebuilds (docs/architecture/redis.md#when-redis-forgets), on their own
/// connections.
async fn resync_loop(
    settings: &Arc<Settings>,
    redis: RedisStore,
    probe: Arc<crate::mq::LagProbe>,
    stop: CancellationToken,
) -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let resync = crate::services::resync::Resync {
        settings: settings.clone(),
        // The advisory lock's, the rebuild's and a fence's connections at once.
        pg: crate::pg::connect_pool(&settings.pg, pools::SCAN_REBUILD).await?,
        redis,
        probe: Some(probe),
        by: crate::services::resync::actor("scan"),
    };
    let every = Duration::from_millis(settings.scan.resync_poll_ms);
    Ok(crate::services::resync::run_loop(resync, every, stop))
}

/// Scanner passes back to back while they find work, every `poll` otherwise.
async fn scan_loop(
    scanner: Scanner,
    mut failovers: Failovers,
    poll: Duration,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        // Fault-injection point: a loop that dies (`scan-resend-loop=panic`).
        fail::fail_point!("scan-resend-loop");
        let busy = match scanner.scan_once().await {
            Ok(s) => s.claimed > 0,
            Err(e) => {
                warn!(error = %e, "scanner pass failed");
                false
            }
        };
        if !busy {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(poll) => {}
                Some(seen) = failovers.changed() => after_failover(&scanner, seen).await,
            }
        }
    }
}

/// The sweep after a failover the role saw (the `seen`th), logged with what it did.
async fn after_failover(scanner: &Scanner, seen: u64) {
    match scanner.after_failover().await {
        Ok(s) => info!(
            failovers_seen = seen,
            consumed = s.consumed,
            resent = s.resent,
            settled = s.settled,
            lost = s.lost,
            "PostgreSQL failover: every watched send checked against the new primary's inbox"
        ),
        Err(e) => warn!(
            failovers_seen = seen,
            error = %e,
            "PostgreSQL failover sweep failed; the regular passes go on"
        ),
    }
}

/// Relay passes back to back while they fill a batch; otherwise until a NOTIFY or the poll
/// interval. The outbox gauges are refreshed once a second. While idle, one row that went DEAD
/// for want of a broker is tried again every `relay_backoff_cap_ms`
/// (docs/architecture/recovery.md#outbox-relay).
async fn relay_loop(relay: Relay, wake: Arc<Notify>, stop: CancellationToken) {
    let mut last_observe = std::time::Instant::now() - Duration::from_secs(10);
    let probe_every = Duration::from_millis(relay.settings.scan.relay_backoff_cap_ms);
    let mut last_probe = std::time::Instant::now();
    while !stop.is_cancelled() {
        // Fault-injection point: a loop that dies (`scan-relay-loop=panic`).
        fail::fail_point!("scan-relay-loop");
        let claimed = match relay.relay_once().await {
            Ok(n) => n,
            Err(e) => {
                warn!(error = %e, "relay pass failed");
                0
            }
        };
        if last_observe.elapsed() >= Duration::from_secs(1) {
            let _ = relay.observe().await;
            match relay.requeue_unconsumed().await {
                Ok(0) => {}
                Ok(_) => wake.notify_one(),
                Err(e) => warn!(error = %e, "look for unconsumed releases failed"),
            }
            last_observe = std::time::Instant::now();
        }
        if claimed == 0 && last_probe.elapsed() >= probe_every {
            last_probe = std::time::Instant::now();
            if let Err(e) = relay.probe_dead().await {
                warn!(error = %e, "probe of a DEAD outbox row failed");
            }
        }
        if claimed < relay.settings.scan.relay_batch {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(relay.settings.scan.relay_poll_ms)) => {}
            }
        }
    }
}
