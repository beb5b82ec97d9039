-- The inbox and the outbox partitioned by day (docs/architecture/postgresql.md#tables-by-day):
-- retention archives and drops a whole day instead of deleting row by row.
--
-- The partition key is the time in the first ULID of the row's id (message_id, event_id), not
-- the time the row was written: a message delivered again days later computes the same day, so
-- the primary key, which must hold the key, still turns every copy of one message into one row.
-- An id without a ULID gets the epoch and lands in the DEFAULT partition, purged row by row as
-- before.
--
-- An expand step. Releases before this one keep writing consumer_inbox and event_outbox,
-- which this release no longer reads or writes; until every instance runs this release both
-- pairs of tables are kept equal by the triggers below, each in the other's direction, so
-- either release sees every row and one primary key (the new table's) decides which copy of a
-- message is processed. The contract step, `seckill migrate --contract` once no older release
-- is connected (src/pg/contract.rs), drops the old tables and the triggers.

-- The time in the first ULID inside an id such as evt_<ULID>, rsv_<activity>_<ULID> or
-- ord_<ULID>.<payment>.REFUND_REQUIRED: the leftmost 26 characters of Crockford's base 32 whose
-- first is 0-7, the first 10 the milliseconds; the epoch when there is none. This release's
-- writers compute the same in Rust (src/domain/ids.rs, id_at) and send it; this function is for
-- the rows an older release writes (the triggers below) and for the copy.
CREATE FUNCTION seckill_id_at(id TEXT) RETURNS TIMESTAMPTZ
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    u TEXT := substring(id FROM '[0-7][0-9A-HJKMNP-TV-Z]{25}');
    ms INT8 := 0;
BEGIN
    IF u IS NULL THEN
        RETURN 'epoch'::timestamptz;
    END IF;
    FOR k IN 1..10 LOOP
        ms := ms * 32 + strpos('0123456789ABCDEFGHJKMNPQRSTVWXYZ', substr(u, k, 1)) - 1;
    END LOOP;
    RETURN 'epoch'::timestamptz + make_interval(secs => ms / 1000.0);
END
$$;

CREATE TABLE consumer_inbox_by_day (
    LIKE consumer_inbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    id_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (activity_id, consumer_group, message_id, id_at)
) PARTITION BY RANGE (id_at);
CREATE INDEX consumer_inbox_by_day_message ON consumer_inbox_by_day (consumer_group, message_id);
CREATE INDEX consumer_inbox_by_day_received ON consumer_inbox_by_day (received_at);
CREATE TABLE consumer_inbox_by_day_default PARTITION OF consumer_inbox_by_day DEFAULT;

CREATE TABLE event_outbox_by_day (
    LIKE event_outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
    id_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (activity_id, event_id, id_at)
) PARTITION BY RANGE (id_at);
CREATE INDEX event_outbox_by_day_event ON event_outbox_by_day (event_id);
CREATE INDEX event_outbox_by_day_pending ON event_outbox_by_day (next_attempt_at)
    WHERE status = 'PENDING';
CREATE INDEX event_outbox_by_day_dead ON event_outbox_by_day (created_at) WHERE status = 'DEAD';
CREATE INDEX event_outbox_by_day_in_transaction ON event_outbox_by_day (created_at)
    WHERE status = 'TRANSACTION';
CREATE TABLE event_outbox_by_day_default PARTITION OF event_outbox_by_day DEFAULT;

-- The old tables' writers wait while their rows are copied; the triggers start with the copy.
LOCK TABLE consumer_inbox, event_outbox IN SHARE ROW EXCLUSIVE MODE;

-- A partition for every day the copied rows name and for the days ahead; later days are made
-- ahead by the scan role's retention pass (src/pg/partitions.rs names them alike).
DO $$
DECLARE
    t TEXT;
    d DATE;
BEGIN
    FOR t, d IN
        SELECT DISTINCT 'consumer_inbox_by_day', (seckill_id_at(message_id) AT TIME ZONE 'UTC')::date
        FROM consumer_inbox WHERE seckill_id_at(message_id) > 'epoch'
        UNION
        SELECT DISTINCT 'event_outbox_by_day', (seckill_id_at(event_id) AT TIME ZONE 'UTC')::date
        FROM event_outbox WHERE seckill_id_at(event_id) > 'epoch'
        UNION
        SELECT n, (now() AT TIME ZONE 'UTC')::date + k
        FROM unnest(ARRAY['consumer_inbox_by_day', 'event_outbox_by_day']) n,
             generate_series(0, 3) k
    LOOP
        EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)',
                       t || '_p' || to_char(d, 'YYYYMMDD'), t,
                       d::text || ' 00:00:00+00', (d + 1)::text || ' 00:00:00+00');
    END LOOP;
END
$$;

INSERT INTO consumer_inbox_by_day SELECT i.*, seckill_id_at(i.message_id) FROM consumer_inbox i;
INSERT INTO event_outbox_by_day SELECT e.*, seckill_id_at(e.event_id) FROM event_outbox e;

-- Mirrors, each table to its twin; a row written by a mirror is not mirrored back
-- (pg_trigger_depth). They name the tables of the schema they were made in, whatever the
-- writing session's search_path (SET search_path FROM CURRENT). A claim in the old inbox is first a claim in the new one: taken there,
-- the old release reads it as the duplicate it is. An update is the same update of the twin.
CREATE FUNCTION consumer_inbox_mirror() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    IF pg_trigger_depth() > 1 THEN
        IF TG_WHEN = 'BEFORE' THEN
            RETURN NEW;
        END IF;
        RETURN NULL;
    END IF;
    IF TG_TABLE_NAME = 'consumer_inbox' THEN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO consumer_inbox_by_day SELECT NEW.*, seckill_id_at(NEW.message_id)
            ON CONFLICT DO NOTHING;
            IF FOUND THEN
                RETURN NEW;
            END IF;
            RETURN NULL;
        ELSIF TG_OP = 'UPDATE' THEN
            UPDATE consumer_inbox_by_day
            SET (consumer_group, message_id, topic, reservation_id, order_id, status, decision,
                 delivery_attempt, received_at, updated_at, activity_id, id_at)
              = (NEW.consumer_group, NEW.message_id, NEW.topic, NEW.reservation_id, NEW.order_id,
                 NEW.status, NEW.decision, NEW.delivery_attempt, NEW.received_at, NEW.updated_at,
                 NEW.activity_id, seckill_id_at(NEW.message_id))
            WHERE activity_id = OLD.activity_id AND consumer_group = OLD.consumer_group
              AND message_id = OLD.message_id AND id_at = seckill_id_at(OLD.message_id);
        ELSE
            DELETE FROM consumer_inbox_by_day
            WHERE activity_id = OLD.activity_id AND consumer_group = OLD.consumer_group
              AND message_id = OLD.message_id AND id_at = seckill_id_at(OLD.message_id);
        END IF;
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        INSERT INTO consumer_inbox
        VALUES (NEW.consumer_group, NEW.message_id, NEW.topic, NEW.reservation_id, NEW.order_id,
                NEW.status, NEW.decision, NEW.delivery_attempt, NEW.received_at, NEW.updated_at,
                NEW.activity_id)
        ON CONFLICT DO NOTHING;
    ELSIF TG_OP = 'UPDATE' THEN
        UPDATE consumer_inbox
        SET (consumer_group, message_id, topic, reservation_id, order_id, status, decision,
             delivery_attempt, received_at, updated_at, activity_id)
          = (NEW.consumer_group, NEW.message_id, NEW.topic, NEW.reservation_id, NEW.order_id,
             NEW.status, NEW.decision, NEW.delivery_attempt, NEW.received_at, NEW.updated_at,
             NEW.activity_id)
        WHERE activity_id = OLD.activity_id AND consumer_group = OLD.consumer_group
          AND message_id = OLD.message_id;
    ELSE
        DELETE FROM consumer_inbox
        WHERE activity_id = OLD.activity_id AND consumer_group = OLD.consumer_group
          AND message_id = OLD.message_id;
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER mirror_claim BEFORE INSERT ON consumer_inbox
    FOR EACH ROW EXECUTE FUNCTION consumer_inbox_mirror();
CREATE TRIGGER mirror_change AFTER UPDATE OR DELETE ON consumer_inbox
    FOR EACH ROW EXECUTE FUNCTION consumer_inbox_mirror();
CREATE TRIGGER mirror_back AFTER INSERT OR UPDATE OR DELETE ON consumer_inbox_by_day
    FOR EACH ROW EXECUTE FUNCTION consumer_inbox_mirror();

CREATE FUNCTION event_outbox_mirror() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    IF pg_trigger_depth() > 1 THEN
        IF TG_WHEN = 'BEFORE' THEN
            RETURN NEW;
        END IF;
        RETURN NULL;
    END IF;
    IF TG_TABLE_NAME = 'event_outbox' THEN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO event_outbox_by_day SELECT NEW.*, seckill_id_at(NEW.event_id)
            ON CONFLICT DO NOTHING;
            IF FOUND THEN
                RETURN NEW;
            END IF;
            RETURN NULL;
        ELSIF TG_OP = 'UPDATE' THEN
            UPDATE event_outbox_by_day
            SET (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload,
                 deliver_at, status, attempts, next_attempt_at, broker_msg_id, last_error,
                 created_at, sent_at, dead_reason, auto_requeues, activity_id, delivery, id_at)
              = (NEW.event_id, NEW.topic, NEW.tag, NEW.message_key, NEW.aggregate_id,
                 NEW.aggregate_version, NEW.payload, NEW.deliver_at, NEW.status, NEW.attempts,
                 NEW.next_attempt_at, NEW.broker_msg_id, NEW.last_error, NEW.created_at,
                 NEW.sent_at, NEW.dead_reason, NEW.auto_requeues, NEW.activity_id, NEW.delivery,
                 seckill_id_at(NEW.event_id))
            WHERE activity_id = OLD.activity_id AND event_id = OLD.event_id
              AND id_at = seckill_id_at(OLD.event_id);
        ELSE
            DELETE FROM event_outbox_by_day
            WHERE activity_id = OLD.activity_id AND event_id = OLD.event_id
              AND id_at = seckill_id_at(OLD.event_id);
        END IF;
        RETURN NULL;
    END IF;
    IF TG_OP = 'INSERT' THEN
        INSERT INTO event_outbox
        VALUES (NEW.event_id, NEW.topic, NEW.tag, NEW.message_key, NEW.aggregate_id,
                NEW.aggregate_version, NEW.payload, NEW.deliver_at, NEW.status, NEW.attempts,
                NEW.next_attempt_at, NEW.broker_msg_id, NEW.last_error, NEW.created_at,
                NEW.sent_at, NEW.dead_reason, NEW.auto_requeues, NEW.activity_id, NEW.delivery)
        ON CONFLICT DO NOTHING;
    ELSIF TG_OP = 'UPDATE' THEN
        UPDATE event_outbox
        SET (event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload,
             deliver_at, status, attempts, next_attempt_at, broker_msg_id, last_error,
             created_at, sent_at, dead_reason, auto_requeues, activity_id, delivery)
          = (NEW.event_id, NEW.topic, NEW.tag, NEW.message_key, NEW.aggregate_id,
             NEW.aggregate_version, NEW.payload, NEW.deliver_at, NEW.status, NEW.attempts,
             NEW.next_attempt_at, NEW.broker_msg_id, NEW.last_error, NEW.created_at,
             NEW.sent_at, NEW.dead_reason, NEW.auto_requeues, NEW.activity_id, NEW.delivery)
        WHERE activity_id = OLD.activity_id AND event_id = OLD.event_id;
    ELSE
        DELETE FROM event_outbox WHERE activity_id = OLD.activity_id AND event_id = OLD.event_id;
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER mirror_claim BEFORE INSERT ON event_outbox
    FOR EACH ROW EXECUTE FUNCTION event_outbox_mirror();
CREATE TRIGGER mirror_change AFTER UPDATE OR DELETE ON event_outbox
    FOR EACH ROW EXECUTE FUNCTION event_outbox_mirror();
CREATE TRIGGER mirror_back AFTER INSERT OR UPDATE OR DELETE ON event_outbox_by_day
    FOR EACH ROW EXECUTE FUNCTION event_outbox_mirror();

-- Rows that differ between each old table and its by-day twin: 0 while the mirrors hold (and
-- before retention drops a day or an older release deletes rows). What an operator reads
-- before the contract step; make test-upgrade asserts it after a sale across the deploy.
CREATE FUNCTION seckill_twins_differ() RETURNS BIGINT LANGUAGE sql STABLE
SET search_path FROM CURRENT AS $$
    WITH i_old AS (
        SELECT consumer_group, message_id, topic, reservation_id, order_id, status, decision,
               delivery_attempt, received_at, updated_at, activity_id
        FROM consumer_inbox),
    i_new AS (
        SELECT consumer_group, message_id, topic, reservation_id, order_id, status, decision,
               delivery_attempt, received_at, updated_at, activity_id
        FROM consumer_inbox_by_day),
    o_old AS (
        SELECT event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload,
               deliver_at, status, attempts, next_attempt_at, broker_msg_id, last_error,
               created_at, sent_at, dead_reason, auto_requeues, activity_id, delivery
        FROM event_outbox),
    o_new AS (
        SELECT event_id, topic, tag, message_key, aggregate_id, aggregate_version, payload,
               deliver_at, status, attempts, next_attempt_at, broker_msg_id, last_error,
               created_at, sent_at, dead_reason, auto_requeues, activity_id, delivery
        FROM event_outbox_by_day)
    SELECT (SELECT count(*) FROM (TABLE i_old EXCEPT ALL TABLE i_new) a)
         + (SELECT count(*) FROM (TABLE i_new EXCEPT ALL TABLE i_old) b)
         + (SELECT count(*) FROM (TABLE o_old EXCEPT ALL TABLE o_new) c)
         + (SELECT count(*) FROM (TABLE o_new EXCEPT ALL TABLE o_old) d)
$$;
