//! Who gets the units of a contested start (docs/architecture/hot-path.md#a-fair-start): the same
//! mixed crowd (`seckill-bench crowd`: scripted buyers firing at the start instant and retrying at
//! full speed, people arriving over the first seconds) against three sales of one SKU: first come
//! first served, a fair window, and a fair window selling to sale-pass holders whose registration
//! asked a proof of work.

use super::procs::wait_ready;
use super::{Run, API, API_READY, CONSUME_READY, SCAN_READY};

/// The fair window of the two drawn sales, and the spread of the people's arrivals.
const WINDOW_MS: i64 = 2_000;
const SPREAD_MS: i64 = 4_000;
/// The registration's proof of work: counters per pass (each of `passes.pow_cost` rounds).
const POW_DIFFICULTY: i64 = 50_000;
/// The scripted crowd's solving budget for its accounts' passes, in ms of one core.
const BOT_POW_BUDGET_MS: i64 = 2_000;

fn s(v: impl ToString) -> String {
    v.to_string()
}

/// The three crowds, kept as `CROWD_FCFS`, `CROWD_DRAW`, `CROWD_PASSES`.
pub(super) async fn fairness(run: &mut Run) -> anyhow::Result<()> {
    let (bots, people, stock) = if run.sizes.sale_stock < 10_000 {
        (300, 300, 60)
    } else {
        (1_000, 1_000, 200)
    };
    // Registration happens here in seconds where it would take days: the difficulty stays the
    // activity's, not grown by that compressed load.
    run.procs
        .set_env(&[("SECKILL__PASSES__POW_LOAD_STEP_PER_SEC", "0")]);
    run.procs.start("consume", &["consume"], None)?;
    run.procs.start("scan", &["scan"], None)?;
    run.procs.start("api", &["api"], None)?;
    run.procs.set_env(&[]);
    for ready in [CONSUME_READY, SCAN_READY, API_READY] {
        wait_ready(ready).await?;
    }
    for (name, label, window, passes) in [
        ("CROWD_FCFS", "fcfs", 0, false),
        ("CROWD_DRAW", "draw", WINDOW_MS, false),
        ("CROWD_PASSES", "passes", WINDOW_MS, true),
    ] {
        eprintln!(
            "[bench] crowd: {bots} scripted accounts, {people} people, {stock} units, {label}"
        );
        // Time to sign the tokens and, with passes, to register everyone: each person solves
        // their own challenge, two at a time (a pass cost 46 ms in a quiet hour here, 23 ms a
        // person; 90 ms a person leaves room for the machine's slowest hours).
        let lead = if passes { 30_000 + 90 * people } else { 15_000 };
        let starts = chrono::Utc::now() + chrono::Duration::milliseconds(lead);
        let mut extra = vec![s("--starts-at"), starts.to_rfc3339()];
        extra.extend([s("--fair-window-ms"), s(window)]);
        if passes {
            extra.extend([s("--passes"), s(bots + people)]);
            extra.extend([s("--pass-pow-difficulty"), s(POW_DIFFICULTY)]);
        }
        let a = run.procs.activity_with(stock, 1, &extra).await?;
        let mut args = vec![s("crowd"), s("--api"), s(API), s("--activity-id"), s(a)];
        args.extend([s("--starts-at-ms"), s(starts.timestamp_millis())]);
        args.extend([
            s("--window-ms"),
            s(WINDOW_MS),
            s("--spread-ms"),
            s(SPREAD_MS),
        ]);
        args.extend([s("--bots"), s(bots), s("--people"), s(people)]);
        args.extend([s("--stock"), s(stock), s("--summary-prefix"), s(name)]);
        if passes {
            args.extend([
                s("--passes"),
                s("--bot-pow-budget-ms"),
                s(BOT_POW_BUDGET_MS),
            ]);
        }
        args.extend(run.procs.cpu_args().await);
        let line = run
            .procs
            .bench_line(&format!("crowd-{label}"), &args)
            .await?;
        run.keep(name, line);
    }
    run.procs.stop_all().await;
    Ok(())
}
