"""How a request wants its tokens chosen and when it wants to stop; validated on arrival."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from batchwire.v1 import worker_pb2

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.structured_output.constraint import Constraint, constraint_from_fields

__all__ = ["InvalidRequestError", "SamplingParams", "validate_prompt"]

_INT32_MAX = 2**31 - 1  # the wire's int32 fields
_INT_FIELDS = ("top_k", "max_tokens", "min_tokens", "seed", "logprobs")


@dataclasses.dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # a per-request generator; draws do not depend on the batch
    max_tokens: int = 16  # output tokens at most (max_model_len may stop the request earlier)
    min_tokens: int = 0  # EOS and stop token ids are ignored until this many tokens are out
    stop: list[str] = dataclasses.field(default_factory=list)  # stop strings, found in the text
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the detokenized text; token ids are never filtered
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    logprobs: int | None = None  # top-n logprobs per sampled token; None = none
    # Structured output, named as on the wire: at most one of the five.
    json_schema: str | dict | None = None  # a JSON Schema, as a dict or JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is exactly one of these
    grammar: str | None = None  # EBNF, start rule `root`
    constraint: Constraint | None = dataclasses.field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        # A lone string is a common spelling of one stop string.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self._validate()
        self.constraint = constraint_from_fields(self.json_schema, self.json_object, self.regex,
                                                 self.choice, self.grammar)
        if self.constraint is not None and self.min_tokens:
            _refuse("min_tokens", self.min_tokens, f"cannot be combined with a "
                    f"{self.constraint.kind} constraint, which decides where the output ends")

    def _validate(self) -> None:
        # Wrong types and out-of-range ints would otherwise fail later, while the scheduler
        # builds the protobuf for the worker, taking the whole step down with them.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                _refuse(name, value, "must be an integer")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                _refuse(name, value, "must be a number")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            _refuse("seed", self.seed, "must be in [0, 2**64)")
        if self.top_k > _INT32_MAX:
            _refuse("top_k", self.top_k, f"must be <= {_INT32_MAX}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            _refuse("temperature", self.temperature, "must be finite and >= 0")
        if not 0 < self.top_p <= 1:
            _refuse("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < -1:
            _refuse("top_k", self.top_k, "must be >= -1 (0 and -1 mean off)")
        if not 0 <= self.min_p <= 1:
            _refuse("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens < 1:
            _refuse("max_tokens", self.max_tokens, "must be >= 1")
        if not 0 <= self.min_tokens <= min(self.max_tokens, _INT32_MAX):
            _refuse("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                _refuse(name, value, "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            _refuse("repetition_penalty", self.repetition_penalty, "must be > 0")
        if self.logprobs is not None and self.logprobs < 0:
            _refuse("logprobs", self.logprobs, "must be >= 0")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _refuse("stop", s, "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int):
                _refuse("stop_token_ids", t, "must be an integer")

    def validate_for(self, vocab_size: int, max_logprobs: int) -> None:
        """The checks that need the model and the server's limits."""
        if self.logprobs is not None and self.logprobs > max_logprobs:
            _refuse("logprobs", self.logprobs, f"must be <= the configured max_logprobs "
                    f"({max_logprobs})")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                _refuse("stop_token_ids", t, f"is outside the vocabulary [0, {vocab_size})")

    def to_proto(self, eos_token_ids: Iterable[int]) -> worker_pb2.RequestSamplingParams:
        """What the worker applies: EOS ids join the stop ids so that min_tokens masks them too."""
        stop_ids = list(self.stop_token_ids)
        if not self.ignore_eos:
            stop_ids += [t for t in eos_token_ids if t not in stop_ids]
        msg = worker_pb2.RequestSamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            stop_token_ids=stop_ids,
        )
        if self.seed is not None:
            msg.seed = self.seed
        if self.logprobs is not None:
            msg.logprobs = self.logprobs
        c = self.constraint
        if c is not None:
            if c.kind == "choice":
                msg.choice.choices.extend(c.choices)
            elif c.kind == "json_object":
                msg.json_object = True
            else:
                setattr(msg, c.kind, c.text)
        return msg


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    if len(prompt_token_ids) == 0:
        _refuse("prompt", "", "must not be empty")
    if len(prompt_token_ids) >= max_model_len:
        _refuse("prompt", f"{len(prompt_token_ids)} tokens",
                f"must be shorter than max_model_len ({max_model_len}) to leave room for output")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        _refuse("prompt_token_ids", bad, f"is outside the vocabulary [0, {vocab_size})")


def _refuse(field: str, value: object, rule: str) -> None:
    raise InvalidRequestError(field, f"{value!r} {rule}")
