"""The one rule set for a request's sampling fields, shared by the scheduler's admission
(SamplingParams: gRPC, HTTP and the offline API) and the worker's check of the wire
(worker_svc/batch/validation.py). What admission accepts, the worker accepts; what the worker would
refuse, admission refuses first, naming the field.

The rules read the fields by their names, which SamplingParams and the wire's
RequestSamplingParams share, and judge each float as the wire carries it (float32): a value that
is finite here but overflows float32, or is positive but rounds to 0, is refused as what the
worker would see. No torch, no protobuf import: plain values in, SamplingRuleError out.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any

INT32_MAX = 2**31 - 1  # the wire's int32 fields
UINT64_LIMIT = 2**64  # the wire's seed
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: refused beyond, not clamped
MAX_ABS_PENALTY = 2.0  # presence_penalty and frequency_penalty


class SamplingRuleError(ValueError):
    """A field breaks a rule; `field` names it as the client spelled it."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        super().__init__(f"{value!r} {rule}")
        self.field = field
        self.value = value
        self.rule = rule


def wire_float(value: float) -> float:
    """The value a float32 wire field carries: rounded, or +-inf past float32's range."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


def _in_range(value: float, low: float, high: float, low_open: bool = False) -> bool:
    """NaN fails every comparison, so it is never in range."""
    if low_open:
        return low < value <= high
    return low <= value <= high


def check_values(p: Any) -> None:
    """The scalar fields of `p` (a SamplingParams or a RequestSamplingParams)."""
    floats = (
        ("temperature", 0.0, math.inf, False, "must be finite and >= 0"),
        ("top_p", 0.0, 1.0, True, "must be in (0, 1]"),
        ("min_p", 0.0, 1.0, False, "must be in [0, 1]"),
        ("presence_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY, False, "must be in [-2, 2]"),
        ("frequency_penalty", -MAX_ABS_PENALTY, MAX_ABS_PENALTY, False, "must be in [-2, 2]"),
        ("repetition_penalty", 0.0, math.inf, True, "must be finite and > 0"),
    )
    for name, low, high, low_open, rule in floats:
        value = getattr(p, name)
        wired = wire_float(value)
        if not _in_range(wired, low, high, low_open) or math.isinf(wired):
            if wired != value and not math.isnan(value):
                rule += f" (it is {wired!r} as a float32)"
            raise SamplingRuleError(name, value, rule)
    if not -1 <= p.top_k <= INT32_MAX:
        raise SamplingRuleError("top_k", p.top_k, f"must be in [-1, {INT32_MAX}] (0 and -1 mean "
                                "off)")
    if not 0 <= p.min_tokens <= INT32_MAX:
        raise SamplingRuleError("min_tokens", p.min_tokens, f"must be in [0, {INT32_MAX}]")


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < UINT64_LIMIT:
        raise SamplingRuleError("seed", seed, "must be in [0, 2**64)")


def check_logprobs(name: str, value: int | None, max_logprobs: int) -> None:
    """logprobs or prompt_logprobs; None: not asked for."""
    if value is not None and not 0 <= value <= max_logprobs:
        raise SamplingRuleError(name, value, f"must be in [0, the configured max_logprobs "
                                f"({max_logprobs})]")


def check_token_ids(name: str, token_ids: Iterable[int], vocab_size: int) -> None:
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise SamplingRuleError(name, t, f"is outside the vocabulary [0, {vocab_size})")


def check_logit_bias(bias: Mapping[int, float], vocab_size: int | None = None) -> None:
    """Values finite within [-100, 100] (as float32); keys token ids of the vocabulary (when
    vocab_size is given: admission knows it only once a replica takes the request)."""
    if vocab_size is not None:
        check_token_ids("logit_bias", bias.keys(), vocab_size)
    for token, value in bias.items():
        if not _in_range(wire_float(value), -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS):
            raise SamplingRuleError("logit_bias", {token: value},
                                    f"biases must be finite and in [-{MAX_ABS_LOGIT_BIAS:g}, "
                                    f"{MAX_ABS_LOGIT_BIAS:g}]")


def check_vocabulary(p: Any, vocab_size: int) -> None:
    """The token ids `p` names: stop ids, logit_bias keys (and its values), allowed ids."""
    check_token_ids("stop_token_ids", p.stop_token_ids, vocab_size)
    check_logit_bias(p.logit_bias or {}, vocab_size)
    check_token_ids("allowed_token_ids", p.allowed_token_ids or (), vocab_size)
