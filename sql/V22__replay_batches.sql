-- An operator's replay batch (docs/RUNBOOK.md#dead-letters): how far the running
-- `seckill dlq replay` got and whether it may go on. `seckill dlq replay --pause <batch>` sets
-- PAUSED and the running command stops before its next message, noting when it held
-- (held_at); `--resume <batch>` sets RUNNING and it goes on where it stopped. The rows it sent
-- are in dlq_audit under the same replay_batch_id. An expand step: nothing older reads it.
CREATE TABLE replay_batches (
    batch_id   TEXT PRIMARY KEY,
    status     TEXT NOT NULL CHECK (status IN ('RUNNING', 'PAUSED', 'DONE')),
    total      INTEGER NOT NULL CHECK (total >= 0),
    sent       INTEGER NOT NULL DEFAULT 0 CHECK (sent >= 0),
    actor      TEXT NOT NULL,
    reason     TEXT NOT NULL,
    started_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- When the running command last stopped for a pause (NULL: never).
    held_at    TIMESTAMPTZ,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
