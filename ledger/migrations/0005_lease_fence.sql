-- The apply transaction is pipelined: the worker sends its statements without
-- waiting for each answer and learns the outcome at COMMIT. So the statement that
-- marks an event processed cannot report "the lease is not ours" as an empty
-- result for the worker to check before committing; it raises instead, which
-- aborts the transaction before COMMIT runs. The worker maps this SQLSTATE to
-- LeaseLost.
CREATE OR REPLACE FUNCTION ledger.lease_not_held(event_id text) RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'the lease on event % is not held by this attempt', event_id
        USING ERRCODE = 'LL001';
END
$$;
