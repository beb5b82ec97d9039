-- What an operator's action on a dead letter found and did (docs/ARCHITECTURE.md#dead-letters):
-- the pre-checks a replay or discard ran (already applied? reservation still held? schema
-- known? older than the inbox retention?) and the effect observed afterwards (the replayed
-- message applied, a duplicate, not seen; a discard's reservation withdrawn or already decided).
ALTER TABLE dlq_audit ADD COLUMN checks JSONB;
ALTER TABLE dlq_audit ADD COLUMN effect TEXT;
