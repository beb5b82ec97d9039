//! The DLQ loop on the real broker and PostgreSQL (docs/architecture/recovery.md#dead-letters),
//! one file per concern: `intake` (a message that fails every time lands in the group's %DLQ%
//! topic after its retries, is recorded with the error that killed it, counts in the gauge's
//! source, and is listed, replayed and discarded through the binary), `decisions` (an operator's
//! decision on one dead letter has one effect: a replay racing the normal redelivery, a discard
//! that gives an order-create message's unit back once after a dry run), `groups` (dead letters
//! failing the same way form one group, replayed sample first or discarded whole).

mod decisions;
mod groups;
mod intake;
mod pause;
mod tickets;
