"""The one place where an error becomes a gRPC status code."""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from scheduler_svc.core.errors import (
    InvalidRequestError,
    QueueFullError,
    RequestIdInUseError,
    WrongTaskError,
)
from scheduler_svc.engine.async_engine import EngineDeadError, NotAdmittingError
from scheduler_svc.executors.errors import WorkerError, WorkerUnavailableError
from scheduler_svc.service.lora_adapters import UnknownAdapterError

logger = logging.getLogger(__name__)


class NotReadyError(RuntimeError):
    """The model is still loading."""


class ServerStoppingError(RuntimeError):
    """The server was told to stop now (a second SIGINT or SIGTERM) while the request ran."""


_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestIdInUseError, grpc.StatusCode.ALREADY_EXISTS),
    (UnknownAdapterError, grpc.StatusCode.NOT_FOUND),  # a LoRA name not loaded
    (WrongTaskError, grpc.StatusCode.FAILED_PRECONDITION),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE),
    (NotAdmittingError, grpc.StatusCode.UNAVAILABLE),
    (ServerStoppingError, grpc.StatusCode.UNAVAILABLE),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (WorkerUnavailableError, grpc.StatusCode.UNAVAILABLE),  # no worker (replica) left for it
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    for kind, code in _CODES:
        if isinstance(error, kind):
            return code, _message(error)
    logger.exception("internal error", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"


def _message(error: BaseException) -> str:
    """The error's words without its code: a worker's error says "worker: UNAVAILABLE: ..."
    where the status names UNAVAILABLE already."""
    if isinstance(error, WorkerError):
        where = "" if error.rank is None else f"worker rank {error.rank} at {error.address}: "
        return where + error.message
    return str(error)


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> NoReturn:
    code, message = status_for(error)
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # for type checkers
