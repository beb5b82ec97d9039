-- Events sent as RocketMQ transaction messages (docs/ARCHITECTURE.md#delivering-events): the
-- local transaction writes the event's row as TRANSACTION, a status the relay never claims;
-- the broker's check-back answers COMMIT because the row exists. The producer marks it SENT
-- once it sent the commit; one still TRANSACTION past the broker's decision horizon is put
-- back to PENDING by reconcile, so the relay sends it (the inbox absorbs a copy).
ALTER TABLE event_outbox DROP CONSTRAINT event_outbox_status_check;
ALTER TABLE event_outbox ADD CONSTRAINT event_outbox_status_check
    CHECK (status IN ('PENDING', 'SENT', 'DEAD', 'TRANSACTION'));
ALTER TABLE event_outbox ADD COLUMN delivery TEXT NOT NULL DEFAULT 'outbox'
    CHECK (delivery IN ('outbox', 'transaction'));
CREATE INDEX event_outbox_in_transaction ON event_outbox (created_at) WHERE status = 'TRANSACTION';
