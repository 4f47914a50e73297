"""A benchmark case's name -> the engine it runs: `zmq` is the transport and the engine's own
defaults; `zmq async` and `zmq sync` force async scheduling on and off, so that the two can be
measured side by side in one run whatever the default is; `zmq quant=none` serves the weights
with that --quantization (the default: the engine's own, auto), `zmq decode=torch` with that
--cpu-decode (the default: native)."""

from __future__ import annotations


def async_setting(case: str, default: dict | None = None) -> dict:
    """LLM keywords for a case's async scheduling: `async` or `sync` in its name, else
    `default` (a --async-scheduling flag's, or none: the engine's own)."""
    words = case.split()
    if "async" in words or "sync" in words:
        return {"async_scheduling": "async" in words}
    return dict(default or {})


def mode_setting(case: str) -> dict:
    """LLM keywords for a case's engine mode: `invariant` in its name runs batch-invariant,
    `quant=MODE` serves the weights with that quantization, `decode=MODE` with that CPU decode
    step."""
    words = case.split()
    setting: dict = {"batch_invariant": True} if "invariant" in words else {}
    for word in words:
        if word.startswith("quant="):
            setting["quantization"] = word.removeprefix("quant=")
        if word.startswith("decode="):
            setting["cpu_decode"] = word.removeprefix("decode=")
    return setting


def quantization_cases(cases: list[str], quantizations: str) -> list[str]:
    """Each case once per quantization of a comma-separated list: `auto` keeps the case's own
    name (the default), any other adds `quant=MODE`; e.g. "auto,none" measures the quantized
    default beside the de-quantised reference in one run."""
    modes = [q for q in quantizations.split(",") if q]
    return [c if q == "auto" else f"{c} quant={q}" for q in modes for c in cases]


def cpu_decode_cases(cases: list[str], modes: str) -> list[str]:
    """Each case once per --cpu-decode of a comma-separated list: `native` keeps the case's
    own name (the default), any other adds `decode=MODE`."""
    return [c if m == "native" else f"{c} decode={m}" for m in modes.split(",") if m
            for c in cases]
