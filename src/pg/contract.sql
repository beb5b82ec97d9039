-- The contract step of V25 (docs/architecture/postgresql.md#tables-by-day): the unpartitioned
-- inbox and outbox that releases before V25 use, their triggers and the mirrors that kept them
-- equal to the by-day tables. Run by `seckill migrate --contract` (src/pg/contract.rs), in one
-- transaction once no older release is connected, and by bench/limits/schema.sql. Not a
-- migration of sql/: a release before V25 may still run when this release is migrated.
DROP TRIGGER mirror_back ON consumer_inbox_by_day;
DROP TRIGGER mirror_back ON event_outbox_by_day;
DROP TABLE consumer_inbox, event_outbox;
DROP FUNCTION consumer_inbox_mirror(), event_outbox_mirror(), seckill_twins_differ();
