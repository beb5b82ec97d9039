-- Quarantined messages can be replayed (`seckill dlq replay --quarantined`,
-- docs/ARCHITECTURE.md#dead-letters): a message a consumer could not read, such as a schema
-- version it did not know yet during a rollout, goes back to its topic once a consumer that
-- reads it runs. The row says whether it was; the audit row (the dead letters' audit, which
-- now names either a dead letter or a quarantined message) says who, why and what came of it.
-- An expand step: a release that does not know these columns writes rows that keep their
-- defaults. No foreign key to quarantined_messages: retention purges those rows, the audit
-- trail is never purged.
ALTER TABLE quarantined_messages ADD COLUMN status TEXT NOT NULL DEFAULT 'QUARANTINED'
    CHECK (status IN ('QUARANTINED', 'REPLAYED'));
ALTER TABLE quarantined_messages ADD COLUMN updated_at TIMESTAMPTZ;
ALTER TABLE dlq_audit ALTER COLUMN dlq_id DROP NOT NULL;
ALTER TABLE dlq_audit ADD COLUMN quarantine_id BIGINT;
ALTER TABLE dlq_audit ADD CONSTRAINT dlq_audit_one_subject
    CHECK ((dlq_id IS NULL) <> (quarantine_id IS NULL));
CREATE INDEX quarantined_messages_open ON quarantined_messages (received_at)
    WHERE status = 'QUARANTINED';
