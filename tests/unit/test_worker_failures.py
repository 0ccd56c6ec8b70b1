"""workers/failures.classify: where an attempt's failure is caught, it is named recoverable or permanent."""
from __future__ import annotations

import psycopg
import psycopg.errors as pge
import pytest
from psycopg_pool import PoolTimeout

from workers.failures import Kind, PermanentError, TransientError, UnmappablePayload, classify


@pytest.mark.parametrize("exc_class, sqlstate, reason", [
    (pge.SerializationFailure, "40001", "db_conflict"),
    (pge.DeadlockDetected, "40P01", "db_conflict"),
    (pge.LockNotAvailable, "55P03", "db_lock_timeout"),
    (pge.QueryCanceled, "57014", "db_timeout"),
    (pge.AdminShutdown, "57P01", "db_shutdown"),
    (pge.CrashShutdown, "57P02", "db_shutdown"),
    (pge.CannotConnectNow, "57P03", "db_shutdown"),
    (pge.ConnectionFailure, "08006", "db_connection"),
    (pge.InsufficientResources, "53000", "db_resources"),
    (pge.TooManyConnections, "53300", "db_resources"),
])
def test_postgres_errors_a_later_attempt_can_get_past_are_recoverable(exc_class, sqlstate, reason):
    exc = exc_class("server said no")
    assert exc.sqlstate == sqlstate
    failure = classify(exc)
    assert failure.kind is Kind.RECOVERABLE
    assert failure.reason == reason
    assert failure.error_class == exc_class.__name__
    assert f"SQLSTATE {sqlstate}" in failure.message


@pytest.mark.parametrize("exc_class, reason", [
    (pge.UniqueViolation, "constraint_violation"),
    (pge.NotNullViolation, "constraint_violation"),
    (pge.CheckViolation, "constraint_violation"),
    (pge.InvalidTextRepresentation, "invalid_data"),
    (pge.NumericValueOutOfRange, "invalid_data"),
])
def test_postgres_errors_retrying_cannot_fix_are_permanent(exc_class, reason):
    failure = classify(exc_class("bad row"))
    assert failure.kind is Kind.PERMANENT
    assert failure.reason == reason


def test_a_query_canceled_is_a_timeout_not_a_shutdown():
    # 57014 and 57P* share the class "57": the longest matching prefix decides.
    assert classify(pge.QueryCanceled()).reason == "db_timeout"
    assert classify(pge.AdminShutdown()).reason == "db_shutdown"


def test_a_lost_connection_without_sqlstate_is_a_recoverable_connection_failure():
    failure = classify(psycopg.OperationalError("server closed the connection unexpectedly"))
    assert failure.kind is Kind.RECOVERABLE
    assert failure.reason == "db_connection"


def test_an_unrecognised_postgres_error_is_recoverable_db_error():
    failure = classify(pge.UndefinedTable("relation does not exist"))
    assert failure.kind is Kind.RECOVERABLE
    assert failure.reason == "db_error"


def test_a_handler_transient_error_is_recoverable():
    failure = classify(TransientError("upstream busy"))
    assert (failure.kind, failure.reason, failure.error_class) == (Kind.RECOVERABLE, "transient", "TransientError")
    assert failure.message == "upstream busy"


def test_a_handler_permanent_error_is_permanent_rejected_by_handler():
    failure = classify(PermanentError("cannot ever work"))
    assert (failure.kind, failure.reason, failure.error_class) == (Kind.PERMANENT, "rejected_by_handler", "PermanentError")


def test_an_unmappable_payload_is_permanent_and_names_the_field():
    exc = UnmappablePayload("data.object.status")
    assert exc.field == "data.object.status"
    failure = classify(exc)
    assert (failure.kind, failure.reason, failure.error_class) == (Kind.PERMANENT, "unmappable_payload", "UnmappablePayload")
    assert "data.object.status" in failure.message


@pytest.mark.parametrize("exc", [ConnectionError("reset by peer"), ConnectionRefusedError("refused"),
                                 TimeoutError("timed out"), OSError("network unreachable")])
def test_network_errors_are_recoverable(exc):
    failure = classify(exc)
    assert (failure.kind, failure.reason) == (Kind.RECOVERABLE, "network")


def test_broker_errors_are_recoverable_network_errors():
    import kombu.exceptions
    import redis.exceptions

    assert classify(kombu.exceptions.OperationalError("broker down")).reason == "network"
    assert classify(redis.exceptions.ConnectionError("redis down")).reason == "network"


def test_a_pool_timeout_is_db_unavailable():
    failure = classify(PoolTimeout("couldn't get a connection"))
    assert (failure.kind, failure.reason) == (Kind.RECOVERABLE, "db_unavailable")


def test_a_soft_time_limit_is_recoverable_time_limit():
    from celery.exceptions import SoftTimeLimitExceeded

    failure = classify(SoftTimeLimitExceeded())
    assert (failure.kind, failure.reason) == (Kind.RECOVERABLE, "time_limit")


def test_an_unexpected_exception_is_recoverable_so_retries_stay_bounded_rather_than_giving_up():
    failure = classify(KeyError("items"))
    assert (failure.kind, failure.reason, failure.error_class) == (Kind.RECOVERABLE, "unexpected_error", "KeyError")


def test_long_messages_are_truncated():
    assert len(classify(ValueError("x" * 5000)).message) <= 500


def test_a_value_postgres_cannot_store_is_a_permanent_invalid_data_failure():
    import psycopg

    from workers.failures import Kind, classify

    failure = classify(psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"))
    assert (failure.kind, failure.reason) == (Kind.PERMANENT, "invalid_data")
