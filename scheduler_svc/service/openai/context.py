"""What every HTTP handler reaches: the Generation servicer (its model and admission path), the
health service, the metrics registry, the served model names and the API keys."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from batchwire.v1 import generate_pb2
from grpc_health.v1 import health_pb2

from scheduler_svc.core.errors import InvalidRequestError
from scheduler_svc.engine.async_engine import RequestStream
from scheduler_svc.service import generation_request
from scheduler_svc.service.generation_servicer import GenerationServicer
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.openai.body import MIN_MAX_REQUEST_BYTES, default_max_request_bytes
from scheduler_svc.service.openai.errors import OpenAIError, renamed
from scheduler_svc.service.security import ApiKeys


@dataclasses.dataclass(slots=True)
class Admitted:
    """One admitted prompt: its n streams, which release() aborts if they still run."""

    request_id: str
    prompt_ids: list[int]  # the prompt as run (after truncate_prompt_tokens)
    streams: list[RequestStream]
    servicer: GenerationServicer

    def release(self) -> None:
        self.servicer.release(self.request_id, self.streams)


@dataclasses.dataclass(slots=True)
class FrontContext:
    servicer: GenerationServicer
    health: Any  # grpc_health's HealthServicer: /health answers what it says
    metrics_registry: Any  # prometheus_client.CollectorRegistry
    version: str
    served_model_names: tuple[str, ...] = ()  # () = the model's own name
    api_keys: ApiKeys | None = None
    request_bytes_limit: int | None = None  # --max-request-bytes; None: sized from the model
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def model(self) -> LoadedModel:
        return self.servicer._loaded()  # NotReadyError (503) while loading

    def max_request_bytes(self) -> int:
        if self.request_bytes_limit is not None:
            return self.request_bytes_limit
        if self.servicer.model is None:  # loading: every route answers 503 anyway
            return MIN_MAX_REQUEST_BYTES
        return default_max_request_bytes(self.servicer.model.max_prompt_chars)

    def names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model().model_name,)

    def check_model(self, name: str | None) -> str:
        """The name a response reports: the one asked for, which must be served (404 if not):
        the base model's, or a LoRA adapter's."""
        names = self.names()
        if name is None or name in names:
            return name or names[0]
        adapters = [lora.lora_name for lora in self.model().loras.listed()]
        if name in adapters:
            return name
        raise OpenAIError(404, f"The model `{name}` does not exist; this server serves "
                          f"{', '.join([*names, *adapters])}", "model", "model_not_found")

    def lora_name(self, model: str) -> str:
        """The adapter a checked `model` names; "" for the base model."""
        return "" if model in self.names() else model

    async def serving(self) -> bool:
        request = health_pb2.HealthCheckRequest(service="")
        reply = await self.health.Check(request, None)  # "" is always known: no abort
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def admit(self, request_id: str, prompt_ids: list[int],
                    sampling: generate_pb2.SamplingParams, names: dict[str, str],
                    priority: int = 0, cache_salt: str | None = None,
                    lora_name: str = "") -> Admitted:
        """A tokenized prompt as Generate's GenerationRequest, admitted on Generate's path; a
        refused field comes back under its HTTP name."""
        try:
            request = await generation_request.for_http(request_id, prompt_ids, sampling,
                                                        self.model(), priority, cache_salt,
                                                        lora_name)
            streams = await self.servicer.admit(request)
        except InvalidRequestError as e:
            raise renamed(e, names) from None
        return Admitted(request_id, request.prompt_as_run, streams, self.servicer)

    async def admit_all(self, request_ids: list[str], prompts: list[list[int]],
                        sampling: generate_pb2.SamplingParams, names: dict[str, str],
                        priority: int = 0, cache_salt: str | None = None,
                        lora_name: str = "") -> list[Admitted]:
        """Several prompts, all or none: a refusal releases the ones already admitted."""
        admitted: list[Admitted] = []
        try:
            for request_id, ids in zip(request_ids, prompts, strict=True):
                admitted.append(await self.admit(request_id, ids, sampling, names, priority,
                                                 cache_salt, lora_name))
                await asyncio.sleep(0)  # a batch's admissions leave the loop to other clients
        except BaseException:
            for a in admitted:
                a.release()
            raise
        return admitted
