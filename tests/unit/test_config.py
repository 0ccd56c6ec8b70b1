"""Settings are validated at start-up: a bad value stops the process with one line
that names the variable and never echoes a secret. (The real receiver refusing to start without a
secret: tests/e2e/test_receiver_process.py.)"""
from __future__ import annotations

import logging

import pytest

import ledger.logs
from ledger.config import Settings
from ledger.errors import ConfigError

GOOD = {"DATABASE_URL": "postgresql://ledger:pg-password-123@127.0.0.1:5432/ledger",
        "CELERY_BROKER_URL": "redis://:broker-password-456@127.0.0.1:6379/0",
        "STRIPE_WEBHOOK_SECRET": "whsec_live_secret_value_789"}
SECRET_VALUES = ("pg-password-123", "broker-password-456", "whsec_live_secret_value_789",
                 "mysql-password-000", "sk_live_leaked_111", "amqp-password-222")


def test_from_env_reads_every_variable_of_a_good_environment():
    settings = Settings.from_env({**GOOD, "STRIPE_WEBHOOK_SECRET": "whsec_old_0123456789,whsec_new_0123456789",
                                  "STRIPE_SIGNATURE_TOLERANCE_S": "60", "INGEST_MAX_BODY_BYTES": "4096",
                                  "LEDGER_QUEUE": "my-events"})

    assert settings.database_url == GOOD["DATABASE_URL"]
    assert settings.broker_url == GOOD["CELERY_BROKER_URL"]
    assert settings.webhook_secrets == ("whsec_old_0123456789", "whsec_new_0123456789")
    assert (settings.signature_tolerance_s, settings.max_body_bytes, settings.queue_name) == (60, 4096, "my-events")


@pytest.mark.parametrize("raw, expected", [(None, False), ("true", True), ("1", True), ("off", False)])
def test_task_events_are_off_unless_asked_for_and_reach_the_celery_app(raw, expected):
    from workers.app import make_celery

    settings = Settings.from_env({**GOOD, **({"LEDGER_TASK_EVENTS": raw} if raw is not None else {})})

    assert settings.task_events is expected
    assert make_celery(settings).conf.worker_send_task_events is expected


def test_settings_repr_does_not_show_the_stripe_api_key():
    settings = Settings.from_env({**GOOD, "STRIPE_API_KEY": "sk_live_leaked_111"})

    assert "sk_live_leaked_111" not in repr(settings)


BAD = {
    "DATABASE_URL with a mysql scheme": ("DATABASE_URL", "mysql://root:mysql-password-000@db/ledger"),
    "DATABASE_URL without a scheme": ("DATABASE_URL", "127.0.0.1:5432/ledger"),
    "CELERY_BROKER_URL with an http scheme": ("CELERY_BROKER_URL", "http://user:amqp-password-222@broker:15672/"),
    "CELERY_BROKER_URL a bare host": ("CELERY_BROKER_URL", "localhost"),
    "STRIPE_WEBHOOK_SECRET entry that is an API key": ("STRIPE_WEBHOOK_SECRET",
                                                       "whsec_live_secret_value_789,sk_live_leaked_111"),
    "STRIPE_WEBHOOK_SECRET entry too short": ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
    "STRIPE_SIGNATURE_TOLERANCE_S not an integer": ("STRIPE_SIGNATURE_TOLERANCE_S", "five minutes"),
    "STRIPE_SIGNATURE_TOLERANCE_S a decimal": ("STRIPE_SIGNATURE_TOLERANCE_S", "300.5"),
    "STRIPE_SIGNATURE_TOLERANCE_S zero": ("STRIPE_SIGNATURE_TOLERANCE_S", "0"),
    "INGEST_MAX_BODY_BYTES not an integer": ("INGEST_MAX_BODY_BYTES", "1MiB"),
    "DB_POOL_TIMEOUT_S not a number": ("DB_POOL_TIMEOUT_S", "soon"),
    "LEDGER_TASK_EVENTS not a boolean": ("LEDGER_TASK_EVENTS", "sometimes"),
    "STRIPE_THIN_WEBHOOK_SECRET entry that is an API key": ("STRIPE_THIN_WEBHOOK_SECRET",
                                                            "whsec_live_secret_value_789,sk_live_leaked_111"),
    "STRIPE_THIN_WEBHOOK_SECRET entry too short": ("STRIPE_THIN_WEBHOOK_SECRET", "whsec_x"),
    "STRIPE_FETCH_TIMEOUT_S not a number": ("STRIPE_FETCH_TIMEOUT_S", "ten seconds"),
    "STRIPE_FETCH_TIMEOUT_S zero": ("STRIPE_FETCH_TIMEOUT_S", "0"),
    "STRIPE_FETCH_TIMEOUT_S below 0.1 s": ("STRIPE_FETCH_TIMEOUT_S", "0.05"),
    "STRIPE_FETCH_TIMEOUT_S not a finite number": ("STRIPE_FETCH_TIMEOUT_S", "nan"),
    "STRIPE_FETCH_CONCURRENCY zero": ("STRIPE_FETCH_CONCURRENCY", "0"),
    "STRIPE_FETCH_CONCURRENCY not an integer": ("STRIPE_FETCH_CONCURRENCY", "eight"),
    "LEDGER_RETRY_CAP_S infinite": ("LEDGER_RETRY_CAP_S", "inf"),
    "LEDGER_RETENTION_MAX_RATE negative": ("LEDGER_RETENTION_MAX_RATE", "-1"),
    "LEDGER_RETENTION_BUILDERS zero": ("LEDGER_RETENTION_BUILDERS", "0"),
    "LEDGER_RETENTION_NICE above 19": ("LEDGER_RETENTION_NICE", "20"),
    "LEDGER_RETENTION_NICE not an integer": ("LEDGER_RETENTION_NICE", "low"),
}


def test_a_retention_runs_budget_is_read_from_its_three_variables():
    from ledger.config import RetentionBudget

    assert Settings.from_env(GOOD).retention_budget() == RetentionBudget()
    budget = Settings.from_env({**GOOD, "LEDGER_RETENTION_MAX_RATE": "0", "LEDGER_RETENTION_BUILDERS": "3",
                                "LEDGER_RETENTION_NICE": "19"}).retention_budget()
    assert budget == RetentionBudget(max_rate=0.0, builders=3, nice=19)


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_malformed_value_raises_one_line_naming_the_variable_without_echoing_secrets(case):
    variable, value = BAD[case]

    with pytest.raises(ConfigError) as raised:
        Settings.from_env({**GOOD, variable: value})

    message = str(raised.value)
    assert variable in message
    assert "\n" not in message
    for secret in SECRET_VALUES:
        assert secret not in message


# -- the thin endpoint's secrets and the workers' fetch timeout --

def test_without_thin_variables_there_is_no_thin_endpoint_and_a_fetch_waits_ten_seconds():
    settings = Settings.from_env(GOOD)

    assert settings.thin_webhook_secrets == ()
    assert settings.stripe_fetch_timeout_s == 10.0
    assert settings.stripe_fetch_concurrency == 8


def test_from_env_reads_each_thin_destinations_secret_and_the_fetch_timeout():
    settings = Settings.from_env({**GOOD, "STRIPE_THIN_WEBHOOK_SECRET": " whsec_thin_one_0123, whsec_thin_two_4567,",
                                  "STRIPE_FETCH_TIMEOUT_S": "2.5", "STRIPE_FETCH_CONCURRENCY": "3"})

    assert settings.thin_webhook_secrets == ("whsec_thin_one_0123", "whsec_thin_two_4567")
    assert settings.webhook_secrets == (GOOD["STRIPE_WEBHOOK_SECRET"],)  # each endpoint its own list
    assert settings.stripe_fetch_timeout_s == 2.5
    assert settings.stripe_fetch_concurrency == 3


def test_a_malformed_thin_secret_is_named_by_its_variable_and_entry_and_never_echoed():
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({**GOOD, "STRIPE_THIN_WEBHOOK_SECRET": "whsec_thin_one_0123,sk_live_leaked_111"})

    assert str(raised.value) == "STRIPE_THIN_WEBHOOK_SECRET entry 2 is malformed: each entry must start with 'whsec_'"


def test_a_receiver_of_thin_events_only_needs_no_snapshot_secret():
    thin_only = Settings.from_env({"STRIPE_THIN_WEBHOOK_SECRET": "whsec_thin_one_0123"})

    # No snapshot secrets: its /webhooks/stripe answers 404 (tests/integration/test_receiver_thin.py).
    assert thin_only.require_webhook_secrets() == ()


def test_a_receiver_with_neither_secret_is_refused_saying_what_to_set():
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({"STRIPE_CONNECT_WEBHOOK_SECRET": "whsec_connect_0123"}).require_webhook_secrets()

    assert str(raised.value) == ("STRIPE_WEBHOOK_SECRET is not set: the receiver cannot verify signatures "
                                 "(a receiver of thin events only sets STRIPE_THIN_WEBHOOK_SECRET instead)")


@pytest.mark.parametrize("variable", ["DATABASE_URL", "CELERY_BROKER_URL"])
def test_an_unparsable_url_raises_a_config_error_naming_the_variable(variable):
    with pytest.raises(ConfigError, match=variable) as raised:
        Settings.from_env({**GOOD, variable: "postgresql://ledger:pg-password-123@[127.0.0.1/ledger"})
    assert "pg-password-123" not in str(raised.value)


@pytest.fixture
def isolated_logging(monkeypatch):
    """create_app() without settings configures JSON logging on the root logger: undo it after the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setattr(ledger.logs, "_configured", False)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _exit_lines(exit: SystemExit, capsys) -> list[str]:
    """What a person sees when the process exits: the SystemExit message or what was printed."""
    assert exit.code not in (0, None)
    shown = (exit.code if isinstance(exit.code, str) else "") + capsys.readouterr().err
    return shown.strip().splitlines()


def test_create_app_without_settings_and_without_a_secret_exits_with_one_clear_line(
        monkeypatch, capsys, isolated_logging):
    from ingest.app import create_app

    monkeypatch.setenv("DATABASE_URL", GOOD["DATABASE_URL"])
    monkeypatch.setenv("CELERY_BROKER_URL", GOOD["CELERY_BROKER_URL"])
    monkeypatch.delenv("STRIPE_WEBHOOK_SECRET", raising=False)

    with pytest.raises(SystemExit) as exited:
        create_app()

    assert _exit_lines(exited.value, capsys) == [
        "configuration error: STRIPE_WEBHOOK_SECRET is not set: the receiver cannot verify signatures "
        "(a receiver of thin events only sets STRIPE_THIN_WEBHOOK_SECRET instead)"]


def test_create_app_without_settings_and_a_malformed_secret_exits_without_echoing_it(
        monkeypatch, capsys, isolated_logging):
    from ingest.app import create_app

    monkeypatch.setenv("DATABASE_URL", GOOD["DATABASE_URL"])
    monkeypatch.setenv("CELERY_BROKER_URL", GOOD["CELERY_BROKER_URL"])
    monkeypatch.setenv("STRIPE_WEBHOOK_SECRET", "sk_live_leaked_111")

    with pytest.raises(SystemExit) as exited:
        create_app()

    assert _exit_lines(exited.value, capsys) == [
        "configuration error: STRIPE_WEBHOOK_SECRET entry 1 is malformed: each entry must start with 'whsec_'"]


def test_create_app_with_explicit_settings_but_no_secret_refuses_to_build_a_receiver():
    from ingest.app import create_app

    with pytest.raises(ConfigError, match="STRIPE_WEBHOOK_SECRET"):
        create_app(Settings(database_url=GOOD["DATABASE_URL"], broker_url=GOOD["CELERY_BROKER_URL"]))
