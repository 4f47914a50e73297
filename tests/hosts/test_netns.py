"""The harness itself: hosts reach each other over the bridge, a cut link drops their packets
silently and a restored one carries them again, and closing leaves no namespace and no process."""

from __future__ import annotations

import subprocess
import sys
import time

from .conftest import network

LISTEN = ("import socket, sys\n"
          "s = socket.create_server(('0.0.0.0', 7000)); print('up', flush=True)\n"
          "while True:\n"
          "    c, _ = s.accept(); c.sendall(b'hello from ' + sys.argv[1].encode()); c.close()\n")
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    c = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))\n"
           "    print(c.recv(100).decode())\n"
           "except OSError as e:\n"
           "    print(type(e).__name__)\n")


def test_hosts_talk_until_cut_and_again_after_restore(two_hosts):
    client, server = two_hosts.hosts
    listener = server.popen([sys.executable, "-c", LISTEN, server.address],
                            stdout=subprocess.PIPE, text=True)
    assert listener.stdout.readline().strip() == "up"

    def connect(timeout_s: float) -> str:
        argv = [sys.executable, "-c", CONNECT, server.address, str(timeout_s)]
        return client.run(argv).stdout.strip()

    assert connect(5) == f"hello from {server.address}"
    server.cut()
    started = time.monotonic()
    assert connect(0.5) == "TimeoutError"  # silence, not a refusal: a partition
    assert time.monotonic() - started >= 0.5
    server.restore()
    assert connect(5) == f"hello from {server.address}"
    # The machine's own stack never sees the test's range.
    assert "10.213." not in subprocess.run(["ip", "addr"], capture_output=True, text=True).stdout


def test_close_deletes_the_namespaces_and_kills_the_processes():
    with network(1) as net:
        (host,) = net.hosts
        sleeper = host.popen([sys.executable, "-c", "import time; time.sleep(600)"])
        names = [net.bridge, host.namespace]
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed


def test_each_host_has_its_own_address():
    with network(3) as net:
        for host in net.hosts:
            out = host.run(["ip", "-4", "-o", "addr", "show", "eth0"]).stdout
            assert f"{host.address}/24" in out
