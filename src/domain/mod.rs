//! The pipeline's vocabulary, free of I/O: identifiers, the ORDER_CREATE_REQUESTED event
//! (schema v1, §9), request validation and the decisions a consumer can take.

pub mod event;
pub mod ids;
pub mod request;

pub use event::{OrderCreateRequested, TraceContext, EVENT_ORDER_CREATE_REQUESTED, SCHEMA_VERSION};
pub use ids::Ids;
pub use request::{ReserveRequest, ValidationError};
