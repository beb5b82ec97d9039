//! Batched sends for the hot path (docs/architecture/hot-path.md#batched-sends): concurrent `send`
//! calls are gathered into small broker batches.
//!
//! One synchronous send per reservation tops out near 10,000 msg/s on this kind of machine
//! and costs the broker a full core; batches of 32 reach several times that for the same CPU
//! (`seckill-bench broker`, BENCHMARKS.md). Every caller still waits for the broker's answer
//! about its own message, and gets its own outcome: a confirmed batch confirms each message
//! (with its own id), an unknown batch is unknown for each, and a refused batch is retried
//! message by message by the inner publisher so each gets its own verdict.
//!
//! A batch closes when it is full, or when nothing more arrives within `linger` of its first
//! message; while `max_in_flight` batches are already on the wire, waiting callers simply
//! accumulate into the next one (`crate::gather`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{OutMessage, Publisher, SendOutcome};
use crate::gather::{Gather, GatherSettings};

/// Sizing of a [`BatchingPublisher`].
#[derive(Debug, Clone, Copy)]
pub struct BatchingOptions {
    /// Messages per broker call at most.
    pub max_batch: usize,
    /// How long a batch waits for more messages after its first one.
    pub linger: Duration,
    /// Broker calls in flight at once.
    pub max_in_flight: usize,
}

struct Pending {
    msg: OutMessage,
    timeout_ms: u64,
    queued_at: Instant,
}

/// A [`Publisher`] that turns concurrent single sends into broker batches.
pub struct BatchingPublisher {
    inner: Arc<dyn Publisher>,
    gather: Gather<Pending, SendOutcome>,
}

impl BatchingPublisher {
    /// Starts the batching task on the current Tokio runtime. It ends when the publisher is
    /// dropped, after sending what was queued.
    pub fn start(inner: Arc<dyn Publisher>, opts: BatchingOptions) -> Self {
        let max_in_flight = opts.max_in_flight.max(1);
        let settings = GatherSettings {
            max: opts.max_batch.max(1),
            wait: opts.linger,
            queue: opts.max_batch.max(1) * max_in_flight * 4,
            recheck: Duration::ZERO,
        };
        let sender = Arc::clone(&inner);
        let gather = Gather::start(
            settings,
            move |_: &[Pending]| max_in_flight,
            move |batch: Vec<Pending>| {
                let inner = Arc::clone(&sender);
                async move { flush(inner.as_ref(), batch).await }
            },
        );
        Self { inner, gather }
    }
}

#[async_trait::async_trait]
impl Publisher for BatchingPublisher {
    async fn send(&self, msg: OutMessage, timeout_ms: u64) -> SendOutcome {
        if msg.deliver_time_ms.is_some() || msg.sharding_key.is_some() {
            // The broker batches neither delayed nor ordered messages.
            return self.inner.send(msg, timeout_ms).await;
        }
        let pending = Pending {
            msg,
            timeout_ms,
            queued_at: Instant::now(),
        };
        match self.gather.submit(vec![pending]).await {
            Some(mut outcome) if outcome.len() == 1 => outcome.remove(0),
            _ => SendOutcome::Unknown {
                error: "batched send abandoned before the broker answered".into(),
            },
        }
    }

    async fn send_batch(&self, msgs: Vec<OutMessage>, timeout_ms: u64) -> Vec<SendOutcome> {
        self.inner.send_batch(msgs, timeout_ms).await
    }
}

/// Sends one gathered batch: one outcome per message, in order (a publisher that answers
/// with another count makes every caller's outcome unknown).
async fn flush(inner: &dyn Publisher, batch: Vec<Pending>) -> Vec<SendOutcome> {
    metrics::histogram!("mq_publish_batch_size").record(batch.len() as f64);
    // The tightest caller bound, less the time it already waited in the queue.
    let timeout_ms = batch
        .iter()
        .map(|p| {
            p.timeout_ms
                .saturating_sub(p.queued_at.elapsed().as_millis() as u64)
        })
        .min()
        .unwrap_or(0)
        .max(1);
    let mut msgs: Vec<OutMessage> = batch.into_iter().map(|p| p.msg).collect();
    if msgs.len() == 1 {
        let msg = msgs.pop().expect("one message");
        vec![inner.send(msg, timeout_ms).await]
    } else {
        inner.send_batch(msgs, timeout_ms).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Records the size of every broker call; fails messages whose body is "bad".
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<usize>>,
        batch_unknown: bool,
    }

    fn verdict(m: &OutMessage) -> SendOutcome {
        if m.body == b"bad" {
            SendOutcome::DefiniteFailure {
                error: "bad".into(),
            }
        } else {
            SendOutcome::Confirmed {
                broker_msg_id: String::from_utf8_lossy(&m.body).into_owned(),
            }
        }
    }

    #[async_trait::async_trait]
    impl Publisher for Recorder {
        async fn send(&self, msg: OutMessage, _timeout_ms: u64) -> SendOutcome {
            self.calls.lock().unwrap().push(1);
            if self.batch_unknown {
                return SendOutcome::Unknown {
                    error: "timeout".into(),
                };
            }
            verdict(&msg)
        }
        async fn send_batch(&self, msgs: Vec<OutMessage>, _timeout_ms: u64) -> Vec<SendOutcome> {
            self.calls.lock().unwrap().push(msgs.len());
            tokio::time::sleep(Duration::from_millis(5)).await;
            if self.batch_unknown {
                return vec![
                    SendOutcome::Unknown {
                        error: "timeout".into()
                    };
                    msgs.len()
                ];
            }
            msgs.iter().map(verdict).collect()
        }
    }

    fn msg(body: &str) -> OutMessage {
        OutMessage {
            topic: "T".into(),
            body: body.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    async fn send_all(p: Arc<BatchingPublisher>, bodies: Vec<String>) -> Vec<SendOutcome> {
        let tasks: Vec<_> = bodies
            .into_iter()
            .map(|b| {
                let p = Arc::clone(&p);
                tokio::spawn(async move { p.send(msg(&b), 1000).await })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    fn opts(max_batch: usize, max_in_flight: usize) -> BatchingOptions {
        BatchingOptions {
            max_batch,
            linger: Duration::from_millis(1),
            max_in_flight,
        }
    }

    #[tokio::test]
    async fn concurrent_sends_share_broker_calls_and_each_gets_its_own_outcome() {
        let rec = Arc::new(Recorder::default());
        let p = Arc::new(BatchingPublisher::start(rec.clone(), opts(8, 1)));
        let mut bodies: Vec<String> = (0..40).map(|i| format!("m{i}")).collect();
        bodies[7] = "bad".into();
        let out = send_all(p, bodies.clone()).await;
        for (b, o) in bodies.iter().zip(&out) {
            if b == "bad" {
                assert!(matches!(o, SendOutcome::DefiniteFailure { .. }), "{o:?}");
            } else {
                assert_eq!(
                    o,
                    &SendOutcome::Confirmed {
                        broker_msg_id: b.clone()
                    }
                );
            }
        }
        let calls = rec.calls.lock().unwrap().clone();
        assert_eq!(calls.iter().sum::<usize>(), 40, "every message sent once");
        assert!(calls.iter().all(|&n| n <= 8), "bounded batches: {calls:?}");
        assert!(calls.len() < 40, "sends were batched: {calls:?}");
    }

    #[tokio::test]
    async fn an_unknown_batch_is_unknown_for_each_message() {
        let rec = Arc::new(Recorder {
            batch_unknown: true,
            ..Default::default()
        });
        let p = Arc::new(BatchingPublisher::start(rec, opts(16, 1)));
        let out = send_all(p, (0..16).map(|i| format!("m{i}")).collect()).await;
        assert!(out.iter().all(|o| matches!(o, SendOutcome::Unknown { .. })));
    }

    #[tokio::test]
    async fn a_lone_message_goes_out_alone_after_the_linger() {
        let rec = Arc::new(Recorder::default());
        let p = BatchingPublisher::start(rec.clone(), opts(32, 4));
        let started = Instant::now();
        let o = p.send(msg("solo"), 1000).await;
        assert_eq!(
            o,
            SendOutcome::Confirmed {
                broker_msg_id: "solo".into()
            }
        );
        assert_eq!(rec.calls.lock().unwrap().as_slice(), &[1]);
        assert!(started.elapsed() < Duration::from_millis(500));
    }

    #[tokio::test]
    async fn delayed_messages_bypass_the_batcher() {
        let rec = Arc::new(Recorder::default());
        let p = BatchingPublisher::start(rec.clone(), opts(32, 4));
        let mut m = msg("later");
        m.deliver_time_ms = Some(1);
        assert!(matches!(
            p.send(m, 1000).await,
            SendOutcome::Confirmed { .. }
        ));
        assert_eq!(rec.calls.lock().unwrap().as_slice(), &[1]);
    }
}
