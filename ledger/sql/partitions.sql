-- The ledger's time partitions (migration 0012; docs/retention.md, "Partitions").

-- name: partitions_ensure
-- Sweep: this month's partitions and the next `ahead` months', where missing (the function
-- takes its own advisory lock and a one-second lock timeout); the events partitions made.
SELECT ledger.partitions_ensure(%(ahead)s::integer) AS name

-- name: partitions_health
-- Metrics, ledgerctl partitions: whether the ledger is partitioned, how many months after the
-- current one have their partitions, and the events outside every planned month.
SELECT ledger.is_partitioned() AS partitioned,
       (SELECT count(*) FROM ledger.event_partitions() p
         WHERE p.starts >= date_trunc('month', now()) + interval '1 month') AS months_ahead,
       ledger.partition_strays() AS strays

-- name: partitions_list
-- ledgerctl partitions: every partition of ledger.events, oldest first, with its range.
SELECT name, starts, ends, is_default FROM ledger.event_partitions()
