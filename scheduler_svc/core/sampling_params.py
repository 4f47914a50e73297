"""How a request wants its tokens chosen and when it wants to stop; validated on arrival."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence

from batchwire.common import sampling_rules
from batchwire.v1 import worker_pb2

from scheduler_svc.config import RequestLimits
from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.structured_output.constraint import Constraint, constraint_from_fields

__all__ = ["DEFAULT_MAX_TOKENS", "InvalidRequestError", "SamplingParams", "validate_length",
           "validate_prompt"]

# vLLM's default, and the one every batchwire client uses (the wire, generate, chat, LLM).
DEFAULT_MAX_TOKENS = 16
_INT_FIELDS = ("top_k", "max_tokens", "min_tokens", "seed", "logprobs", "truncate_prompt_tokens",
               "n", "prompt_logprobs")


@dataclasses.dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # a per-request generator; draws do not depend on the batch
    # Output tokens at most; a prompt plus max_tokens longer than max_model_len is refused.
    max_tokens: int = DEFAULT_MAX_TOKENS
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
    # Logit shaping, applied by the worker before penalties and sampling.
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # None = every token; else only these, never none
    bad_words: list[str] = dataclasses.field(default_factory=list)  # their token sequences banned
    prompt_logprobs: int | None = None  # top-k logprobs of each prompt token after the first
    n: int = 1  # sequences sampled from the prompt; the service fans them out, n = 1 each
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; None = all
    # The banned sequences, filled at admission by the scheduler, which has the tokenizer.
    bad_words_token_ids: list[list[int]] = dataclasses.field(init=False, default_factory=list,
                                                             repr=False)
    constraint: Constraint | None = dataclasses.field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        # A lone string is a common spelling of one stop string.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.bad_words = list(self.bad_words)
        self._validate()
        self._validate_shaping()
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
        # The wire's ranges, the worker's own (common/sampling_rules.py): one rule set.
        with _as_request_error():
            sampling_rules.check_seed(self.seed)
            sampling_rules.check_values(self)
        if self.max_tokens < 1:
            _refuse("max_tokens", self.max_tokens, "must be >= 1")
        if not self.min_tokens <= self.max_tokens:
            _refuse("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            _refuse("prompt_logprobs", self.prompt_logprobs, "must be >= 0")
        if self.n < 1:
            _refuse("n", self.n, "must be >= 1")
        if self.truncate_prompt_tokens is not None and not 1 <= self.truncate_prompt_tokens:
            _refuse("truncate_prompt_tokens", self.truncate_prompt_tokens, "must be >= 1")
        if self.logprobs is not None and self.logprobs < 0:
            _refuse("logprobs", self.logprobs, "must be >= 0")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _refuse("stop", s, "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int):
                _refuse("stop_token_ids", t, "must be an integer")

    def _validate_shaping(self) -> None:
        if self.logit_bias is not None:
            biases = {}
            for token, bias in dict(self.logit_bias).items():
                if not isinstance(token, int) or isinstance(token, bool):
                    _refuse("logit_bias", {token: bias}, "keys must be integer token ids")
                if not isinstance(bias, int | float) or isinstance(bias, bool):
                    _refuse("logit_bias", {token: bias}, "biases must be numbers")
                biases[token] = float(bias)
            self.logit_bias = biases
            with _as_request_error():  # refused out of range, as OpenAI does, not clamped
                sampling_rules.check_logit_bias(biases)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                _refuse("allowed_token_ids", [], "must not be empty (leave it unset for every "
                        "token)")
            for t in self.allowed_token_ids:
                if not isinstance(t, int) or isinstance(t, bool):
                    _refuse("allowed_token_ids", t, "must be an integer")
        for w in self.bad_words:
            if not isinstance(w, str) or not w:
                _refuse("bad_words", w, "bad words must be non-empty strings")

    def validate_for(self, vocab_size: int, limits: RequestLimits) -> None:
        """The checks that need the model and the server's limits."""
        with _as_request_error():
            sampling_rules.check_logprobs("logprobs", self.logprobs, limits.max_logprobs)
            sampling_rules.check_logprobs("prompt_logprobs", self.prompt_logprobs,
                                          limits.max_logprobs)
        for name in ("stop", "bad_words"):
            strings = getattr(self, name)
            if len(strings) > limits.max_stop_strings:
                raise InvalidRequestError(name, f"{len(strings)} strings; the limit is "
                                                f"max_stop_strings={limits.max_stop_strings}")
            chars = sum(map(len, strings))
            if chars > limits.max_stop_chars:
                raise InvalidRequestError(name, f"{chars} characters in all; the limit is "
                                                f"max_stop_chars={limits.max_stop_chars}")
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            count = len(getattr(self, name) or ())
            if count > limits.max_token_ids:
                raise InvalidRequestError(name, f"{count} entries; the limit is "
                                                f"max_token_ids={limits.max_token_ids}")
        with _as_request_error():
            sampling_rules.check_vocabulary(self, vocab_size)

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
        if self.prompt_logprobs is not None:
            msg.prompt_logprobs = self.prompt_logprobs
        if self.logit_bias:
            msg.logit_bias.update(self.logit_bias)
        if self.allowed_token_ids:
            msg.allowed_token_ids.extend(self.allowed_token_ids)
        for ids in self.bad_words_token_ids:
            msg.bad_words.add().ids.extend(ids)
        c = self.constraint
        if c is not None:
            if c.kind == "choice":
                msg.choice.choices.extend(c.choices)
            elif c.kind == "json_object":
                msg.json_object = True
            else:
                setattr(msg, c.kind, c.text)
        return msg


def truncate_prompt(prompt_token_ids: Sequence[int], params: SamplingParams,
                    max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (all of it when unset or shorter)."""
    k = params.truncate_prompt_tokens
    if k is None:
        return list(prompt_token_ids)
    if k >= max_model_len:
        _refuse("truncate_prompt_tokens", k, f"must be < max_model_len ({max_model_len}) to "
                "leave room for output")
    return list(prompt_token_ids[-k:])


def validate_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Refuses what could only end cut short by max_model_len, as vLLM does: the client asked
    for more than fits, and should hear so rather than get "length" early."""
    if num_prompt_tokens + max_tokens > max_model_len:
        _refuse("max_tokens", max_tokens,
                f"with a {num_prompt_tokens}-token prompt needs {num_prompt_tokens + max_tokens} "
                f"tokens, more than max_model_len ({max_model_len}): ask for at most "
                f"{max_model_len - num_prompt_tokens}")


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


@contextlib.contextmanager
def _as_request_error() -> Iterator[None]:
    """A broken rule of the shared set, as the refusal a service answers INVALID_ARGUMENT."""
    try:
        yield
    except sampling_rules.SamplingRuleError as e:
        raise InvalidRequestError(e.field, str(e)) from None
