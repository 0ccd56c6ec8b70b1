"""The archive: where events go before they leave the ledger (docs/retention.md).

A store is a directory or an S3-compatible bucket, named by LEDGER_ARCHIVE_URL
(``file:///var/lib/ledger-archive``, a bare absolute path, or ``s3://bucket/prefix``; the
bucket's endpoint and credentials are boto3's own settings: AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...). Each archive file holds one month of events (of Stripe's
``created``) that one retention run archived: gzip-compressed JSON lines, one event per
line with every row that names it (ledger/archive_lines.py), and beside it a manifest
with the file's SHA-256, its size and its number of events. A file is written whole before
its manifest, and a manifest is what makes a file count: a run that died half-way leaves a
file without one, which nothing reads.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

from isal import igzip

from ledger.errors import ConfigError

FORMAT = "stripe-ledger-archive/1"
MANIFEST_SUFFIX = ".manifest.json"
_KEY = re.compile(r"^events/[0-9]{4}-[0-9]{2}/run-[0-9]{8}\.jsonl\.gz$")


def file_key(month, run_id: int) -> str:
    """Where a run's file of one month goes: one file per month and run."""
    return f"events/{month:%Y-%m}/run-{run_id:08d}.jsonl.gz"


def archive_key_is_valid(key: str) -> bool:
    """A key as file_key makes it: the only ones read back from a store (never a path of the caller's)."""
    return bool(_KEY.match(key))


class ArchiveError(Exception):
    """The archive is unreachable, or a file does not match its manifest."""


@dataclass(frozen=True)
class Manifest:
    key: str
    month: str          # YYYY-MM, of Stripe's `created`
    run_id: int
    events: int
    bytes: int
    sha256: str
    first_event: str | None
    last_event: str | None
    format: str = FORMAT

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Manifest":
        try:
            data = json.loads(raw)
            if data.get("format") != FORMAT:
                raise ValueError(f"unknown format {data.get('format')!r}")
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise ArchiveError(f"unreadable manifest: {exc}") from None


class ArchiveStore:
    """put / get / list by key; a key is a relative path (``events/2026-01/run-000004.jsonl.gz``)."""

    url: str

    def put(self, key: str, source: Path) -> None:
        raise NotImplementedError

    def get(self, key: str, target: Path) -> None:
        raise NotImplementedError

    def keys(self, prefix: str) -> list[str]:
        raise NotImplementedError

    def manifests(self) -> list[Manifest]:
        found = []
        for key in self.keys("events/"):
            file = key[:-len(MANIFEST_SUFFIX)]
            if key.endswith(MANIFEST_SUFFIX) and archive_key_is_valid(file):  # anything else is not ours
                found.append(self.manifest(file))
        return sorted(found, key=lambda m: (m.month, m.key))

    def manifest(self, key: str) -> Manifest:
        if not archive_key_is_valid(key):
            raise ArchiveError(f"{key!r} is not an archive file's key")
        with tempfile.TemporaryDirectory(prefix="ledger-archive-") as tmp:
            path = Path(tmp) / "manifest.json"
            self.get(key + MANIFEST_SUFFIX, path)
            return Manifest.from_json(path.read_bytes())


class DirectoryStore(ArchiveStore):
    def __init__(self, root: Path):
        self.root = root
        self.url = f"file://{root}"

    def put(self, key: str, source: Path) -> None:
        target = self.root / key
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            shutil.copyfile(source, partial)
            with open(partial, "rb") as f:
                os.fsync(f.fileno())
            os.replace(partial, target)  # whole or not at all
        except OSError as exc:
            raise ArchiveError(f"cannot write {key} to {self.url}: {exc.strerror or exc}") from None

    def get(self, key: str, target: Path) -> None:
        try:
            shutil.copyfile(self.root / key, target)
        except OSError as exc:
            raise ArchiveError(f"cannot read {key} from {self.url}: {exc.strerror or exc}") from None

    def keys(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file()
                      and not p.name.endswith(".partial"))


class S3Store(ArchiveStore):
    def __init__(self, bucket: str, prefix: str):
        import boto3
        from botocore.config import Config

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = boto3.client("s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, source: Path) -> None:
        try:
            self._client.upload_file(str(source), self.bucket, self._key(key))
        except Exception as exc:  # botocore's errors and the network's: the run fails, nothing was removed
            raise ArchiveError(f"cannot write {key} to {self.url}: {type(exc).__name__}: {exc}") from None

    def get(self, key: str, target: Path) -> None:
        try:
            self._client.download_file(self.bucket, self._key(key), str(target))
        except Exception as exc:
            raise ArchiveError(f"cannot read {key} from {self.url}: {type(exc).__name__}: {exc}") from None

    def keys(self, prefix: str) -> list[str]:
        found = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                          Prefix=self._key(prefix))
            for page in pages:
                for item in page.get("Contents", []):
                    found.append(item["Key"][len(self.prefix) + 1:] if self.prefix else item["Key"])
        except Exception as exc:
            raise ArchiveError(f"cannot list {self.url}: {type(exc).__name__}: {exc}") from None
        return sorted(found)


def open_store(url: str) -> ArchiveStore:
    """The store LEDGER_ARCHIVE_URL names; ConfigError for one it cannot name."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ConfigError("LEDGER_ARCHIVE_URL s3://bucket[/prefix] needs a bucket")
        return S3Store(parts.netloc, parts.path)
    if parts.scheme in ("", "file"):
        path = Path(parts.path if parts.scheme == "file" else url)
        if not path.is_absolute():
            raise ConfigError("LEDGER_ARCHIVE_URL must be an absolute path, file:///path or s3://bucket/prefix")
        return DirectoryStore(path)
    raise ConfigError(f"LEDGER_ARCHIVE_URL: scheme {parts.scheme!r} is not file or s3")


@dataclass
class Chunk:
    """Lines of one file, compressed as a gzip member of their own (a gzip file is a sequence of members,
    read as one stream), and each line's event id and version (ledger/archive_lines.py): made where the
    lines are built, so compressing runs beside Postgres and beside the other builders."""
    data: bytes
    versions: list[tuple[str, str]]

    @classmethod
    def of(cls, lines: list[tuple[str, str, str]]) -> "Chunk":
        """From (event id, line, version) triples. ISA-L's gzip: the same format as zlib's, written in a
        sixth of the CPU (what a builder spends most on after the lines themselves)."""
        text = "\n".join(line for _, line, _ in lines) + "\n"
        data = igzip.compress(text.encode(), compresslevel=1, mtime=0)
        return cls(data, [(event_id, version) for event_id, _, version in lines])


class ArchiveWriter:
    """One archive file being written, chunk by chunk; ``close()`` ends it. Each line's event id and
    version go, in order, to a file beside it (``versions()``): what the removal compares with the
    ledger's rows. On disk, not in memory: a month can hold millions of events."""

    def __init__(self, directory: Path, name: str):
        self.path = directory / f"{name}.jsonl.gz"
        self._versions_path = directory / f"{name}.versions"
        self._raw = open(self.path, "wb")
        self._versions = open(self._versions_path, "w")
        self.events = 0
        self.first_event: str | None = None
        self.last_event: str | None = None

    def append(self, chunk: Chunk) -> None:
        if not chunk.versions:
            return
        self._raw.write(chunk.data)
        self._versions.writelines(f"{event_id}\t{version}\n" for event_id, version in chunk.versions)
        self.events += len(chunk.versions)
        self.first_event = self.first_event or chunk.versions[0][0]
        self.last_event = chunk.versions[-1][0]

    def close(self) -> None:
        self._raw.close()
        self._versions.close()

    def versions(self) -> Iterator[tuple[str, str]]:
        """(event id, version of its line), in the file's order."""
        with open(self._versions_path) as f:
            for row in f:
                event_id, _, version = row.rstrip("\n").partition("\t")
                yield event_id, version


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_lines(path: Path) -> Iterator[str]:
    """An archive file's lines, as written."""
    with gzip.open(path, "rb") as f:
        for raw in f:
            yield raw.rstrip(b"\n").decode()


def fetch_verified(store: ArchiveStore, manifest: Manifest, target: Path) -> None:
    """Read a file back from the store into ``target`` and check it against its manifest: its size and
    SHA-256 (the writer's, of the bytes it wrote: equal, the file holds exactly the lines written), and
    that it decompresses whole to as many lines as the manifest counts. ArchiveError on any difference."""
    store.get(manifest.key, target)
    size = target.stat().st_size
    if size != manifest.bytes or sha256_of(target) != manifest.sha256:
        raise ArchiveError(f"{manifest.key}: the file read back does not match its manifest's checksum")
    try:
        with gzip.open(target, "rb") as f:
            count = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise ArchiveError(f"{manifest.key}: unreadable: {exc}") from None
    if count != manifest.events:
        raise ArchiveError(f"{manifest.key}: {count} events read back, the manifest says {manifest.events}")
