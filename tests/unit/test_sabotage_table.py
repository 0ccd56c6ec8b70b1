"""The sabotage table (devkit/sabotage.py) matches the tree: each sabotage's edits find exactly the one text
they replace, so that ``ops/sabotage`` breaks what its row says rather than stopping at a stale edit."""
from __future__ import annotations

from pathlib import Path

import pytest

from devkit.sabotage import SABOTAGES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sabotage", SABOTAGES, ids=lambda s: s.name)
def test_each_edit_finds_exactly_the_text_it_replaces(sabotage):
    for path, old, _ in sabotage.edits:
        assert (ROOT / path).read_text().count(old) == 1, f"{sabotage.name}: {path} no longer holds its text"
