-- When Redis forgets acknowledged writes (docs/architecture/redis.md#when-redis-forgets): one row per
-- time an activity's Redis state was found behind what it had answered, or an operator asked
-- for a rebuild. While a row is open (resumed_at NULL) the activity admits no reservation;
-- the scanner waits until every message sent before the fence is consumed (drained_at),
-- rebuilds the activity's Redis state from this database (rebuilt_at, with its figures in
-- `rebuild`) and lifts the fence (resumed_at). The fence id becomes the activity's Redis
-- epoch: a later loss that takes Redis back before the rebuild shows as an older epoch.
-- An expand step: nothing of an earlier release reads or writes it.
CREATE TABLE redis_fences (
    fence_id     BIGSERIAL PRIMARY KEY,
    activity_id  BIGINT      NOT NULL REFERENCES activities (activity_id),
    -- what saw it: sequence, epoch, meta_missing, compensation_missing, suspect_flag, operator
    signal       TEXT        NOT NULL,
    detail       TEXT        NOT NULL,
    -- the process that saw it (role@host:pid) or the operator
    detected_by  TEXT        NOT NULL,
    detected_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    drained_at   TIMESTAMPTZ,
    rebuilt_at   TIMESTAMPTZ,
    resumed_at   TIMESTAMPTZ,
    rebuild      JSONB
);
-- One open fence per activity: a second detector of the same loss joins the first.
CREATE UNIQUE INDEX redis_fences_open ON redis_fences (activity_id) WHERE resumed_at IS NULL;
