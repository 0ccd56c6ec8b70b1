"""What every layer of the tests agrees on: the webhook secret, and where the Stripe fixture corpus lives."""
from __future__ import annotations

from pathlib import Path

# STRIPE_WEBHOOK_SECRET of every receiver the tests build or start.
WEBHOOK_SECRET = "whsec_test_primary_0123456789"

# Real Stripe payloads, next to the checkout (../shared/stripe-fixtures); tests that need them skip without.
FIXTURES_DIR = Path(__file__).resolve().parents[3] / "shared" / "stripe-fixtures"


def fixture_files() -> list[Path]:
    """The corpus' event files, in name order (none where the corpus is absent)."""
    return sorted(FIXTURES_DIR.glob("*.json")) if FIXTURES_DIR.is_dir() else []
