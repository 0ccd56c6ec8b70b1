"""Hosts on one machine: Linux network namespaces joined by a bridge, for tests of several hosts.

``Network`` makes a bridge (``<prefix>-br``, 10.77.N.1/24: the database-and-broker host, the root
namespace) and, per host, a namespace with its own loopback and a veth pair into the bridge
(10.77.N.2, .3, ...). Every packet between two hosts crosses the bridge, so ``cut(host)`` (the
host's end of the link set down) partitions that host from all others, and ``mend(host)`` joins it
again. ``run(host, cmd)`` is the command prefixed to run in that host's namespace. Needs root and
``ip`` (iproute2); ``available()`` says whether namespaces can be made here.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


class Network:
    def __init__(self, hosts: list[str], *, subnet: int | None = None):
        self.tag = secrets.token_hex(2)
        self.subnet = subnet if subnet is not None else 100 + int(self.tag, 16) % 150
        self.bridge = f"lb{self.tag}"
        self.hosts = list(hosts)
        self.addresses = {host: f"10.77.{self.subnet}.{n}" for n, host in enumerate(self.hosts, start=2)}
        self.gateway = f"10.77.{self.subnet}.1"
        self._made: list[str] = []

    @staticmethod
    def available() -> str | None:
        """None when namespaces can be made here; else why not."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "the ip command (iproute2) is missing"
        probe = f"lbprobe{secrets.token_hex(2)}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return None

    def namespace(self, host: str) -> str:
        return f"{self.bridge}-{host}"

    def _veth(self, host: str) -> str:
        return f"v{self.tag}{self.hosts.index(host)}"

    def create(self) -> "Network":
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            ns, veth = self.namespace(host), self._veth(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}h")
            _ip("link", "set", f"{veth}h", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[host]}/24", "dev", f"{veth}h")
            _ip("-n", ns, "link", "set", f"{veth}h", "up")
        return self

    def run(self, host: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host), *cmd]

    def cut(self, host: str) -> None:
        """The host's link down: nothing reaches it, nothing leaves it (its connections stay open)."""
        _ip("link", "set", self._veth(host), "down")

    def mend(self, host: str) -> None:
        _ip("link", "set", self._veth(host), "up")

    def destroy(self) -> None:
        for host in self.hosts:
            if self.namespace(host) in self._made:
                _ip("netns", "del", self.namespace(host), check=False)
        if "bridge" in self._made:
            _ip("link", "del", self.bridge, check=False)
        self._made.clear()

    def __enter__(self) -> "Network":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()
