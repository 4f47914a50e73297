"""Timers wrapped around the callables a step goes through, each adding into the part of the
step it belongs to: how the throughput profile (offline/step_profile.py) and the overhead's parts
(engine/overhead_parts.py) split a step's time."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any


class Splits:
    """Wraps callables with timers adding into `seconds[part]` while `enabled`; undo() puts them
    back."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = True
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)
        own = name in getattr(owner, "__dict__", {})
        seconds = self.seconds
        splits = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not splits.enabled:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - t0

        setattr(owner, name, timed)
        self._undo.append((owner, name, original, own))

    def undo(self) -> None:
        for owner, name, original, own in reversed(self._undo):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute shadowed the class's method
        self._undo.clear()
