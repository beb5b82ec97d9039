-- Replays read from a source topic (`seckill dlq replay --from-source`,
-- docs/architecture/recovery.md#dead-letters): a message the consumer group never applied, found in the
-- topic itself rather than in a dead-letter table, is named on its audit row by where the broker
-- stored it (`<topic>@<broker>:<queue>:<offset>`). An expand step: the check is looser than the
-- one it replaces, so a release that does not know the column still writes valid rows.
ALTER TABLE dlq_audit ADD COLUMN source_ref TEXT;
ALTER TABLE dlq_audit DROP CONSTRAINT dlq_audit_one_subject;
ALTER TABLE dlq_audit ADD CONSTRAINT dlq_audit_one_subject
    CHECK (num_nonnulls(dlq_id, quarantine_id, source_ref) = 1);
