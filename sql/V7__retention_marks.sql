-- How far retention has purged each table (docs/ARCHITECTURE.md#retention): rows older than
-- purged_before may be gone. The invariant check reads it, so that an order whose inbox row was
-- purged with its age is not taken for an order no message created.
CREATE TABLE retention_marks (
    table_name     TEXT        PRIMARY KEY,
    purged_before  TIMESTAMPTZ NOT NULL,
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
