"""What ledgerctl prints when Postgres stops a command: unreachable is one thing, a statement Postgres
refused (and rolled back) another, named by class and SQLSTATE only."""
import psycopg
import pytest
from psycopg import errors
from psycopg_pool import PoolTimeout

from ops.cli import _database_error


@pytest.mark.parametrize("exc", [psycopg.OperationalError("connection refused"), PoolTimeout("no connection"),
                                 errors.AdminShutdown("terminating connection")])
def test_a_database_that_cannot_be_reached_is_called_unreachable(exc):
    assert _database_error(exc).startswith("the ledger database is unreachable")


@pytest.mark.parametrize("exc, sqlstate", [(errors.DeadlockDetected("deadlock detected"), "40P01"),
                                           (errors.LockNotAvailable("lock timeout"), "55P03"),
                                           (errors.SerializationFailure("could not serialize"), "40001")])
def test_a_statement_stopped_by_concurrent_work_is_named_and_said_to_be_rolled_back(exc, sqlstate):
    said = _database_error(exc)
    assert "unreachable" not in said
    assert f"{type(exc).__name__}, SQLSTATE {sqlstate}" in said and "run the command again" in said


def test_another_refusal_names_its_class_and_sqlstate_and_nothing_of_its_message():
    said = _database_error(errors.DiskFull("could not extend file with row (evt_secret)"))
    assert said == "the ledger database refused a statement (DiskFull, SQLSTATE 53100)"
