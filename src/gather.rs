//! Gathering: concurrent callers' work joined into shared round trips, each caller answered
//! with its own outcomes. Used by the hot path's broker sends (`mq::batching`) and by the
//! order consumer, whose listener calls share PostgreSQL transactions
//! (docs/ARCHITECTURE.md#gathering-batches-across-queues).
//!
//! - **Natural batching.** A batch starts as soon as a slot is free (at most `limit(head)`
//!   batches in flight, where `head` is the first waiting caller's items; `limit` is read
//!   before each batch, whenever a slot frees up and every `recheck` while all are busy, so it
//!   can follow an adaptive limit or the age of the work waiting). While every slot is busy,
//!   callers queue and the next batch takes them together. A lone caller at a quiet moment
//!   waits for nothing but `wait`.
//! - **Waiting for company** (`wait` > 0): a batch that is not full waits up to `wait` after its
//!   first caller arrived for more callers. It trades that much latency for fewer, fuller
//!   round trips, and never delays a full batch.
//! - A submission (one caller's items) is never split across batches, and a batch holds at most
//!   `max` items (a single larger submission goes alone).
//! - If the task that runs a batch panics, its callers are told their work was lost (`None`)
//!   and the slot comes back.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;

/// How a [`Gather`] forms its batches.
#[derive(Debug, Clone, Copy)]
pub struct GatherSettings {
    /// Items per batch at most.
    pub max: usize,
    /// How long a batch that is not full waits for more callers (zero: natural batching).
    pub wait: Duration,
    /// Submissions that may queue before `submit` itself waits (back-pressure).
    pub queue: usize,
    /// While every slot is busy, how often `limit` is read again (zero: only when a slot frees
    /// up). For a limit that grows with time, such as the age of the waiting work.
    pub recheck: Duration,
}

/// A gathering task and the way to hand it work.
pub struct Gather<I, O> {
    tx: mpsc::Sender<Submission<I, O>>,
}

struct Submission<I, O> {
    items: Vec<I>,
    arrived: Instant,
    reply: oneshot::Sender<Vec<O>>,
}

impl<I: Send + 'static, O: Send + 'static> Gather<I, O> {
    /// Starts the gathering task on the current Tokio runtime. `limit` gives the batches that
    /// may be in flight, from the items of the first caller waiting. `process` runs one batch
    /// and returns one outcome per item, in order. The task ends once the `Gather` is dropped and
    /// every submission was answered.
    pub fn start<F, Fut>(
        settings: GatherSettings,
        limit: impl Fn(&[I]) -> usize + Send + 'static,
        process: F,
    ) -> Self
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<O>> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(settings.queue.max(1));
        tokio::spawn(gather_loop(rx, settings, limit, Arc::new(process)));
        Self { tx }
    }

    /// The outcome of each of `items` once the batch that carried them has run; `None` if it
    /// never ran to the end (the task panicked or is gone): nothing is known of them.
    pub async fn submit(&self, items: Vec<I>) -> Option<Vec<O>> {
        let (reply, answer) = oneshot::channel();
        let sub = Submission {
            items,
            arrived: Instant::now(),
            reply,
        };
        self.tx.send(sub).await.ok()?;
        answer.await.ok()
    }
}

/// Batches in flight, and the wake-up of the gathering loop when one ends.
type Running = Arc<(AtomicUsize, Notify)>;

/// One batch in flight; dropping it (however the batch ended) frees the slot.
struct SlotGuard(Running);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
        self.0 .1.notify_waiters();
    }
}

async fn gather_loop<I, O, F, Fut>(
    mut rx: mpsc::Receiver<Submission<I, O>>,
    settings: GatherSettings,
    limit: impl Fn(&[I]) -> usize,
    process: Arc<F>,
) where
    I: Send + 'static,
    O: Send + 'static,
    F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<O>> + Send + 'static,
{
    let running: Running = Arc::new((AtomicUsize::new(0), Notify::new()));
    let max = settings.max.max(1);
    let mut carry: Option<Submission<I, O>> = None;
    loop {
        let first = match carry.take() {
            Some(s) => s,
            None => match rx.recv().await {
                Some(s) => s,
                None => break,
            },
        };
        // Wait for a free slot; meanwhile callers queue and join this batch.
        loop {
            let freed = running.1.notified();
            if running.0.load(Ordering::Acquire) < limit(&first.items).max(1) {
                break;
            }
            if settings.recheck.is_zero() {
                freed.await;
            } else {
                let _ = tokio::time::timeout(settings.recheck, freed).await;
            }
        }
        let deadline = first.arrived + settings.wait;
        let mut count = first.items.len();
        let mut group = vec![first];
        while count < max {
            let next = match rx.try_recv() {
                Ok(s) => Some(s),
                Err(TryRecvError::Disconnected) => None,
                Err(TryRecvError::Empty) if settings.wait.is_zero() => None,
                Err(TryRecvError::Empty) => tokio::time::timeout_at(deadline, rx.recv())
                    .await
                    .ok()
                    .flatten(),
            };
            let Some(s) = next else { break };
            if count + s.items.len() > max {
                carry = Some(s);
                break;
            }
            count += s.items.len();
            group.push(s);
        }
        running.0.fetch_add(1, Ordering::AcqRel);
        let slot = SlotGuard(Arc::clone(&running));
        let process = Arc::clone(&process);
        tokio::spawn(async move {
            let _slot = slot;
            let mut sizes = Vec::with_capacity(group.len());
            let mut replies = Vec::with_capacity(group.len());
            let mut items = Vec::with_capacity(count);
            for s in group {
                sizes.push(s.items.len());
                replies.push(s.reply);
                items.extend(s.items);
            }
            let outcomes = process(items).await;
            if outcomes.len() != count {
                // Which outcome belongs to whom is unknown: every caller learns nothing.
                return;
            }
            let mut outcomes = outcomes.into_iter();
            for (size, reply) in sizes.into_iter().zip(replies) {
                let _ = reply.send(outcomes.by_ref().take(size).collect());
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A gather whose batches record their size and answer each item with itself × 10.
    fn recording(
        max: usize,
        wait_ms: u64,
        limit: usize,
    ) -> (Gather<u32, u32>, Arc<Mutex<Vec<usize>>>) {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&sizes);
        let gather = Gather::start(
            GatherSettings {
                max,
                wait: Duration::from_millis(wait_ms),
                queue: 1024,
                recheck: Duration::ZERO,
            },
            move |_: &[u32]| limit,
            move |items: Vec<u32>| {
                seen.lock().unwrap().push(items.len());
                async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    items.iter().map(|i| i * 10).collect()
                }
            },
        );
        (gather, sizes)
    }

    /// Natural batching, one batch in flight, up to 32 items.
    fn one_batch_at_a_time<F, Fut>(process: F) -> Gather<u32, u32>
    where
        F: Fn(Vec<u32>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<u32>> + Send + 'static,
    {
        let settings = GatherSettings {
            max: 32,
            wait: Duration::ZERO,
            queue: 16,
            recheck: Duration::ZERO,
        };
        Gather::start(settings, |_: &[u32]| 1, process)
    }

    #[tokio::test]
    async fn callers_queued_behind_a_busy_slot_share_batches_and_get_their_own_outcomes() {
        let (gather, sizes) = recording(32, 0, 1);
        let calls = (0..64u32).map(|i| gather.submit(vec![i]));
        let answers = futures::future::join_all(calls).await;
        for (i, answer) in answers.into_iter().enumerate() {
            assert_eq!(answer, Some(vec![i as u32 * 10]));
        }
        let sizes = sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 64);
        assert!(sizes.iter().all(|&n| n <= 32), "{sizes:?}");
        assert!(sizes.len() <= 3, "64 one-item calls took {sizes:?}");
    }

    #[tokio::test]
    async fn a_submission_is_never_split_and_a_batch_never_exceeds_max() {
        let (gather, sizes) = recording(10, 0, 1);
        let calls = [
            vec![1, 2, 3, 4, 5, 6],
            vec![7, 8, 9, 10, 11],
            vec![12, 13, 14],
        ];
        let answers =
            futures::future::join_all(calls.iter().map(|c| gather.submit(c.clone()))).await;
        for (call, answer) in calls.iter().zip(answers) {
            assert_eq!(
                answer,
                Some(call.iter().map(|i| i * 10).collect::<Vec<_>>())
            );
        }
        // 6 alone (6 + 5 > 10), then 5 + 3.
        assert_eq!(*sizes.lock().unwrap(), vec![6, 8]);
    }

    #[tokio::test(start_paused = true)]
    async fn with_a_wait_a_lone_caller_waits_for_company_and_without_one_it_does_not() {
        let (gather, sizes) = recording(32, 200, 4);
        let late = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            gather.submit(vec![2]).await
        };
        let (a, b) = tokio::join!(gather.submit(vec![1]), late);
        assert_eq!((a, b), (Some(vec![10]), Some(vec![20])));
        assert_eq!(*sizes.lock().unwrap(), vec![2]);

        let (gather, sizes) = recording(32, 0, 4);
        let late = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            gather.submit(vec![2]).await
        };
        let started = Instant::now();
        let _ = tokio::join!(gather.submit(vec![1]), late);
        assert_eq!(*sizes.lock().unwrap(), vec![1, 1]);
        assert!(started.elapsed() < Duration::from_millis(200));
    }

    /// Two one-item calls, each batch taking 1 s, under a limit of 1 that becomes 2 once
    /// 100 ms have passed; how long both took.
    async fn under_a_limit_that_grows(recheck_ms: u64) -> Duration {
        let started = Instant::now();
        let gather = Gather::start(
            GatherSettings {
                max: 1,
                wait: Duration::ZERO,
                queue: 16,
                recheck: Duration::from_millis(recheck_ms),
            },
            move |_: &[u32]| {
                if started.elapsed() >= Duration::from_millis(100) {
                    2
                } else {
                    1
                }
            },
            |items: Vec<u32>| async move {
                tokio::time::sleep(Duration::from_secs(1)).await;
                items
            },
        );
        let answers = tokio::join!(gather.submit(vec![1]), gather.submit(vec![2]));
        assert_eq!(answers, (Some(vec![1]), Some(vec![2])));
        started.elapsed()
    }

    #[tokio::test(start_paused = true)]
    async fn a_limit_that_grows_while_every_slot_is_busy_is_read_again_every_recheck() {
        // Read every 20 ms: the second batch starts at about 100 ms, beside the first.
        let both = under_a_limit_that_grows(20).await;
        assert!(both < Duration::from_millis(1200), "{both:?}");
        // Read only when a slot frees up: the second waits for the first to end.
        let both = under_a_limit_that_grows(0).await;
        assert!(both >= Duration::from_secs(2), "{both:?}");
    }

    #[tokio::test]
    async fn a_panicking_batch_answers_none_and_frees_its_slot() {
        let batches = Arc::new(AtomicUsize::new(0));
        let n = Arc::clone(&batches);
        let gather = one_batch_at_a_time(move |items: Vec<u32>| {
            let first = n.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                assert!(!first, "the first batch dies");
                items
            }
        });
        assert_eq!(gather.submit(vec![1]).await, None);
        // The slot came back: the next call runs (limit 1).
        assert_eq!(gather.submit(vec![2]).await, Some(vec![2]));
    }

    #[tokio::test]
    async fn a_wrong_count_of_outcomes_is_no_answer_for_anyone() {
        let gather = one_batch_at_a_time(|mut items: Vec<u32>| async move {
            items.pop();
            items
        });
        let (a, b) = tokio::join!(gather.submit(vec![1, 2]), gather.submit(vec![3]));
        assert_eq!((a, b), (None, None));
    }
}
