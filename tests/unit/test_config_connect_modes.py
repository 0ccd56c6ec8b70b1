"""The settings of issue 13's features: the Connect endpoint's secrets, the accepted modes, the Stripe API and
the periodic catch-up; each malformed value stops the process with one line naming the variable."""
from __future__ import annotations

import dataclasses

import pytest

from ledger.config import Settings
from ledger.errors import ConfigError


def test_defaults_are_no_connect_endpoint_both_modes_stripes_api_and_no_periodic_catch_up():
    settings = Settings.from_env({})

    assert settings.connect_webhook_secrets == ()
    assert settings.accept_livemode == "both"
    assert (settings.accepts_livemode(True), settings.accepts_livemode(False)) == (True, True)
    assert settings.stripe_api_base == "https://api.stripe.com"
    assert settings.stripe_api_key is None
    assert settings.catchup_interval_s == 0


def test_every_variable_is_read():
    settings = Settings.from_env({
        "STRIPE_CONNECT_WEBHOOK_SECRET": "whsec_connect_old_0123, whsec_connect_new_0123",
        "LEDGER_ACCEPT_LIVEMODE": "Live", "STRIPE_API_BASE": "http://127.0.0.1:12111",
        "STRIPE_API_KEY": "sk_test_123", "LEDGER_CATCHUP_INTERVAL_S": "300"})

    assert settings.connect_webhook_secrets == ("whsec_connect_old_0123", "whsec_connect_new_0123")
    assert settings.accept_livemode == "live"
    assert (settings.accepts_livemode(True), settings.accepts_livemode(False)) == (True, False)
    assert (settings.stripe_api_base, settings.stripe_api_key) == ("http://127.0.0.1:12111", "sk_test_123")
    assert settings.catchup_interval_s == 300


def test_a_test_only_deployment_refuses_live_events():
    settings = Settings.from_env({"LEDGER_ACCEPT_LIVEMODE": "test"})
    assert (settings.accepts_livemode(True), settings.accepts_livemode(False)) == (False, True)


@pytest.mark.parametrize("variable, value", [
    ("STRIPE_CONNECT_WEBHOOK_SECRET", "sk_live_not_a_webhook_secret"),
    ("LEDGER_ACCEPT_LIVEMODE", "production"),
    ("STRIPE_API_BASE", "ftp://api.stripe.com"),
    ("LEDGER_CATCHUP_INTERVAL_S", "-1"),
    ("LEDGER_CATCHUP_INTERVAL_S", "hourly"),
])
def test_a_malformed_value_raises_one_line_naming_the_variable(variable, value):
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({variable: value})
    message = str(raised.value)
    assert variable in message and "\n" not in message
    assert "sk_live_not_a_webhook_secret" not in message


def test_settings_built_in_code_refuse_an_unknown_mode_too():
    with pytest.raises(ConfigError, match="LEDGER_ACCEPT_LIVEMODE"):
        dataclasses.replace(Settings(), accept_livemode="prod")
