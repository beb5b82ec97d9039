-- Audit rows outlive the dead letters they describe: retention deletes settled dead letters,
-- never their audit trail.
ALTER TABLE dlq_audit DROP CONSTRAINT dlq_audit_dlq_id_fkey;
CREATE INDEX dlq_audit_dlq_id ON dlq_audit (dlq_id);
