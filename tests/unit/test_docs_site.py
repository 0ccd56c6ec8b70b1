"""The documentation: README short, every link in it and in docs/ resolving (mkdocs' strict build)."""
from __future__ import annotations

import re
import subprocess
import sys

from devkit.procs import REPO

README = REPO / "README.md"


def test_the_docs_site_builds_strictly_so_no_link_or_anchor_in_docs_is_broken(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stdout + built.stderr


def test_readme_is_short_and_every_relative_link_in_it_resolves():
    text = README.read_text()
    assert len(text.splitlines()) < 300
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]
    assert targets, "README links to its documentation pages"
    missing = [t for t in targets if not (REPO / t.split("#", 1)[0]).exists()]
    assert missing == []
