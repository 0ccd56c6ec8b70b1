"""ops/bench all --quick, cut smaller: every standard scenario's code path runs against the real stack
(private Postgres and Redis, gunicorn, celery, wrk, pgbench) and ends without an error.

Figures are not judged here (docs/benchmarks.md holds them); only that each scenario ran to its end,
wrote its figures, and counted no failed delivery or event. profile (py-spy, the bench extra) and the
long scenarios (rescue, retention, reproject: minutes each) are run by hand: docs/benchmarks.md.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from devkit.benchmarks import runner
from devkit.procs import REPO

pytestmark = pytest.mark.skipif(not shutil.which("wrk") or not shutil.which("redis-server"),
                                reason="ops/bench needs wrk and redis-server")

# The drain's backlog outlasts its warm-up and window at any worker's rate here (an emptied backlog measures 0).
SMALL = ["--levels", "8", "--workers", "1", "--steady-levels", "8", "--steady-events", "200",
         "--history-events", "20000", "--drain-events", "4000", "--drain-seconds", "2", "--ingest-seconds", "1",
         "--receiver-cost-requests", "300", "--no-peer", "--no-docs"]


@pytest.mark.timeout(900)
def test_every_standard_scenario_runs_to_its_end_without_an_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "devkit.benchmarks", "all", "--quick", *SMALL, "--out", str(tmp_path)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=880)
    assert done.returncode == 0, done.stderr[-4000:] + "\n--- stdout ---\n" + done.stdout[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(runner.ALL) <= set(results), sorted(results)
    summaries = results["summaries"]
    for name in runner.ALL:
        assert f"SUMMARY {name} " in done.stdout, name
        assert "errors=0" in summaries[name] or "errors=" not in summaries[name], (name, summaries[name])
    assert all(level["errors"] == 0 for level in results["ingest"]["levels"])
    assert all(run["processed"] > 0 for run in [*results["drain"]["runs"], results["drain"]["readme"]])
    assert results["steady"]["revisions"][0]["runs"][0]["processed"] == 200
    assert results["scale"]["history"]["events"] == 20000 and results["cost"]["worker"]["statements_per_event"] > 0
    assert results["burst"]["errors"] == 0 and results["replay"]["replayed"] == results["replay"]["events"]
