"""Constraints compiled into xgrammar grammars for one tokenizer, cached by constraint.

Compiling takes from microseconds (a cached choice) to a fraction of a second (a large schema), so
the admission paths call compile() before a request reaches the engine thread (the gRPC servicer
on a worker thread: xgrammar releases the GIL while it compiles); the scheduler's own call is then
a cache hit. xgrammar is imported on the first constraint: it costs seconds at start-up.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.core.structured_output.constraint import Constraint
from scheduler_svc.core.structured_output.schema_check import why_unsatisfiable

if TYPE_CHECKING:
    import xgrammar as xgr

# Fills the search for an accepted string may spend before giving up undecided (~50 us each).
MATCH_SEARCH_BUDGET = 256
# The longest a constraint may take to compile. xgrammar cannot be stopped, so one past it goes on
# compiling on its own thread; it is refused now and every time it comes back.
COMPILE_TIMEOUT_S = 10.0
# xgrammar compiles on this many threads. One: on a machine of a few cores a compile on every
# core starved the running streams' forward passes (a 600-property schema stalled them 3 s).
COMPILE_THREADS = 1
# xgrammar's messages start with a time stamp and its own source file: "[19:45:45] x.cc:94: ".
XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Thread-safe. Raises InvalidRequestError naming the constraint's kind when one does not
    compile or cannot match any text."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 256,
                 max_threads: int = COMPILE_THREADS,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        import xgrammar as xgr

        # vocab_size is the model's: its rows past the tokenizer's tokens are never allowed.
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._cache: collections.OrderedDict[Constraint, xgr.CompiledGrammar] = (
            collections.OrderedDict())
        self._cache_size = cache_size
        self.timeout_s = timeout_s
        self._too_slow: set[Constraint] = set()  # refused past timeout_s: refused from now on
        self._lock = threading.Lock()
        self._byte_tokens, self._bytes_complete = _byte_tokens(self.info.decoded_vocab)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        with self._lock:
            if constraint in self._too_slow:
                raise self._too_slow_error(constraint)
            compiled = self._cache.get(constraint)
            if compiled is not None:
                self._cache.move_to_end(constraint)
                return compiled
        # Outside the lock: a large schema must not hold up the cache hits of other threads.
        done: concurrent.futures.Future[xgr.CompiledGrammar] = concurrent.futures.Future()
        threading.Thread(target=_run_into, args=(done, self._compile, constraint),
                         name="grammar-compile", daemon=True).start()
        try:
            compiled = done.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                if len(self._too_slow) < self._cache_size:  # bounded, as the cache is
                    self._too_slow.add(constraint)
            raise self._too_slow_error(constraint) from None
        with self._lock:
            self._cache[constraint] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _too_slow_error(self, constraint: Constraint) -> InvalidRequestError:
        return InvalidRequestError(constraint.kind, f"takes longer than the limit of "
                                                    f"{self.timeout_s:g} s to compile")

    def _compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        kind, text = constraint.kind, constraint.text
        try:
            if kind == "json_schema":
                # One line with ", " and ": ": free whitespace lets a small model pad forever.
                compiled = self._compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = self._compiler.compile_json_schema('{"type": "object"}',
                                                              any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "choice":
                compiled = self._compiler.compile_grammar(choice_grammar(constraint.choices))
            else:
                compiled = self._compiler.compile_grammar(text)
        except RuntimeError as e:
            message = XGRAMMAR_PREFIX.sub("", str(e).strip())
            raise InvalidRequestError(kind, f"does not compile: {message}") from None
        if kind in ("regex", "grammar") and self._can_match(compiled) is False:
            raise InvalidRequestError(kind, f"{text[:80]!r} cannot match any text")
        if kind == "json_schema":
            reason = why_unsatisfiable(json.loads(text))  # the text parsed on admission
            if reason is not None:
                raise InvalidRequestError(kind, f"admits no value: {reason}")
        return compiled

    def _can_match(self, compiled: xgr.CompiledGrammar) -> bool | None:
        """True when some text completes the grammar, False when none can, None when the search
        ran out of budget. A depth-first search one single-byte token at a time: when any text the
        model can write can be spelled that way too, an exhausted search is a proof."""
        import xgrammar as xgr

        root = matcher = xgr.GrammarMatcher(compiled)
        stop_ids = np.asarray(root.stop_token_ids, dtype=np.int64)
        mask = np.zeros((1, (self.vocab_size + 31) // 32), dtype=np.int32)  # [1, words]
        stack: list[tuple[xgr.GrammarMatcher, Iterator[int]]] = []  # node, children left
        for _ in range(MATCH_SEARCH_BUDGET):
            matcher.fill_next_token_bitmask(mask)
            allowed = unpack_row(mask[0], self.vocab_size)  # [vocab] bool
            if allowed[stop_ids].any():
                return True
            if matcher is root and not allowed.any():
                return False  # no first token at all, whatever the vocabulary
            stack.append((matcher, iter(self._byte_tokens[allowed[self._byte_tokens]].tolist())))
            child = _next_child(stack)
            if child is None:
                return False if self._bytes_complete else None
            parent, token = child
            matcher = parent.fork()
            matcher.accept_token(token)
        return None


def _run_into(future: concurrent.futures.Future, fn: Any, *args: Any) -> None:
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # the caller raises it, on its own thread
        future.set_exception(e)


def _next_child(stack: list[tuple[Any, Iterator[int]]]) -> tuple[Any, int] | None:
    """The deepest node with a token left to try, and that token; spent nodes are dropped."""
    while stack:
        token = next(stack[-1][1], None)
        if token is not None:
            return stack[-1][0], token
        stack.pop()
    return None


def unpack_row(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """[words] packed int32 -> [vocab_size] bool, True = allowed."""
    bits = np.unpackbits(row.astype("<i4", copy=False).view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def choice_grammar(choices: list[str]) -> str:
    # JSON string escapes (\", \\, \n, \uXXXX) are EBNF string-literal escapes too.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _byte_tokens(decoded_vocab: list[bytes]) -> tuple[np.ndarray, bool]:
    """The token of each single byte, in byte order, and whether every byte found in any token
    has one: then whatever text the model can write, it can also write one byte at a time."""
    by_byte: dict[int, int] = {}
    used: set[int] = set()
    for token_id, piece in enumerate(decoded_vocab):
        used.update(piece)
        if len(piece) == 1 and piece[0] not in by_byte:
            by_byte[piece[0]] = token_id
    complete = used <= by_byte.keys()
    return np.asarray([by_byte[b] for b in sorted(by_byte)], dtype=np.int64), complete


_SHARED: dict[tuple[int, int], tuple[Any, GrammarCompiler]] = {}
_SHARED_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The one compiler (and cache) of this tokenizer and vocabulary in this process, shared by
    the admission path and every scheduler (replica) that serves them."""
    key = (id(tokenizer), vocab_size)
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            # The tokenizer is held too, so that its id cannot be reused by another object.
            entry = _SHARED[key] = (tokenizer, GrammarCompiler(tokenizer, vocab_size))
        return entry[1]
