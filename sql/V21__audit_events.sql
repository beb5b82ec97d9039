-- The audit stream (docs/architecture/messages.md#the-audit-stream): every event of the
-- order-event topic as the group CG_SECKILL_AUDIT_V1 received it, one row per event however
-- often it was delivered, appended and never updated, for a data team to read without touching
-- the order tables.
--
-- Partitioned by day of order_at, the time the order's id was minted (its ULID's time): every
-- event of one order lands in one partition, so the primary key (order_at, message_id) keeps a
-- redelivered event out whatever day it comes back. The consumer creates each day's partition
-- as its first event arrives (audit_events_pYYYYMMDD); whole partitions are what retention will
-- shed. An expand step: a release that does not know it has no audit group and writes nothing.
CREATE TABLE audit_events (
    order_at          TIMESTAMPTZ NOT NULL,
    -- The event's id (its message_id property): ORDER_CREATED, ORDER_PAID, ... of one order.
    message_id        TEXT NOT NULL,
    event_type        TEXT NOT NULL,
    order_id          TEXT NOT NULL,
    activity_id       BIGINT,
    aggregate_version INTEGER,
    -- The event as it was published.
    payload           JSONB NOT NULL,
    -- Where and when the broker stored the copy recorded (the first one to arrive).
    topic             TEXT NOT NULL,
    broker_msg_id     TEXT NOT NULL,
    stored_at         TIMESTAMPTZ NOT NULL,
    recorded_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (order_at, message_id)
) PARTITION BY RANGE (order_at);
CREATE INDEX audit_events_activity ON audit_events (activity_id, order_at);
