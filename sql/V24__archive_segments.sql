-- The archive's catalogue (docs/architecture/postgresql.md#the-archive): one row per segment
-- of rows retention took out of PostgreSQL, inserted in the transaction that deletes the rows
-- (or drops their partition), so a row committed here means its rows left the table and sit in
-- the file named, whose checksum it repeats. A segment file without a row here was written by a
-- pass that did not commit: its rows are still in the table. An expand step: nothing older
-- reads it.
CREATE TABLE archive_segments (
    segment_id  TEXT PRIMARY KEY,
    table_name  TEXT NOT NULL,
    -- Relative to the environment's archive root (retention.archive_dir/<env>).
    path        TEXT NOT NULL,
    row_count   BIGINT NOT NULL,
    bytes       BIGINT NOT NULL,
    sha256      TEXT NOT NULL,
    oldest_at   TIMESTAMPTZ,
    newest_at   TIMESTAMPTZ,
    -- DELETE (a retention batch) or DROP <partition>.
    source      TEXT NOT NULL,
    archived_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX archive_segments_table ON archive_segments (table_name, oldest_at);
