//! Recovery paths on the real services (docs/architecture/recovery.md), one file per path:
//! `scanner` re-sends what the API never sent or the consumers never took, `relay` delivers the
//! outbox, `compensation` releases a reservation exactly once, `order_state` keeps the timeout
//! cancel and the payment from both winning and projects an order's status by version. What
//! more than one of them uses is here.

mod compensation;
mod order_state;
mod relay;
mod scanner;

/// A fixed reading of a consumer group's progress (the order-create group's for the scanner,
/// the compensation group's for the relay).
struct Progress(Option<i64>);

#[async_trait::async_trait]
impl seckill::roles::scan::unconsumed::ProgressReader for Progress {
    async fn taken_until_ms(&self) -> Option<i64> {
        self.0
    }
}
