//! Gathering: concurrent callers' work joined into shared round trips, each caller answered
//! with its own outcomes. Used by the hot path's broker sends (`mq::batching`) and by the
//! order consumer, whose listener calls share PostgreSQL transactions
//! (docs/architecture/order-creation.md#gathering-batches-across-queues).
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
//! - **Lanes.** A caller may name a lane (`submit_in`): a batch only ever carries one lane's
//!   submissions, and a free slot goes to the lane with the fewest batches in flight, the
//!   oldest waiting caller first among equals. The order consumer's lanes are stock buckets,
//!   so K buckets' rows are locked by K transactions side by side rather than by every one.
//! - If the task that runs a batch panics, its callers are told their work was lost (`None`)
//!   and the slot comes back.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
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

impl GatherSettings {
    /// Items per batch, at least one.
    fn batch_max(&self) -> usize {
        self.max.max(1)
    }

    /// Waiting submissions, at least one.
    fn queue_cap(&self) -> usize {
        self.queue.max(1)
    }
}

/// A gathering task and the way to hand it work.
pub struct Gather<I, O> {
    tx: mpsc::Sender<Submission<I, O>>,
}

struct Submission<I, O> {
    items: Vec<I>,
    arrived: Instant,
    lane: u32,
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
        let (tx, rx) = mpsc::channel(settings.queue_cap());
        tokio::spawn(gather_loop(rx, settings, limit, Arc::new(process)));
        Self { tx }
    }

    /// The outcome of each of `items` once the batch that carried them has run; `None` if it
    /// never ran to the end (the task panicked or is gone): nothing is known of them.
    pub async fn submit(&self, items: Vec<I>) -> Option<Vec<O>> {
        self.submit_in(0, items).await
    }

    /// [`Gather::submit`] in a lane: a batch only ever carries one lane's submissions.
    pub async fn submit_in(&self, lane: u32, items: Vec<I>) -> Option<Vec<O>> {
        let (reply, answer) = oneshot::channel();
        let sub = Submission {
            items,
            arrived: Instant::now(),
            lane,
            reply,
        };
        self.tx.send(sub).await.ok()?;
        answer.await.ok()
    }
}

/// Batches in flight, in all and per lane, and the wake-up of the gathering loop when one ends.
type Running = Arc<(Mutex<InFlight>, Notify)>;

#[derive(Default)]
struct InFlight {
    total: usize,
    per_lane: BTreeMap<u32, usize>,
}

/// One batch in flight; dropping it (however the batch ended) frees the slot.
struct SlotGuard(Running, u32);

impl SlotGuard {
    fn take(running: &Running, lane: u32) -> Self {
        let mut n = running.0.lock().expect("in-flight counts");
        n.total += 1;
        *n.per_lane.entry(lane).or_default() += 1;
        SlotGuard(Arc::clone(running), lane)
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        {
            let mut n = self.0 .0.lock().expect("in-flight counts");
            n.total -= 1;
            if let Some(c) = n.per_lane.get_mut(&self.1) {
                *c -= 1;
                if *c == 0 {
                    n.per_lane.remove(&self.1);
                }
            }
        }
        self.0 .1.notify_waiters();
    }
}

/// Submissions received and not yet in a batch, per lane, in arrival order.
struct Waiting<I, O> {
    lanes: BTreeMap<u32, VecDeque<Submission<I, O>>>,
    len: usize,
}

impl<I, O> Waiting<I, O> {
    fn push(&mut self, s: Submission<I, O>) {
        self.len += 1;
        self.lanes.entry(s.lane).or_default().push_back(s);
    }

    fn pop(&mut self, lane: u32) -> Option<Submission<I, O>> {
        let queue = self.lanes.get_mut(&lane)?;
        let s = queue.pop_front()?;
        if queue.is_empty() {
            self.lanes.remove(&lane);
        }
        self.len -= 1;
        Some(s)
    }

    fn head(&self, lane: u32) -> Option<&Submission<I, O>> {
        self.lanes.get(&lane)?.front()
    }

    /// The lane the next batch serves: the one with the fewest batches in flight (its rows are
    /// the least contended), the oldest head first among equals.
    fn next_lane(&self, running: &Running) -> Option<u32> {
        let n = running.0.lock().expect("in-flight counts");
        self.lanes
            .iter()
            .filter_map(|(lane, q)| Some((*lane, q.front()?.arrived)))
            .min_by_key(|(lane, arrived)| (n.per_lane.get(lane).copied().unwrap_or(0), *arrived))
            .map(|(lane, _)| lane)
    }

    /// Takes what is already queued in the channel, up to `cap` waiting submissions. False once
    /// the channel is closed.
    fn drain(&mut self, rx: &mut mpsc::Receiver<Submission<I, O>>, cap: usize) -> bool {
        while self.len < cap {
            match rx.try_recv() {
                Ok(s) => self.push(s),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
        true
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
    let running: Running = Arc::default();
    let cap = settings.queue_cap();
    let mut waiting = Waiting {
        lanes: BTreeMap::new(),
        len: 0,
    };
    let mut open = true;
    loop {
        if waiting.len == 0 {
            match rx.recv().await {
                Some(s) => waiting.push(s),
                None => break,
            }
        }
        // Wait for a free slot; meanwhile callers queue and join the next batch.
        let lane = loop {
            let freed = running.1.notified();
            if open {
                open = waiting.drain(&mut rx, cap);
            }
            let lane = waiting.next_lane(&running).expect("a waiting submission");
            let allowed = limit(&waiting.head(lane).expect("the lane's head").items).max(1);
            if running.0.lock().expect("in-flight counts").total < allowed {
                break lane;
            }
            if settings.recheck.is_zero() {
                freed.await;
            } else {
                let _ = tokio::time::timeout(settings.recheck, freed).await;
            }
        };
        let (group, count) = fill(&mut waiting, &mut rx, &mut open, lane, settings).await;
        let slot = SlotGuard::take(&running, lane);
        tokio::spawn(run_batch(group, count, slot, Arc::clone(&process)));
    }
}

/// One batch of `lane`: its first waiting caller, the lane's next ones, and while none waits
/// and the channel is open, new callers (within `settings.wait` of the first's arrival), up to
/// `settings.max` items. Returns the callers and their items' count.
async fn fill<I, O>(
    waiting: &mut Waiting<I, O>,
    rx: &mut mpsc::Receiver<Submission<I, O>>,
    open: &mut bool,
    lane: u32,
    settings: GatherSettings,
) -> (Vec<Submission<I, O>>, usize) {
    let (max, cap) = (settings.batch_max(), settings.queue_cap());
    let first = waiting.pop(lane).expect("the lane's head");
    let deadline = first.arrived + settings.wait;
    let mut count = first.items.len();
    let mut group = vec![first];
    while count < max {
        if let Some(s) = waiting.head(lane) {
            if count + s.items.len() > max {
                break;
            }
            count += s.items.len();
            group.push(waiting.pop(lane).expect("the lane's head"));
            continue;
        }
        if !*open || waiting.len >= cap {
            break;
        }
        let next = match rx.try_recv() {
            Ok(s) => Some(s),
            Err(TryRecvError::Disconnected) => {
                *open = false;
                None
            }
            Err(TryRecvError::Empty) if settings.wait.is_zero() => None,
            Err(TryRecvError::Empty) => tokio::time::timeout_at(deadline, rx.recv())
                .await
                .ok()
                .flatten(),
        };
        let Some(s) = next else { break };
        // Another lane's submission waits for a batch of its own; one of this lane that does
        // not fit leads the lane's next batch.
        waiting.push(s);
    }
    (group, count)
}

/// Runs one batch and answers each caller with its own items' outcomes; `slot` is freed when
/// it ends, however it ends.
async fn run_batch<I, O, F, Fut>(
    group: Vec<Submission<I, O>>,
    count: usize,
    slot: SlotGuard,
    process: Arc<F>,
) where
    F: Fn(Vec<I>) -> Fut,
    Fut: Future<Output = Vec<O>>,
{
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

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
    async fn a_batch_carries_one_lane_and_each_caller_gets_its_own_outcomes() {
        let batches = Arc::new(Mutex::new(Vec::<Vec<u32>>::new()));
        let seen = Arc::clone(&batches);
        let gather = one_batch_at_a_time(move |items: Vec<u32>| {
            seen.lock().unwrap().push(items.clone());
            async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                items
            }
        });
        // Item i is in lane i % 3: 60 one-item callers of three lanes, queued together.
        let calls = (0..60u32).map(|i| gather.submit_in(i % 3, vec![i]));
        let answers = futures::future::join_all(calls).await;
        for (i, answer) in answers.into_iter().enumerate() {
            assert_eq!(answer, Some(vec![i as u32]));
        }
        let batches = batches.lock().unwrap().clone();
        assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), 60);
        for batch in &batches {
            let lane = batch[0] % 3;
            assert!(
                batch.iter().all(|i| i % 3 == lane),
                "lanes mixed: {batch:?}"
            );
        }
        // Still gathered: far fewer batches than callers.
        assert!(
            batches.len() <= 9,
            "60 callers took {} batches",
            batches.len()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_next_batch_goes_to_the_lane_with_the_fewest_in_flight() {
        let order = Arc::new(Mutex::new(Vec::<u32>::new()));
        let seen = Arc::clone(&order);
        let gather = Gather::start(
            GatherSettings {
                max: 1,
                wait: Duration::ZERO,
                queue: 16,
                recheck: Duration::ZERO,
            },
            |_: &[u32]| 2,
            move |items: Vec<u32>| {
                seen.lock().unwrap().push(items[0]);
                // Item 1's batch holds its slot for 3 s, every other batch for 1 s.
                let secs = if items[0] == 1 { 3 } else { 1 };
                async move {
                    tokio::time::sleep(Duration::from_secs(secs)).await;
                    items
                }
            },
        );
        let g = &gather;
        let after = move |ms, lane, item| async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            g.submit_in(lane, vec![item]).await
        };
        // Lane 0's items 0 and 1 take both slots; its item 2 queues, then lane 1's item 10.
        // When item 0's slot frees, lane 0 still has a batch in flight and lane 1 none: lane
        // 1's caller goes first, though lane 0's waiting caller is older.
        let answers = tokio::join!(
            gather.submit_in(0, vec![0]),
            gather.submit_in(0, vec![1]),
            after(10, 0, 2),
            after(20, 1, 10)
        );
        assert_eq!(
            answers,
            (Some(vec![0]), Some(vec![1]), Some(vec![2]), Some(vec![10]))
        );
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 10, 2]);
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
