//! The order transaction against real PostgreSQL, driving the consumer's handler directly
//! (the one-step function of the consume role), one file per concern: `outcomes` (what one
//! message comes to: the rows and events written together, poison, expiry, a transient
//! failure), `duplicates` (one order however often a message, reservation or buyer arrives),
//! `stock` (batches against the stock left, SKUs, stock buckets, the transaction budget). Each
//! test has its own schema.

mod duplicates;
mod outcomes;
mod stock;

use std::sync::Arc;

use crate::common::TestEnv;
use seckill::roles::consume::order_create::OrderCreateHandler;

async fn handler(env: &TestEnv, workers: usize) -> Arc<OrderCreateHandler> {
    Arc::new(OrderCreateHandler::new(
        env.order_pool(workers + 1).await,
        &env.settings,
        workers,
    ))
}
