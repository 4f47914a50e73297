"""The slow marker's lists (tests/conftest.py) name files and tests that exist: a renamed file
would otherwise drop silently into `make test-fast`."""

from __future__ import annotations

import os

from tests.conftest import SLOW_FILES, SLOW_TESTS

TESTS = os.path.dirname(__file__)


def test_every_listed_slow_file_and_test_exists():
    missing = [f for f in SLOW_FILES if not os.path.isfile(os.path.join(TESTS, f))]
    assert not missing
    for entry in SLOW_TESTS:
        path, name = entry.split("::")
        with open(os.path.join(TESTS, path)) as f:
            assert f"def {name}(" in f.read(), entry
