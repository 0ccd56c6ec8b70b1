"""Retention into an S3-compatible bucket, over real HTTP with boto3, against moto's server running as a
process of its own (devkit.servers.MotoS3): archive, verify, remove, list, restore."""
from __future__ import annotations

import pytest

from devkit.servers import MotoS3
from ledger.archive import open_store
from ledger.retention import Retention, RetentionPolicy
from tests.support.retention import ledger_rows


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    server = MotoS3(tmp_path_factory.mktemp("moto") / "moto.log").start()
    server.create_bucket("ledger-archive")
    yield server
    server.stop()


@pytest.fixture
def s3_store(s3_server, monkeypatch):
    for name, value in s3_server.client_env.items():
        monkeypatch.setenv(name, value)
    return open_store("s3://ledger-archive/prod")


def test_retention_archives_to_a_bucket_and_restores_from_it(kit, settings, s3_store, mixed_ledger):
    leave = mixed_ledger["leave"]
    before = ledger_rows(kit, leave)
    runner = Retention(kit.pool("retention"), s3_store,
                       RetentionPolicy(processed_days=30, failed_days=60))

    report = runner.run()

    assert (report.status, report.removed) == ("done", len(leave)), report.error
    [key] = report.files
    assert [m.key for m in s3_store.manifests()] == [key]
    assert runner.verify(key).events == len(leave)
    assert all(not rows for rows in ledger_rows(kit, leave).values())
    assert runner.restore(key) == (len(leave), 0)
    assert ledger_rows(kit, leave) == before
