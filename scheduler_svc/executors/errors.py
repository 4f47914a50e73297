"""What a remote worker's failure looks like to the engine.

WorkerError: a call the worker refused or failed, with its status code (INVALID_ARGUMENT for a
step it cannot run, FAILED_PRECONDITION for ExecuteModel twice, ...). WorkerUnavailableError: the
worker group is gone (dead, silent, or broken mid-step); its executor is failed for good and every
later call raises this at once. A service answers it with UNAVAILABLE.
"""

from __future__ import annotations

import grpc
from batchwire.common.refusals import StepRefused, parse_refusal

# Codes after which the worker group cannot be trusted with another step.
FATAL_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    # The worker does not take this scheduler's token (or certificate): nor will it next step.
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
})

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)


class WorkerError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, message: str, rank: int | None = None,
                 address: str = "") -> None:
        where = f"worker rank {rank} at {address}" if rank is not None else "worker"
        super().__init__(f"{where}: {code.name}: {message}")
        self.code = code
        self.message = message
        self.rank = rank
        self.address = address


class WorkerUnavailableError(WorkerError):
    def __init__(self, message: str, rank: int | None = None, address: str = "") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message, rank, address)


class WorkerRefusedError(WorkerUnavailableError):
    """The group refused this scheduler's credentials (UNAUTHENTICATED): unusable, like a dead
    one, but a setting to fix rather than a worker to restart."""

    CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def step_refusal(error: BaseException) -> tuple[str, list[str]] | None:
    """(why, the req_ids it names) when `error` is a worker's refusal of a step (INVALID_ARGUMENT
    on ExecuteModel; in process, a StepRefused), which fails only the requests it is about; None
    for any other error."""
    if isinstance(error, StepRefused):
        return str(error), error.req_ids
    if (isinstance(error, WorkerError) and not isinstance(error, WorkerUnavailableError)
            and error.code == grpc.StatusCode.INVALID_ARGUMENT):
        return parse_refusal(error.message)
    return None
