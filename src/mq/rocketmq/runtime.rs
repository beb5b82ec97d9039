//! The process's one RocketMQ client runtime and the blocking-lane slots its listeners use.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use rocketmq_client_rust::{ClientRuntime, ClientRuntimeConfig, TelemetryHandle};
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};

use super::*;

// Runtime

/// Sizing of the process-wide client runtime.
#[derive(Debug, Clone)]
pub struct MqRuntimeConfig {
    /// Listener calls that may be in flight at once across *all* push consumers of the
    /// process (each consumer reserves its `consume_threads` from this budget).
    pub listener_slots: usize,
    /// Async worker threads of the client's Tokio runtime.
    pub worker_threads: usize,
}

impl Default for MqRuntimeConfig {
    fn default() -> Self {
        Self {
            listener_slots: 40,
            worker_threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// The RocketMQ client runtime of the process. Cheap to clone; producers and consumers keep a
/// clone, so the runtime lives as long as anything built on it.
#[derive(Clone)]
pub struct MqRuntime {
    inner: Arc<RuntimeInner>,
}

struct RuntimeInner {
    // `None` once `shutdown` has run; dropping the owner shuts its Tokio runtime down in the
    // background, which is safe from inside an async context.
    owner: Mutex<Option<RuntimeOwner>>,
    client: Arc<ClientRuntime>,
    listener_slots: usize,
    reserved_slots: AtomicUsize,
}

impl MqRuntime {
    /// Builds the client runtime. Call from inside a Tokio runtime or not; the client brings
    /// its own.
    pub fn new(config: MqRuntimeConfig) -> anyhow::Result<Self> {
        if config.listener_slots == 0 || config.worker_threads == 0 {
            bail!("MqRuntimeConfig: listener_slots and worker_threads must be positive");
        }
        let lane = config.listener_slots + LANE_HEADROOM;
        let parallelism = config.worker_threads;
        let base = RuntimeConfig::for_parallelism("seckill-mq", parallelism);
        // The global blocking limit must cover the enlarged metadata lane plus the other lanes.
        let global = (lane
            + base.blocking_lane_policies.storage_io.max_concurrency
            + base.blocking_lane_policies.cpu_crypto.max_concurrency)
            .max(48);
        let mut rt = base
            .with_max_blocking_threads(global)
            .map_err(|e| anyhow!("rocketmq runtime config: {e}"))?;
        let md = &mut rt.blocking_lane_policies.metadata_io;
        md.max_concurrency = lane;
        md.max_queue_depth = (2 * lane).max(64);
        // A listener call waits for the batch handler (database work): the lane must not
        // give up on it early, or the client sends the batch to the retry topic while the
        // handler may still commit. 15 min matches the consumer's own consume_timeout.
        md.queue_timeout = Duration::from_secs(60);
        md.task_timeout = Duration::from_secs(15 * 60);
        rt.validate()
            .map_err(|e| anyhow!("rocketmq runtime config: {e}"))?;
        let owner = RuntimeOwner::plan(rt)
            .map_err(|e| anyhow!("rocketmq runtime plan: {e}"))?
            .build()
            .context("building the rocketmq client runtime")?;
        let client = ClientRuntime::try_new(
            owner.root_context().component("seckill-mq"),
            ClientRuntimeConfig::default(),
            TelemetryHandle::noop(),
        )
        .map_err(|e| anyhow!("rocketmq ClientRuntime: {e}"))?;
        Ok(Self {
            inner: Arc::new(RuntimeInner {
                owner: Mutex::new(Some(owner)),
                client,
                listener_slots: config.listener_slots,
                reserved_slots: AtomicUsize::new(0),
            }),
        })
    }

    /// The handle the client builders take.
    pub fn client_runtime(&self) -> Arc<ClientRuntime> {
        Arc::clone(&self.inner.client)
    }

    pub(super) fn reserve_slots(&self, n: usize) -> anyhow::Result<SlotReservation> {
        let reserved = &self.inner.reserved_slots;
        let mut current = reserved.load(Ordering::Acquire);
        loop {
            let next = current + n;
            if next > self.inner.listener_slots {
                bail!(
                    "consumer needs {n} listener slots but only {} of {} are free; raise \
                     MqRuntimeConfig.listener_slots or lower consume_threads",
                    self.inner.listener_slots - current,
                    self.inner.listener_slots
                );
            }
            match reserved.compare_exchange(current, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    return Ok(SlotReservation {
                        runtime: self.clone(),
                        n,
                    })
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// Stops the client runtime: pooled connections, then tracked tasks. Shut producers and
    /// consumers down first.
    pub async fn shutdown(&self) {
        let report = self.inner.client.shutdown().await;
        if !report.is_healthy() {
            tracing::debug!(report = %report.to_json(), "rocketmq client runtime shutdown report");
        }
        let owner = match self.inner.owner.lock() {
            Ok(mut guard) => guard.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(owner) = owner {
            let _ = owner.shutdown_tasks().await;
            let _ = owner.shutdown_background();
        }
    }
}

/// Listener slots held by one push consumer; returned on drop.
pub(super) struct SlotReservation {
    runtime: MqRuntime,
    n: usize,
}

impl Drop for SlotReservation {
    fn drop(&mut self) {
        self.runtime
            .inner
            .reserved_slots
            .fetch_sub(self.n, Ordering::AcqRel);
    }
}
