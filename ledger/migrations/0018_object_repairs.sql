-- Who repaired which object's rows (`ledgerctl reproject --object/--customer`, the console's object
-- page: workers/object_repair.py), and what each row was before and became: billing's rows rewritten
-- from the ledger's events of one object or customer, outside any rebuild. Kept like the audit of
-- replays: a repair is an operator's act on billing, and the only trace of what a row held before.
CREATE TABLE IF NOT EXISTS ledger.object_repairs (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope     text        NOT NULL CHECK (scope IN ('object', 'customer')),
    object_id text        NOT NULL,
    actor     text        NOT NULL,
    counts    jsonb       NOT NULL,
    changes   jsonb       NOT NULL,
    at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS object_repairs_object_idx ON ledger.object_repairs (object_id, at);
