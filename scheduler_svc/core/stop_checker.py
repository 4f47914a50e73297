"""Whether the token just appended ends a request, checked in a fixed order.

The order decides the reason when several apply at once: a stop token that is also the
max_tokens-th token reports "stop", not "length".
"""

from __future__ import annotations

from scheduler_svc.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """The finished status the request's last token puts it in, or None to go on.

    Sets request.stop_reason when a stop token id hit. Stop strings are the output processor's.
    """
    params = request.sampling_params
    num_tokens = len(request.all_token_ids)
    num_output = num_tokens - request.num_prompt_tokens
    # max_model_len is a hard wall: the request cannot grow past it even before min_tokens.
    if num_output < params.min_tokens and num_tokens < max_model_len:
        return None
    last = request.all_token_ids[-1]
    if not params.ignore_eos and last in request.eos_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if last in params.stop_token_ids:
        request.stop_reason = last
        return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_tokens(request: Request, new_ids: list[int], max_model_len: int
                  ) -> RequestStatus | None:
    """Appends a step's tokens one by one through the grammar and the stop rules; returns the
    finished status or None. (Stop strings are checked on the text, off the engine thread:
    core/output_processor.py.)

    One at a time, so that a step that kept several tokens (speculative decoding) ends the
    request at the very token a step per token would have: new_ids is cut after it."""
    tokens = request.all_token_ids
    grammar = request.grammar
    for j, token in enumerate(new_ids):
        tokens.append(token)
        status = None
        if grammar is not None and grammar.accept(token):
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        elif token in request.stop_ids or len(tokens) >= request.max_num_tokens:
            status = check_stop(request, max_model_len)
        if status is not None:
            del new_ids[j + 1:]
            return status
    return None
