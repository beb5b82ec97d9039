//! `seckill activity resync`: an activity's Redis state rebuilt from PostgreSQL on an
//! operator's word (docs/architecture/redis.md#when-redis-forgets). `--dry-run` reports what would
//! change and writes nothing; otherwise the activity is fenced (or its open fence joined),
//! every message sent before the fence is awaited into PostgreSQL, the state is rebuilt and the
//! fence lifted through the ramp. Every run is audited.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use serde_json::json;

use crate::config::Settings;
use crate::pg::audit;
use crate::pg::fences;
use crate::redis::RedisStore;
use crate::services::resync::{self, Resync};

#[derive(Debug, Clone, Args)]
pub struct ResyncArgs {
    #[arg(long)]
    pub activity_id: i64,
    /// Report what the rebuild would change; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Why (kept in the audit trail and the fence's record).
    #[arg(long, default_value = "operator resync")]
    pub reason: String,
    /// How long to wait for the order backlog sent before the fence to drain; past it the
    /// command fails and leaves the fence to the scanner, which finishes the rebuild.
    #[arg(long, default_value_t = 120)]
    pub wait_secs: u64,
    /// Do not wait for the backlog (the broker cannot be asked): units of messages still in
    /// flight are then counted only when they are consumed.
    #[arg(long)]
    pub no_drain_check: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs the command; `false` when the rebuild could not be done (reported).
pub async fn run(settings: Settings, args: ResyncArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.activity_id > 0, "--activity-id must be positive");
    let settings = Arc::new(settings);
    let pg = crate::pg::connect_pool(&settings.pg, 4).await?;
    let redis = RedisStore::connect(&settings.redis).await?;
    let probe = if args.no_drain_check || args.dry_run {
        None
    } else {
        let p = crate::mq::LagProbe::new(
            &crate::mq::runtime()?,
            &settings.mq.name_server_list(),
        )
        .await
        .context("the broker's consumer progress is needed to know the backlog drained (--no-drain-check to skip)")?;
        Some(Arc::new(p))
    };
    let by = audit::cli_actor();
    let r = Resync {
        settings: settings.clone(),
        pg: pg.clone(),
        redis: redis.clone(),
        probe,
        by: by.clone(),
    };
    let id = args.activity_id;
    if args.dry_run {
        let rebuilt = r.rebuild(id, false).await?;
        let client = pg.get().await?;
        audit::record(
            &**client,
            &by,
            "activity_resync_dry_run",
            &format!("activity:{id}"),
            &json!({"reason": args.reason, "diff": rebuilt.diff}),
        )
        .await?;
        print_report(&args, &rebuilt, None);
        return Ok(true);
    }
    fence_and_rebuild(&args, &r).await
}

/// Fences the activity (audited), waits for its backlog, rebuilds and resumes it; `false` when
/// that did not finish within `--wait-secs` (the fence stays for the scanner).
async fn fence_and_rebuild(args: &ResyncArgs, r: &Resync) -> anyhow::Result<bool> {
    let (pg, redis, by, id) = (&r.pg, &r.redis, &r.by, args.activity_id);
    let fence = resync::raise(pg, redis, id, "operator", &args.reason, by)
        .await?
        .with_context(|| format!("activity {id} is not in PostgreSQL, or ended long ago"))?;
    // The action is audited when taken: a scanner may finish the rebuild it started.
    let client = pg.get().await?;
    audit::record(
        &**client,
        by,
        "activity_resync",
        &format!("activity:{id}"),
        &json!({"reason": args.reason, "fence_id": fence.fence_id}),
    )
    .await?;
    drop(client);
    eprintln!(
        "activity {id} fenced (fence {}): waiting for the order backlog sent before it",
        fence.fence_id
    );
    let fence = match await_drained(r, pg, id, args.wait_secs).await? {
        Wait::Drained(fence) => fence,
        Wait::Finished => {
            eprintln!("the scanner finished the rebuild meanwhile");
            return Ok(true);
        }
        Wait::TimedOut => {
            eprintln!(
                "the backlog did not drain within {} s: the fence stays, the scanner rebuilds once it has",
                args.wait_secs
            );
            return Ok(false);
        }
    };
    let Some(rebuilt) = r.rebuild_and_resume(&fence).await? else {
        // A scanner holds the rebuild: done when it has lifted the fence.
        eprintln!("a scanner is rebuilding the activity: waiting for it to lift the fence");
        let deadline = Instant::now() + Duration::from_secs(args.wait_secs);
        while Instant::now() < deadline {
            let client = pg.get().await?;
            if fences::open_of(&**client, id).await?.is_none() {
                eprintln!("the scanner rebuilt the activity and lifted the fence");
                return Ok(true);
            }
            drop(client);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!("the fence is still up after {} s", args.wait_secs);
        return Ok(false);
    };
    print_report(args, &rebuilt, Some(fence.fence_id));
    Ok(true)
}

/// How the wait for the backlog ended.
enum Wait {
    Drained(fences::Fence),
    /// The fence was closed by someone else (a scanner) meanwhile.
    Finished,
    TimedOut,
}

/// Waits (polling every 500 ms, at most `wait_secs`) until the activity's open fence has drained.
async fn await_drained(
    r: &Resync,
    pg: &deadpool_postgres::Pool,
    activity_id: i64,
    wait_secs: u64,
) -> anyhow::Result<Wait> {
    let deadline = Instant::now() + Duration::from_secs(wait_secs);
    loop {
        let client = pg.get().await?;
        let Some(open) = fences::open_of(&**client, activity_id).await? else {
            return Ok(Wait::Finished);
        };
        drop(client);
        if r.drained(&open).await? {
            return Ok(Wait::Drained(open));
        }
        if Instant::now() >= deadline {
            return Ok(Wait::TimedOut);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn print_report(args: &ResyncArgs, r: &resync::Rebuilt, fence_id: Option<i64>) {
    if args.json {
        println!("{}", json!({"fence_id": fence_id, "rebuilt": r}));
        return;
    }
    let verb = if r.written {
        "rebuilt"
    } else {
        "would rebuild"
    };
    println!("activity {} {verb} from PostgreSQL:", r.activity_id);
    for s in &r.diff.skus {
        let before = s
            .remaining_before
            .map_or("gone".to_string(), |v| v.to_string());
        println!(
            "  bucket {} sku {}: remaining {before} -> {}, buyers {} -> {} (restored {}, removed {}), in flight {}",
            s.bucket, s.sku_id, s.remaining_after, s.buyers_before, s.buyers_after,
            s.buyers_restored, s.buyers_removed, s.in_flight
        );
    }
    let d = &r.diff;
    println!(
        "  request ids {} -> {} (restored {}), reservations written {}, shards without meta {}",
        d.requests_before,
        d.requests_after,
        d.requests_restored,
        d.reservations_written,
        d.meta_restored
    );
    for w in &d.warnings {
        println!("  warning: {w}");
    }
    println!(
        "  {}; {:.3}s, {} pass(es)",
        if d.changes_anything() {
            "changes"
        } else {
            "no change"
        },
        r.rebuild_secs,
        r.attempts
    );
}
