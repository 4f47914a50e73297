"""A benchmark case's name -> the engine it runs: `zmq` is the transport and the engine's own
defaults; `zmq async` and `zmq sync` force async scheduling on and off, so that the two can be
measured side by side in one run whatever the default is."""

from __future__ import annotations


def async_setting(case: str, default: dict | None = None) -> dict:
    """LLM keywords for a case's async scheduling: `async` or `sync` in its name, else
    `default` (a --async-scheduling flag's, or none: the engine's own)."""
    words = case.split()
    if "async" in words or "sync" in words:
        return {"async_scheduling": "async" in words}
    return dict(default or {})


def mode_setting(case: str) -> dict:
    """LLM keywords for a case's engine mode: `invariant` in its name runs batch-invariant."""
    return {"batch_invariant": True} if "invariant" in case.split() else {}
