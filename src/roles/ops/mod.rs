//! Operator tools: one-shot commands, not long-running roles (docs/ARCHITECTURE.md#operator-tools).
//!
//! - `migrate`: the database migrations in `sql/`;
//! - `topics`: the pipeline's broker topics;
//! - `activity`: a flash-sale activity, its stock, and Redis warmed for it;
//! - `dlq`: list, show, replay and discard dead letters;
//! - `reconcile`: the drift check that emits missing events and changes no business state.

pub mod activity;
pub mod dlq;
pub mod migrate;
pub mod reconcile;
pub mod topics;
