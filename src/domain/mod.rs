//! The pipeline's vocabulary, free of I/O: identifiers, the ORDER_CREATE_REQUESTED event
//! (schema v1), the events PostgreSQL originates with their ids, request validation and the
//! decisions a consumer or a state change can take, and the words that carry state (`status`).

pub mod decision;
pub mod events;
pub mod ids;
pub mod order_create;
pub mod request;
pub mod rfc3339;
pub mod status;

pub use decision::{CancelOutcome, Decision, PayOutcome, RejectReason};
pub use ids::Ids;
pub use order_create::{
    OrderCreateRequested, TraceContext, EVENT_ORDER_CREATE_REQUESTED, SCHEMA_VERSION,
};
pub use request::{ReserveRequest, ValidationError};
