"""Pooling: one vector per request from its final hidden states (after the final norm).

An input longer than one step's budget is prefilled in chunks, so a request's vector can span
steps: "mean" keeps a running float32 sum, "cls" keeps the first token's state, "last" needs
only the final chunk. A vector is produced in the step that computes the request's last input
token, then truncated (`dimensions`) and L2-normalised as the request or the worker asks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F
from batchwire.v1 import worker_pb2

from worker_svc.batch.validation import InvalidStepError


@dataclasses.dataclass(slots=True)
class _Partial:
    """What a request's earlier chunks left for its vector."""

    next_position: int  # the chunk that continues it must start here
    value: torch.Tensor  # (hidden,) float32: the sum so far ("mean") or token 0's state ("cls")


class Pooler:
    def __init__(self, pooling_type: str, normalize: bool, hidden_size: int) -> None:
        self.pooling_type = pooling_type
        self.normalize = normalize  # the worker's default; a request's PoolingParams may override
        self.hidden_size = hidden_size
        self._params: dict[str, worker_pb2.PoolingParams] = {}  # requests that brought some
        self._partial: dict[str, _Partial] = {}  # requests pooled across chunks, mid-input

    def begin_step(self, so: worker_pb2.SchedulerOutput) -> None:
        """Checks the step's pooling requests, then records them; refuses before any change."""
        for new in so.scheduled_new_reqs:
            where = f"new request {new.req_id!r}"
            if new.HasField("pooling") and new.pooling.HasField("dimensions"):
                dims = new.pooling.dimensions
                if not 1 <= dims <= self.hidden_size:
                    raise InvalidStepError(
                        f"{where}: pooling.dimensions={dims} outside [1, {self.hidden_size}]"
                    )
            self._check_start(new.req_id, new.num_computed_tokens, where)
        cached = so.scheduled_cached_reqs
        resumed = set(cached.resumed_req_ids)
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if req_id in resumed:
                self._check_start(req_id, computed, f"resumed request {req_id!r}")
            elif computed and self.pooling_type != "last":
                partial = self._partial.get(req_id)
                if partial is None or partial.next_position != computed:
                    raise InvalidStepError(
                        f"cached request {req_id!r}: {self.pooling_type} pooling continues at "
                        f"token {None if partial is None else partial.next_position}, the step "
                        f"starts at {computed}"
                    )
        for req_id in so.finished_req_ids:
            self._params.pop(req_id, None)
            self._partial.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            if new.HasField("pooling"):
                self._params[new.req_id] = new.pooling

    def _check_start(self, req_id: str, computed: int, where: str) -> None:
        # Mean and CLS pooling need every token's (or token 0's) hidden state: tokens taken from
        # the prefix cache were never run here, so their states are not to be had.
        if computed and self.pooling_type != "last":
            raise InvalidStepError(
                f"{where}: {self.pooling_type} pooling needs the whole input computed, "
                f"{computed} tokens arrive as computed (prefix caching must be off)"
            )
        self._partial.pop(req_id, None)  # a resumed request starts over

    def pool(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        num_computed: np.ndarray,
        complete: np.ndarray,
    ) -> list[torch.Tensor | None]:
        """hidden (T, hidden) of this step's tokens; per request (R rows, batch order):
        query_start_loc [R + 1] token offsets, num_computed [R] tokens before this step,
        complete [R] bool, the input ends in this step. -> R vectors, None where not complete."""
        num_reqs = len(req_ids)
        starts = torch.from_numpy(query_start_loc[:num_reqs].astype(np.int64))
        ends = torch.from_numpy(query_start_loc[1 : num_reqs + 1].astype(np.int64))
        if self.pooling_type == "last":
            pooled = hidden[ends - 1].float()  # (R, hidden)
        elif self.pooling_type == "cls":
            pooled = hidden[starts].float()  # token 0's state where this step starts the input
        else:
            counts = (ends - starts).to(hidden.device)
            rows = torch.repeat_interleave(torch.arange(num_reqs, device=hidden.device), counts)
            pooled = torch.zeros(num_reqs, hidden.shape[1], device=hidden.device)
            pooled.index_add_(0, rows, hidden.float())  # (R, hidden): this chunk's sums
        # Where each request's input stands after this step.
        done_up_to = (num_computed[:num_reqs] + np.diff(query_start_loc[: num_reqs + 1])).tolist()
        out: list[torch.Tensor | None] = []
        for row, req_id in enumerate(req_ids):
            vector = self._carry(req_id, pooled[row], done_up_to[row], bool(complete[row]))
            out.append(None if vector is None else self._finish(req_id, vector))
        return out

    def _carry(
        self, req_id: str, value: torch.Tensor, done_up_to: int, complete: bool
    ) -> torch.Tensor | None:
        """Joins this chunk's value with the earlier chunks'; the request's vector if complete."""
        if self.pooling_type == "last":
            return value if complete else None
        partial = self._partial.pop(req_id, None)
        if partial is not None:
            value = partial.value + value if self.pooling_type == "mean" else partial.value
        if not complete:
            self._partial[req_id] = _Partial(done_up_to, value)
            return None
        return value / done_up_to if self.pooling_type == "mean" else value

    def _finish(self, req_id: str, vector: torch.Tensor) -> torch.Tensor:
        params = self._params.get(req_id)
        normalize = self.normalize
        if params is not None:
            if params.HasField("dimensions"):
                vector = vector[: params.dimensions]
            if params.HasField("normalize"):
                normalize = params.normalize
        return F.normalize(vector, dim=0) if normalize else vector

    def reset(self) -> None:
        self._params.clear()
        self._partial.clear()
