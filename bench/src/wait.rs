//! Waiting for work the pipeline does after the load: as long as it progresses.

use std::time::{Duration, Instant};

/// Waits while `left()` (work still to do, read every `every`) decreases; returns what is left
/// when it reaches 0 or stops decreasing for `stall`. A drain that keeps progressing is waited
/// for however long it takes.
pub async fn wait_progress<F, Fut>(
    stall: Duration,
    every: Duration,
    what: &str,
    left: F,
) -> anyhow::Result<i64>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<i64>>,
{
    let (mut best, mut progressed) = (i64::MAX, Instant::now());
    loop {
        let n = left().await?;
        if n == 0 {
            return Ok(0);
        }
        if n < best {
            (best, progressed) = (n, Instant::now());
        } else if progressed.elapsed() >= stall {
            eprintln!(
                "{what} stalled with {n} left, none done in the last {} s",
                stall.as_secs()
            );
            return Ok(n);
        }
        tokio::time::sleep(every).await;
    }
}
