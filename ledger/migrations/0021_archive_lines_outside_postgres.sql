-- Archive lines are built outside Postgres now (ledger/archive_lines.py: the same lines, byte for
-- byte), and a removal compares versions of rows instead of lines: nothing calls the SQL that built
-- them any more, and a second definition of a line is one too many.
DROP FUNCTION IF EXISTS ledger.event_archive_lines(text[], timestamptz, timestamptz);
