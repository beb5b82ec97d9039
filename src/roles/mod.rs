//! The roles `seckill` runs, one folder or file each, and the operator tools. Each role's
//! `run` is what its subcommand calls (docs/architecture/roles.md#roles).

pub mod api;
pub mod batch_tx;
pub mod consume;
pub mod half_messages;
pub mod ops;
pub mod resync;
pub mod runtime;
pub mod scan;
pub mod timeout_cancel;
