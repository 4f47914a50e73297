"""A worker's refusal of a step, naming the requests at fault, across the seam.

The worker checks each step before it changes anything (worker_svc/batch/validation.py) and refuses
a bad one whole with INVALID_ARGUMENT; its persistent batch stays as it was. When the fault is some
requests' (a sampling value, a token id), the refusal names them, so that the scheduler fails only
those and sends the step again without them; the rest of the batch never notices. In process the
refusal is a StepRefused; over gRPC and ZMQ its req_ids ride at the end of the status message, as
one JSON line after REFUSED_MARK, the same on both transports."""

from __future__ import annotations

import json
from collections.abc import Sequence

REFUSED_MARK = "\nrefused req_ids: "
# A status message rides in gRPC metadata (8 KiB soft limit): the ids carried are bounded. A
# scheduler's wire ids are a few characters; longer ones come from no scheduler and go unnamed.
MAX_CARRIED_ID_CHARS = 64
MAX_CARRIED_IDS = 64


class StepRefused(ValueError):
    """A step refused whole; `req_ids`: the requests at fault (wire ids), empty when the fault is
    the step's own (its totals, its shape)."""

    def __init__(self, message: str, req_ids: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.req_ids = list(req_ids)


def refusal_message(message: str, req_ids: Sequence[str]) -> str:
    """The status message that carries the refused requests' ids (those a scheduler could have
    sent, up to MAX_CARRIED_IDS)."""
    carried = [r for r in req_ids if len(r) <= MAX_CARRIED_ID_CHARS][:MAX_CARRIED_IDS]
    if not carried:
        return message
    return message + REFUSED_MARK + json.dumps(carried)


def parse_refusal(message: str) -> tuple[str, list[str]]:
    """(the message for people, the refused req_ids) of a status message; [] when none named."""
    text, mark, ids = message.rpartition(REFUSED_MARK)
    if not mark:
        return message, []
    try:
        req_ids = json.loads(ids)
    except ValueError:
        return message, []
    if not isinstance(req_ids, list) or not all(isinstance(r, str) for r in req_ids):
        return message, []
    return text, req_ids
