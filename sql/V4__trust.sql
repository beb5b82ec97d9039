-- The trust boundary (docs/ARCHITECTURE.md#security-model).

-- A payment id settles at most one order. The payment route checks it first; this index makes
-- two notifications racing with one id unable to both win. (A database where one id already
-- paid several orders fails this migration: those orders need an operator first.)
CREATE UNIQUE INDEX orders_payment_id ON orders (payment_id) WHERE payment_id IS NOT NULL;

-- One row per operator action on the admin listener or the matching CLI: who (the peer), what,
-- on what, and what it came to. Never deleted by retention.
CREATE TABLE admin_audit (
    audit_id    BIGSERIAL PRIMARY KEY,
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor       TEXT        NOT NULL,
    action      TEXT        NOT NULL,
    target      TEXT        NOT NULL,
    detail      JSONB       NOT NULL DEFAULT '{}'::jsonb
);
CREATE INDEX admin_audit_at ON admin_audit (at);

-- Why an outbox row went DEAD: BROKER (no answer from the broker: requeued by the relay itself
-- once the broker answers again, at most auto_requeues < 3 times) or REFUSED (the broker
-- refused this message: an operator looks first, then `seckill outbox requeue`).
ALTER TABLE event_outbox ADD COLUMN dead_reason TEXT;
ALTER TABLE event_outbox ADD COLUMN auto_requeues INTEGER NOT NULL DEFAULT 0;
CREATE INDEX event_outbox_dead ON event_outbox (created_at) WHERE status = 'DEAD';
