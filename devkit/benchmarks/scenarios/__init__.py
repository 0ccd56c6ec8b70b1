"""The scenarios of ops/bench, one module each, listed in runner.SCENARIOS."""
