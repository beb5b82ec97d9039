//! The front door's ceilings, measured by Debian's `wrk` (a C load generator that is not the
//! bottleneck; the project's own generator stays for the sale, where its per-request history
//! judges correctness): `GET /healthz` of the same server, sold-out answers per token
//! algorithm with the verified-token cache on and off, the accepted path with the consumer
//! stopped, and the direct-PostgreSQL server's sold-out answers. Each line carries the
//! generator's CPU beside the server's, so a reader sees which side was saturated.
//!
//! One `wrk` thread and 64 connections, the buyers' tokens rotating over a file (one buyer
//! each), a new `request_id` per request (bench/src/run/wrk.lua).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use jsonwebtoken::Algorithm;
use tokio::process::Command;

use super::procs::wait_ready;
use super::{Run, API, API_READY};
use crate::cpu::{cpu_snapshot, cpu_use, parse_cpu_target, CpuTarget};
use crate::ratios::Line;
use crate::tokens::{Minter, Provisioned, SigningArgs};

const SCRIPT: &str = include_str!("wrk.lua");

/// The algorithms the sold-out ceilings are measured with (the development HS256 reference,
/// then the run's keys), with their lines' names, cache on and off.
const SOLD_OUT_ALGS: [(Option<Algorithm>, &str, &str); 5] = [
    (None, "C_SOLDOUT_HS256", "C_SOLDOUT_HS256_NOCACHE"),
    (
        Some(Algorithm::RS256),
        "C_SOLDOUT_RS256",
        "C_SOLDOUT_RS256_NOCACHE",
    ),
    (
        Some(Algorithm::PS256),
        "C_SOLDOUT_PS256",
        "C_SOLDOUT_PS256_NOCACHE",
    ),
    (
        Some(Algorithm::ES256),
        "C_SOLDOUT_ES256",
        "C_SOLDOUT_ES256_NOCACHE",
    ),
    (
        Some(Algorithm::EdDSA),
        "C_SOLDOUT_EDDSA",
        "C_SOLDOUT_EDDSA_NOCACHE",
    ),
];

/// Buyers whose tokens rotate in the sold-out runs.
const ROTATING_BUYERS: usize = 1000;

/// One wrk run's request.
struct Shot<'a> {
    /// Base URL of the server.
    base: &'a str,
    /// `GET` for a bare path, else a reservation `POST` to this path.
    method: &'a str,
    path: String,
    /// One token per line (`None`: no Authorization header).
    tokens: Option<&'a Path>,
    /// The server's pid, for its CPU.
    server_pid: Option<u32>,
}

/// A token file for `buyers` buyers (ids from `first`), signed with `key` (`None`: HS256).
fn token_file(
    run: &Run,
    key: Option<&Provisioned>,
    first: i64,
    buyers: usize,
) -> anyhow::Result<PathBuf> {
    let signing = match key {
        Some(k) => SigningArgs {
            signing_key: k.key_file.display().to_string(),
            signing_kid: k.kid.clone(),
            signing_alg: format!("{:?}", k.alg),
        },
        None => SigningArgs {
            signing_key: String::new(),
            signing_kid: String::new(),
            signing_alg: String::new(),
        },
    };
    let minter = Minter::new(&run.settings, &signing)?;
    let users: Vec<i64> = (first..first + buyers as i64).collect();
    let tokens = minter.bearer_for(&users)?;
    let text: Vec<&str> = users
        .iter()
        .map(|u| tokens[u].trim_start_matches("Bearer "))
        .collect();
    let file = run
        .procs
        .dir
        .join(format!("tokens-{}-{buyers}.txt", minter.label()));
    std::fs::write(&file, text.join("\n") + "\n")?;
    Ok(file)
}

/// Runs wrk once; its line: `WRK OK name=… per_s=… p50_ms=… p99_ms=… s202=… s410=…
/// cpu_wrk_pct=… cpu_server_pct=…`.
async fn wrk(run: &Run, name: &str, shot: &Shot<'_>) -> anyhow::Result<Line> {
    let script = run.procs.dir.join("wrk.lua");
    std::fs::write(&script, SCRIPT)?;
    let secs = if run.sizes.api_requests < 10_000 {
        3
    } else {
        8
    };
    let targets: Vec<CpuTarget> = shot
        .server_pid
        .map(|pid| parse_cpu_target(&format!("server={pid}")))
        .transpose()
        .map_err(|e| anyhow::anyhow!(e))?
        .into_iter()
        .collect();
    let before = cpu_snapshot(&targets);
    let started = Instant::now();
    // `times` after wrk prints its children's CPU: the generator's own, measured by the kernel.
    let output = Command::new("bash")
        .arg("-c")
        .arg(r#"wrk "$@" && times"#)
        .arg("wrk")
        .args(["-t1", "-c64", &format!("-d{secs}s"), "--latency", "-s"])
        .arg(&script)
        .arg(shot.base)
        .env("WRK_METHOD", shot.method)
        .env("WRK_PATH", &shot.path)
        .env(
            "WRK_TOKENS",
            shot.tokens
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        )
        .env("WRK_TAG", format!("{name}-{}", ulid::Ulid::new()))
        .output()
        .await
        .context("running wrk (apt-get install wrk)")?;
    let elapsed = started.elapsed();
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    std::fs::write(run.procs.dir.join(format!("wrk-{name}.out")), &text)?;
    let server = cpu_use(&targets, &before, elapsed)
        .first()
        .map_or(0.0, |c| c.core_pct);
    let generator = children_cpu_secs(&text).map(|s| 100.0 * s / elapsed.as_secs_f64());
    let Some(wrk_line) = text.lines().rfind(|l| l.starts_with("WRK ")) else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        anyhow::bail!("wrk {name}: no WRK line ({stderr})");
    };
    let line = Line::parse(&format!(
        "{} name={name} cpu_wrk_pct={:.0} cpu_server_pct={server:.0}",
        wrk_line.replacen("WRK ", "WRK OK ", 1),
        generator.unwrap_or(f64::NAN)
    ));
    eprintln!("[bench] {}", line.text);
    Ok(line)
}

/// The children's user + system seconds from bash's `times` (its second line).
fn children_cpu_secs(text: &str) -> Option<f64> {
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains("m") && l.ends_with('s'))?;
    let secs = |w: &str| -> Option<f64> {
        let (m, s) = w.trim_end_matches('s').split_once('m')?;
        Some(m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?)
    };
    let mut words = line.split_whitespace();
    Some(secs(words.next()?)? + secs(words.next()?)?)
}

fn reservations(a: i64) -> String {
    format!("/v1/activities/{a}/skus/1/reservations")
}

/// The API's ceilings, the consumer stopped: `C_HEALTHZ`, `C_SOLDOUT_<ALG>` and
/// `C_SOLDOUT_<ALG>_NOCACHE` (the token cache off), then `C_ACCEPT`; the consumer is started
/// again at the end and turns the accepted path's backlog into orders before the next scenario.
pub async fn api_ceilings(run: &mut Run, keys: &[Provisioned]) -> anyhow::Result<()> {
    eprintln!("[bench] the front door's ceilings (wrk)");
    run.procs.stop("consume").await;
    let mut files: HashMap<&str, PathBuf> = HashMap::new();
    for (alg, name, _) in SOLD_OUT_ALGS {
        let key = alg.and_then(|a| keys.iter().find(|k| k.alg == a));
        files.insert(name, token_file(run, key, 1, ROTATING_BUYERS)?);
    }
    let sold_out = run.procs.activity(0, 1).await?;
    for cache in [true, false] {
        let pid = start_api(run, cache).await?;
        if cache {
            let healthz = Shot {
                base: API,
                method: "GET",
                path: "/healthz".into(),
                tokens: None,
                server_pid: pid,
            };
            let line = wrk(run, "healthz", &healthz).await?;
            run.keep("C_HEALTHZ", line);
        }
        for (_, name, nocache) in SOLD_OUT_ALGS {
            let shot = Shot {
                base: API,
                method: "POST",
                path: reservations(sold_out),
                tokens: Some(&files[name]),
                server_pid: pid,
            };
            let line_name = if cache { name } else { nocache };
            let line = wrk(run, &line_name.to_lowercase(), &shot).await?;
            run.keep(line_name, line);
        }
        run.procs.stop("api").await;
    }
    let pid = start_api(run, true).await?;
    let (line, a) = accepted(run, keys, pid).await?;
    let taken = line.num("s202").unwrap_or(0.0) as i64;
    run.keep("C_ACCEPT", line);
    run.procs.stop("api").await;
    run.procs.set_env(&[]);
    run.procs.restart_consume().await?;
    run.wait_recorded(&[a], taken).await;
    Ok(())
}

/// The API with the token cache on or off (fail-closed admission at its widest: the consumer
/// is stopped); its pid.
async fn start_api(run: &mut Run, cache: bool) -> anyhow::Result<Option<u32>> {
    let entries = if cache { "100000" } else { "0" };
    run.procs.set_env(&[
        ("SECKILL__API__FAIL_CLOSED_SHARE", "1.0"),
        ("SECKILL__AUTH__TOKEN_CACHE_ENTRIES", entries),
    ]);
    run.procs.start("api", &["api"], None)?;
    wait_ready(API_READY).await?;
    Ok(run.procs.pid("api"))
}

/// The accepted path: every buyer new, stock for all of them, the consumer stopped.
/// Its line and the activity.
async fn accepted(
    run: &mut Run,
    keys: &[Provisioned],
    pid: Option<u32>,
) -> anyhow::Result<(Line, i64)> {
    let buyers = if run.sizes.api_requests < 10_000 {
        30_000
    } else {
        100_000
    };
    let a = run.procs.activity(buyers as i64, 1).await?;
    let file = token_file(run, keys.first(), 1, buyers)?;
    let shot = Shot {
        base: API,
        method: "POST",
        path: reservations(a),
        tokens: Some(&file),
        server_pid: pid,
    };
    Ok((wrk(run, "accept", &shot).await?, a))
}

/// The direct-PostgreSQL server's sold-out answers with the same RS256 tokens (`C_BASE_SOLDOUT`).
pub async fn baseline_ceiling(
    run: &mut Run,
    keys: &[Provisioned],
    base: &str,
    sold_out_activity: i64,
) -> anyhow::Result<()> {
    let file = token_file(run, keys.first(), 1, ROTATING_BUYERS)?;
    let shot = Shot {
        base,
        method: "POST",
        path: reservations(sold_out_activity),
        tokens: Some(&file),
        server_pid: run.procs.pid("baseline"),
    };
    let line = wrk(run, "baseline-soldout", &shot).await?;
    run.keep("C_BASE_SOLDOUT", line);
    Ok(())
}

/// `make bench-ceilings`: the API's ceilings, then the direct-PostgreSQL server's.
pub async fn only_ceilings(run: &mut Run, keys: &[Provisioned]) -> anyhow::Result<()> {
    // A backlog left by an earlier run would close admission (its lag past the validity):
    // the consumer takes it first, until the reservations recorded stop growing (3 minutes at
    // most).
    run.procs.restart_consume().await?;
    let sql = "SELECT count(*) FROM {s}.reservations";
    let mut last = -1;
    let mut still = 0;
    let started = Instant::now();
    while still < 5 && started.elapsed() < Duration::from_secs(180) {
        let now = run.count(sql).await;
        still = if now == last { still + 1 } else { 0 };
        last = now;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    api_ceilings(run, keys).await?;
    run.procs
        .start_baseline(&["--pool", "16", "--stock", "1:1:0"].map(String::from))?;
    wait_ready(super::BASELINE_READY).await?;
    baseline_ceiling(run, keys, super::BASELINE, 1).await?;
    run.procs.stop_all().await;
    Ok(())
}
