"""Versioned schema migrations, ``NNNN_name.sql``, applied by ledger.migrate.

An applied migration is never edited (its checksum is recorded), so where a later
migration repeats the shape of an earlier table (0004's outbox after 0001's events)
the repetition stays.
"""
