-- Refunds the shop owes (docs/architecture/recovery.md#refund-obligations): the payment provider
-- confirmed a payment that no order could take (the order was cancelled or past its payment
-- window, already paid with another payment, or the amount was not the order's). The buyer's
-- money has left their account; this row is the shop's durable promise to give it back,
-- written in the transaction that decided the payment could not settle the order, once per
-- payment id. An operator (`seckill refunds`) or the shop's refund worker (the
-- REFUND_REQUIRED event on the order's stream, then the admin route) marks it REFUNDED.
-- Never purged: it is a financial record.
-- An expand step: nothing of an earlier release reads or writes it.
CREATE TABLE refund_obligations (
    payment_id        TEXT        PRIMARY KEY,
    activity_id       BIGINT      NOT NULL,
    order_id          TEXT        NOT NULL,
    user_id           BIGINT      NOT NULL,
    amount_cents      BIGINT      NOT NULL CHECK (amount_cents >= 0),
    reason            TEXT        NOT NULL
        CHECK (reason IN ('ORDER_CANCELED', 'ORDER_EXPIRED', 'ALREADY_PAID', 'AMOUNT_MISMATCH')),
    status            TEXT        NOT NULL DEFAULT 'PENDING'
        CHECK (status IN ('PENDING', 'REFUNDED')),
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    refunded_at       TIMESTAMPTZ,
    -- the provider's refund id (or an operator's note) and who marked it
    refund_reference  TEXT,
    refunded_by       TEXT,
    CHECK ((status = 'REFUNDED') = (refunded_at IS NOT NULL))
);
CREATE INDEX refund_obligations_pending ON refund_obligations (created_at) WHERE status = 'PENDING';
CREATE INDEX refund_obligations_by_order ON refund_obligations (order_id);
