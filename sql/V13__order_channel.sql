-- The buyer's sales channel (app, web, mini_program, ...) on the order, from an
-- ORDER_CREATE_REQUESTED v2 message (docs/ARCHITECTURE.md#upgrades). An expand step: the column
-- is nullable, a v1 message leaves it empty and a release that does not know it never reads it.
ALTER TABLE orders ADD COLUMN channel TEXT;
