"""Test hosts as Linux network namespaces on one machine: each host has a network stack of its
own with one interface (eth0) on a private bridge, which lives in a namespace of its own too, so
the test's addresses (10.213.0.0/24) exist only inside the test and never touch the machine's.

    with Network(3) as net:                      # hosts 10.213.0.1 .. 10.213.0.3
        proc = net.hosts[0].popen([...])         # runs inside host 0, dies with the test
        net.hosts[1].cut()                       # host 1's cable out: packets vanish silently
        net.hosts[1].restore()

A cut sets the bridge's end of the host's veth pair down: the host's own interface keeps its
address and routes (no error for its sockets), and nothing it sends arrives, as when a cable or a
switch port fails. Every namespace is deleted in Network.close(), whatever happened.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

SUBNET = "10.213.0"  # inside the test's namespaces only; the machine's own stack never sees it
_PR_SET_PDEATHSIG = 1
_networks = itertools.count()


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no `ip`, a sandbox)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({result.returncode}): "
                           f"{result.stderr.strip()}")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, and a process group of its
    own, so that teardown (or a crashed test runner) ends the child and everything it started."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Host:
    def __init__(self, network: Network, index: int) -> None:
        self.network = network
        self.index = index
        self.namespace = f"{network.prefix}-h{index}"
        self.address = f"{SUBNET}.{index + 1}"
        self.bridge_port = f"p{index}"  # the bridge's end of this host's veth pair
        self.processes: list[subprocess.Popen] = []

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def popen(self, argv: Sequence[str], log: Path | None = None,
              env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Starts argv inside this host; it is killed with its group at Network.close()."""
        out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        streams = dict(stdout=out, stderr=subprocess.STDOUT if log else None)
        try:
            process = subprocess.Popen(
                self.command(argv), env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                preexec_fn=_die_with_parent, **{**streams, **kwargs})
        finally:
            if log is not None:
                out.close()  # the child holds its own copy
        self.processes.append(process)
        return process

    def run(self, argv: Sequence[str], timeout_s: float = 60.0,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Runs argv inside this host to its end; raises on a failure, with its output."""
        result = subprocess.run(self.command(argv), capture_output=True, text=True,
                                timeout=timeout_s, preexec_fn=_die_with_parent, cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"{list(argv)} on {self.namespace} exited with "
                               f"{result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def cut(self) -> None:
        """Unplugs the host: its link to the bridge goes down, silently for its own stack."""
        _ip("-n", self.network.bridge, "link", "set", self.bridge_port, "down")

    def restore(self) -> None:
        _ip("-n", self.network.bridge, "link", "set", self.bridge_port, "up")

    def kill_all(self) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        self.processes.clear()


class Network:
    """`size` hosts on one bridge. Namespace names carry the test process's pid and a counter, so
    parallel test processes (xdist) never collide."""

    def __init__(self, size: int) -> None:
        self.prefix = f"bw{os.getpid()}n{next(_networks)}"
        self.bridge = f"{self.prefix}-br"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        try:
            self._add_namespace(self.bridge)
        except (OSError, RuntimeError) as e:
            raise NamespacesUnavailable(f"cannot make a network namespace: {e}") from e
        try:
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for index in range(size):
                self._add_host(Host(self, index))
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._namespaces.append(name)

    def _add_host(self, host: Host) -> None:
        self._add_namespace(host.namespace)
        # Both ends are made inside their namespaces: no name is ever used in the machine's own.
        _ip("link", "add", host.bridge_port, "netns", self.bridge, "type", "veth",
            "peer", "name", "eth0", "netns", host.namespace)
        _ip("-n", self.bridge, "link", "set", host.bridge_port, "master", "br0", "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.namespace, "link", "set", "eth0", "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        self.hosts.append(host)

    def close(self) -> None:
        for host in self.hosts:
            host.kill_all()
        for name in reversed(self._namespaces):  # deleting one takes its interfaces with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._namespaces.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
