//! Operator tools: one-shot commands, not long-running roles
//! (docs/architecture/roles.md#operator-tools).
//!
//! - `migrate`: the database migrations in `sql/`;
//! - `topics`: the pipeline's broker topics;
//! - `activity`: a flash-sale activity, its stock, and Redis warmed for it; `activity resync`
//!   rebuilds its Redis state from PostgreSQL (`resync`);
//! - `dlq`: list, show, replay and discard dead letters;
//! - `reconcile`: the drift check that emits missing events and changes no business state;
//! - `outbox`: DEAD outbox rows back to PENDING (audited);
//! - `refunds`: the refunds owed for payments no order could take, and their marking (audited);
//! - `dev_credentials`: development buyer tokens and signed payment notifications.

pub mod activity;
pub mod archive;
pub mod dev_credentials;
pub mod dlq;
pub mod migrate;
pub mod outbox;
pub mod reconcile;
pub mod refunds;
pub mod resync;
pub mod topics;
