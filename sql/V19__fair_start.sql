-- A fair start (docs/architecture/hot-path.md#a-fair-start): an activity's first fair_window_ms go to a
-- draw instead of the fastest requests, its tickets numbered from fair_seed (kept, so an audit
-- can recompute the order). 0: first come first served, as before. An expand step: both have
-- defaults a release that does not know them leaves alone.
ALTER TABLE activities ADD COLUMN fair_window_ms INTEGER NOT NULL DEFAULT 0
    CHECK (fair_window_ms >= 0);
ALTER TABLE activities ADD COLUMN fair_seed TEXT;
