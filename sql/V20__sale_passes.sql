-- Sale passes (docs/architecture/hot-path.md#sale-passes): an activity with pass_limit set sells only to
-- buyers holding a pass, at most pass_limit of them issued, one per buyer, registered between
-- pass_registration_opens_at and pass_registration_closes_at (the sale's start when NULL), with
-- a proof of work of pass_pow_difficulty counters (0: none). passes_issued counts what
-- sale_passes holds, in the same transaction. An expand step: a release that does not know
-- them leaves the activity without passes, as before.
ALTER TABLE activities ADD COLUMN pass_limit INTEGER CHECK (pass_limit IS NULL OR pass_limit >= 0);
ALTER TABLE activities ADD COLUMN passes_issued INTEGER NOT NULL DEFAULT 0
    CHECK (passes_issued >= 0 AND passes_issued <= COALESCE(pass_limit, 0));
ALTER TABLE activities ADD COLUMN pass_registration_opens_at TIMESTAMPTZ;
ALTER TABLE activities ADD COLUMN pass_registration_closes_at TIMESTAMPTZ;
ALTER TABLE activities ADD COLUMN pass_pow_difficulty INTEGER NOT NULL DEFAULT 0
    CHECK (pass_pow_difficulty >= 0);

CREATE TABLE sale_passes (
    activity_id BIGINT NOT NULL REFERENCES activities (activity_id),
    user_id     BIGINT NOT NULL,
    pass_id     TEXT NOT NULL UNIQUE,
    issued_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The address the registration came from (for the operator reading who registered).
    client_addr TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (activity_id, user_id)
);
