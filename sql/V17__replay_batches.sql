-- One batch id for every row an operator's replay or discard touched in one command
-- (docs/architecture/recovery.md#dead-letters): `seckill dlq replay --fingerprint` replays a whole
-- group of failures, a sample first, under one id, so the audit answers "what did that
-- replay do" in one query. Rows from before carry none.
-- An expand step: nothing of an earlier release reads or writes it.
ALTER TABLE dlq_audit ADD COLUMN replay_batch_id TEXT;
CREATE INDEX dlq_audit_replay_batch ON dlq_audit (replay_batch_id) WHERE replay_batch_id IS NOT NULL;
