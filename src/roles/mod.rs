//! The roles `seckill` runs, one folder or file each, and the operator tools. Each role's
//! `run` is what its subcommand calls (docs/architecture/roles.md#roles).

pub mod api;
pub mod consume;
pub mod ops;
pub mod runtime;
pub mod scan;
pub mod timeout_cancel;
