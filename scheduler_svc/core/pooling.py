"""Embedding requests in the scheduler: their parameters, and what a pooling step's reply means.

An embedding request is scheduled like a prompt with no output: its input is prefilled (in
chunks if long), and in the step that computes its last input token the worker returns its
vector in ModelRunnerOutput.pooler_output instead of parking logits. The request then finishes at
once, so its KV blocks go back to the pool in the same update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from batchwire.v1 import worker_pb2

from scheduler_svc.core.errors import InvalidRequestError

# Pooling types whose vector needs every input token's hidden state (or token 0's): tokens found
# in the prefix cache were never run, so the worker refuses them and prefix caching must be off.
NEEDS_WHOLE_INPUT = ("mean", "cls")


@dataclasses.dataclass(frozen=True, slots=True)
class PoolingParams:
    normalize: bool | None = None  # None: the worker's default (--normalize)
    dimensions: int | None = None  # keep the first n values (before normalising); None: all

    def validate_for(self, hidden_size: int) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise InvalidRequestError("dimensions", f"{self.dimensions} is outside [1, "
                                                    f"{hidden_size}] (the model's hidden size)")

    def to_proto(self) -> worker_pb2.PoolingParams:
        return worker_pb2.PoolingParams(normalize=self.normalize, dimensions=self.dimensions)


def prefix_caching_allowed(task: str, pooling_type: str) -> bool:
    return not (task == "embed" and pooling_type in NEEDS_WHOLE_INPUT)


def pooled_vectors(model_output: worker_pb2.ModelRunnerOutput) -> Iterator[tuple[str, list[float]]]:
    """(wire id, vector) for each request pooled in this step; mid-input requests are skipped."""
    for req_id, vector in zip(model_output.req_ids, model_output.pooler_output, strict=True):
        if vector.values:
            yield req_id, list(vector.values)
