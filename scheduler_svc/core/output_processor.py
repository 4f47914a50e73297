"""Text for the engine's token-only outputs, off the engine thread: the incremental detokenizer,
held-back text and stop strings.

The engine step appends tokens and applies the token rules (EOS, stop token ids, max_tokens,
min_tokens); its outputs carry token ids only. Whoever reads them runs one OutputProcessor
over them, in order: the server on its event loop (engine/async_engine.py), the offline engine
inline after each step (EngineCore.step). A stop string found there ends the
request for its client at once: the output is cut after the token that completed it, later
outputs are dropped, and the engine is told to stop the request (EngineCore.stop_requests), which
frees its blocks and confirms the end with one last output of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from scheduler_svc.core.detokenizer import IncrementalDetokenizer
from scheduler_svc.core.outputs import EngineCoreOutput
from scheduler_svc.core.sampling_params import SamplingParams

# A request a stop string ended -> (the output tokens its client got, the stop string).
Stops = dict[str, tuple[int, str]]


class RequestText:
    """One request's text. `ended`: its client's stream ended (a stop string, or the client
    went away) and the engine has not yet confirmed the end (its outputs until then are
    dropped)."""

    __slots__ = ("detokenizer", "ended")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        # The scheduler keeps the prompt's last truncate_prompt_tokens; the left context is the
        # tail of what it keeps.
        k = params.truncate_prompt_tokens
        prompt = prompt_token_ids[-k:] if k else prompt_token_ids
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens)
        self.ended = False

    def apply(self, out: EngineCoreOutput) -> str | None:
        """Fills out.new_text. When a stop string completes within `out`, cuts its tokens (and
        logprobs) after the one that completed it and finishes it with "stop" and the string, as
        the engine would have; returns the string when the engine must be told (it had not
        finished the request itself)."""
        ids = out.new_token_ids
        if not ids:
            return None  # an abort's or a pooling output: nothing to decode, nothing flushed
        detok = self.detokenizer
        engine_finished = out.finished
        if len(ids) == 1:  # the steady decode step
            out.new_text, stop = detok.update(ids, finished=engine_finished)
            kept = 1
        else:  # a step that kept drafts: token by token, so the cut lands on the right one
            last = len(ids) - 1
            parts = []
            stop = None
            for kept, token in enumerate(ids, 1):
                delta, stop = detok.update((token,), finished=engine_finished and kept > last)
                parts.append(delta)
                if stop is not None:
                    break
            out.new_text = "".join(parts)
        if stop is None or (engine_finished and kept == len(ids)):
            # A token rule that ended the request on this very token keeps its reason (the text
            # is cut at the stop string all the same).
            return None
        if kept < len(ids):
            out.num_output_tokens -= len(ids) - kept
            del ids[kept:]
            if out.new_logprobs is not None:
                del out.new_logprobs[kept:]
        out.finished, out.finish_reason, out.stop_reason = True, "stop", stop
        self.ended = not engine_finished
        return stop if self.ended else None


class OutputProcessor:
    """The RequestTexts of an engine's requests, by the client's request id, for a caller that
    reads the engine's outputs on one thread: the server's event loop (engine/async_engine.py),
    the offline engine inline (EngineCore.process_outputs). Requests it does not know (pooling,
    no tokenizer) pass through untouched."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[str, RequestText] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> None:
        self._texts[request_id] = RequestText(self.tokenizer, prompt_token_ids, params)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._texts

    def end(self, request_id: str) -> None:
        """Its client went away: its outputs are dropped until the engine confirms the end."""
        text = self._texts.get(request_id)
        if text is not None:
            text.ended = True

    def forget(self, request_id: str) -> None:
        """Drops the request's text: it failed, or its admission was refused."""
        self._texts.pop(request_id, None)

    def process(self, outputs: Iterable[EngineCoreOutput]
                ) -> tuple[list[EngineCoreOutput], Stops]:
        """The outputs for the clients, with text, and the requests stop strings ended, for
        the engine's stop_requests."""
        shown = []
        stops: Stops = {}
        texts = self._texts
        for out in outputs:
            text = texts.get(out.request_id)
            if text is None:
                shown.append(out)
                continue
            engine_finished = out.finished
            if text.ended:  # until the engine's end confirms it: nothing for the client
                if engine_finished:
                    del texts[out.request_id]
                continue
            stop = text.apply(out)
            if stop is not None:
                stops[out.request_id] = (out.num_output_tokens, stop)
            elif engine_finished:
                del texts[out.request_id]
            shown.append(out)
        return shown, stops
