"""Fixtures for tests across hosts: network namespaces made and deleted by the test itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from .netns import NamespacesUnavailable, Network


@contextlib.contextmanager
def network(size: int) -> Iterator[Network]:
    """`size` hosts on a private bridge, deleted at the end; the test skips, saying why, only on
    a machine that cannot make network namespaces."""
    try:
        net = Network(size)
    except NamespacesUnavailable as e:
        pytest.skip(f"tests across hosts need network namespaces (root and `ip`): {e}")
    try:
        yield net
    finally:
        net.close()


@pytest.fixture()
def two_hosts() -> Iterator[Network]:
    with network(2) as net:
        yield net
