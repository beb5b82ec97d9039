-- Compensation tasks still PENDING, by age: the relay looks for releases a dead broker holds
-- (docs/ARCHITECTURE.md#a-dead-brokers-messages). Only tasks in flight are PENDING, so the
-- index stays small.
CREATE INDEX compensation_tasks_pending ON compensation_tasks (created_at) WHERE status = 'PENDING';
