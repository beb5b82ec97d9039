//! Graceful shutdown: every long-running role waits on [`shutdown_signal`], then stops taking
//! work, drains what is in flight within its grace period, and never acknowledges work that
//! is not committed (docs/architecture/roles.md#graceful-shutdown).
//!
//! A role's background loops run under a [`Watchdog`]: when one ends before shutdown was
//! asked for, or panics, the role turns not ready for good (`/readyz` 503), stops the way it
//! does on SIGTERM and exits non-zero, so a supervisor (systemd) restarts it. A loop that
//! died silently would otherwise leave a process that looks healthy and does nothing.

use std::future::Future;
use std::sync::{Arc, Mutex};

use futures::FutureExt as _;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::telemetry::Readiness;

/// Watches the background tasks of one role.
#[derive(Clone)]
pub struct Watchdog {
    /// Cancelled when the role is asked to stop: a task ending after it is no failure.
    stopping: CancellationToken,
    /// Cancelled when a watched task died.
    died: CancellationToken,
    /// The first death, for the log and the exit message.
    reason: Arc<Mutex<String>>,
    ready: Readiness,
}

impl Watchdog {
    pub fn new(stopping: CancellationToken, ready: Readiness) -> Self {
        Self {
            stopping,
            died: CancellationToken::new(),
            reason: Arc::default(),
            ready,
        }
    }

    /// Spawns `fut` as the background task `task`. The handle resolves when the task ended
    /// (normally or not); awaiting it is how a role drains the task at shutdown.
    pub fn spawn<F>(&self, task: &'static str, fut: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let w = self.clone();
        tokio::spawn(async move {
            // One task: the panic is caught where it happens, not through a second task.
            let outcome = std::panic::AssertUnwindSafe(fut).catch_unwind().await;
            let why = match outcome {
                Ok(()) if w.stopping.is_cancelled() => return,
                Ok(()) => "ended before shutdown".to_string(),
                Err(panic) => format!("panicked: {}", panic_text(panic)),
            };
            tracing::error!(task, reason = %why,
                "a background task of this role died; stopping it (readiness 503, non-zero exit)");
            metrics::counter!("role_task_failures_total", "task" => task).increment(1);
            w.ready.break_for_good();
            if let Ok(mut r) = w.reason.lock() {
                if r.is_empty() {
                    *r = format!("background task {task} {why}");
                }
            }
            w.died.cancel();
        })
    }

    /// Resolves, with the reason, once a watched task died.
    pub async fn died(&self) -> String {
        self.died.cancelled().await;
        self.reason.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// The reason, if a watched task died.
    pub fn death(&self) -> Option<String> {
        if !self.died.is_cancelled() {
            return None;
        }
        self.reason.lock().map(|r| r.clone()).ok()
    }

    /// Cancels `stop` when a watched task dies (for a role whose own loop waits on `stop`).
    pub fn stop_on_death(&self, stop: CancellationToken) {
        let w = self.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = w.died() => stop.cancel(),
                _ = stop.cancelled() => {}
            }
        });
    }

    /// Waits for SIGINT/SIGTERM (`None`) or a dead task (`Some(reason)`).
    pub async fn stop_requested(&self) -> Option<String> {
        tokio::select! {
            _ = shutdown_signal() => None,
            reason = self.died() => Some(reason),
        }
    }
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_panicking_task_makes_the_role_unready_for_good_and_says_why() {
        let ready = Readiness::default();
        let stopping = CancellationToken::new();
        let w = Watchdog::new(stopping.clone(), ready.clone());
        ready.set(true);
        let _quiet = w.spawn("quiet", async { std::future::pending::<()>().await });
        let _boom = w.spawn("relay", async { panic!("injected") });
        let reason = tokio::time::timeout(Duration::from_secs(5), w.died())
            .await
            .expect("the death is reported");
        assert!(reason.contains("relay panicked: injected"), "{reason}");
        assert!(!ready.get());
        ready.set(true);
        assert!(!ready.get(), "a later set(true) does not hide it");
    }

    #[tokio::test]
    async fn a_task_ending_after_shutdown_was_asked_is_no_failure() {
        let ready = Readiness::default();
        let stopping = CancellationToken::new();
        let w = Watchdog::new(stopping.clone(), ready.clone());
        ready.set(true);
        stopping.cancel();
        w.spawn("loop", async {}).await.unwrap();
        assert!(ready.get());
        let early = tokio::time::timeout(Duration::from_millis(100), w.died()).await;
        assert!(early.is_err(), "nothing died");
        // Before shutdown, a loop that simply returns is a failure too.
        let w = Watchdog::new(CancellationToken::new(), ready.clone());
        w.spawn("loop", async {}).await.unwrap();
        assert!(w.died().await.contains("loop ended before shutdown"));
        assert!(!ready.get());
    }
}
