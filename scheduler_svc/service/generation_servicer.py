"""The Generation service: a thin layer between protobuf and the async engine.

A GenerateRequest is parsed once, into a plain GenerationRequest (generation_request.py), then
admitted; the scheduler that would run it checks what only it knows (its worker group's limits).
A refusal comes back before any step, so a bad request never costs a worker call, and
wire.admission_error names the client's own field.
Errors leave through status_codes.abort_with, the one place that maps them to status codes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from batchwire.v1 import generate_pb2, generate_pb2_grpc

from scheduler_svc.core.errors import InvalidRequestError, RequestIdInUseError
from scheduler_svc.core.lora_request import LoRARequest
from scheduler_svc.core.parallel_sampling import child_params, child_request_id
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.core.tool_calls import read_reply
from scheduler_svc.engine.async_engine import RequestStream
from scheduler_svc.service import generation_request, parallel_sampling, wire
from scheduler_svc.service.embed import embed
from scheduler_svc.service.generation_request import GenerationRequest
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.status_codes import NotReadyError, abort_with
from scheduler_svc.service.tool_wire import tool_calls_pb

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name

_WORKER_STATES = generate_pb2.WorkerState
_STATES = {"ready": _WORKER_STATES.WORKER_STATE_READY,
           "draining": _WORKER_STATES.WORKER_STATE_DRAINING,
           "failed": _WORKER_STATES.WORKER_STATE_FAILED}


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, version: str, max_message_bytes: int) -> None:
        self.version = version
        self.max_message_bytes = max_message_bytes
        self.model: LoadedModel | None = None
        self.draining = False
        self._sequences: dict[str, list[str]] = {}  # n > 1: the client's id -> the engine's ids

    def attach(self, model: LoadedModel) -> None:
        self.model = model

    def _loaded(self) -> LoadedModel:
        if self.model is None:
            raise NotReadyError("the model is still loading: retry once health is SERVING")
        return self.model

    async def Generate(self, msg: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            request = await generation_request.parse(msg, self._loaded())
            streams = await self.admit(request)
        except Exception as e:
            await abort_with(context, e)
        try:
            echo = request.echo
            texts: dict[int, list[str]] = {}  # with tools: each sequence's text so far
            async for out in parallel_sampling.responses(request.request_id, streams,
                                                         request.continuous_usage):
                if echo:
                    wire.add_echo(out, request.prompt_as_run, self._loaded().tokenizer)
                    echo = False
                if request.reads_tool_calls:
                    assert request.tools is not None
                    texts.setdefault(out.index, []).append(out.text)
                    if out.HasField("finish_reason"):
                        reply = read_reply(request.tools, "".join(texts.pop(out.index)))
                        out.tool_calls.extend(tool_calls_pb(reply.calls))
                yield out
        except Exception as e:  # the engine died mid-stream: a status, never text in a message
            await abort_with(context, e)
        finally:
            # A cancelled call or a passed deadline lands here: abort all n, free their blocks.
            self.release(request.request_id, streams)

    def release(self, request_id: str, streams: list[RequestStream]) -> None:
        """Aborts what still runs of an admitted request (all n sequences)."""
        for stream in streams:
            stream.close()
        if len(streams) > 1:
            self._sequences.pop(request_id, None)

    async def admit(self, request: GenerationRequest) -> list[RequestStream]:
        """One stream per sequence (n of them), for either front; the caller reads them and
        must release() them."""
        m = self._loaded()
        request_id, params = request.request_id, request.params
        # NOTE: the engine knows a request of n sequences by its children's ids ("x#0"...), so
        # the client's id is checked against both kinds here, with no await between the check
        # and the engine's (n = 1) or this map's (n > 1) taking of it.
        if request_id in self._sequences or (params.n > 1 and m.engine.holds(request_id)):
            raise RequestIdInUseError(f"request_id {request_id!r} is already in use by an "
                                      "active request")
        if params.n == 1:
            return [await self._add(m, request_id, params, request)]
        children = [child_request_id(request_id, i) for i in range(params.n)]
        self._sequences[request_id] = children
        streams: list[RequestStream] = []
        try:
            for i, child in enumerate(children):
                streams.append(await self._add(m, child, child_params(params, i), request))
        except BaseException:
            del self._sequences[request_id]
            for stream in streams:
                stream.close()
            raise
        return streams

    @staticmethod
    async def _add(m: LoadedModel, request_id: str, params: SamplingParams,
                   request: GenerationRequest) -> RequestStream:
        try:
            return await m.engine.add_request(request_id, request.prompt_ids, params,
                                              priority=request.priority,
                                              cache_salt=request.cache_salt,
                                              lora=request.lora)
        except InvalidRequestError as e:
            raise wire.admission_error(e, request.prompt_field) from None

    async def Embed(self, request: generate_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> generate_pb2.EmbedResponse:
        try:
            m = self._loaded()
            return await embed(m.engine, m.tokenizer, m.task, request)
        except Exception as e:
            await abort_with(context, e)

    async def Abort(self, request: generate_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> generate_pb2.AbortResponse:
        try:
            # A request of n sequences is aborted whole, under the client's id.
            ids = [c for r in request.request_ids for c in self._sequences.get(r, [r])]
            parent = {c: r for r, cs in self._sequences.items() for c in cs}
            found = self._loaded().engine.abort(ids)
            aborted = list(dict.fromkeys(parent.get(i, i) for i in found))
        except Exception as e:
            await abort_with(context, e)
        return generate_pb2.AbortResponse(aborted_request_ids=aborted)

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext
                           ) -> generate_pb2.GetModelInfoResponse:
        try:
            m = self._loaded()
        except Exception as e:
            await abort_with(context, e)
        info = generate_pb2.GetModelInfoResponse(
            model_name=m.model_name, max_model_len=m.max_model_len, vocab_size=m.vocab_size,
            eos_token_ids=m.eos_token_ids, has_chat_template=bool(m.tokenizer.chat_template),
            dtype=m.dtype, task=m.task, pooling_type=m.pooling_type,
            embedding_size=m.hidden_size if m.task == "embed" else 0, weights=m.weights,
            sampling_defaults_source=m.generation_config.source,
            lora_adapters=[_adapter(lora) for lora in m.loras.listed()],
            max_loras=m.loras.max_loras)
        for name, value in m.generation_config.in_force().items():
            setattr(info.sampling_defaults, name, value)
        bos = getattr(m.tokenizer, "bos_token_id", None)
        if bos is not None:
            info.bos_token_id = bos
        return info

    async def GetServerInfo(self, request: generate_pb2.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext
                            ) -> generate_pb2.GetServerInfoResponse:
        info = generate_pb2.GetServerInfoResponse(version=self.version, draining=self.draining)
        info.limits.max_message_bytes = self.max_message_bytes
        m = self.model
        if m is None:
            info.workers.add(address="", state=_WORKER_STATES.WORKER_STATE_LOADING)
            return info
        stats = m.engine.stats
        info.batch_invariant = m.batch_invariant()
        for w in m.workers():
            state = ("failed" if m.engine.dead is not None
                     else "draining" if self.draining else w.state)
            info.workers.add(address=w.address, state=_STATES[state], device=w.device,
                             tensor_parallel_size=w.tensor_parallel_size)
        info.kv_blocks_total = stats.kv_blocks_total
        info.kv_blocks_used = stats.kv_blocks_used
        info.block_size = m.config.block_size
        info.num_running_requests = stats.num_running
        info.num_waiting_requests = stats.num_waiting
        info.transport = m.transport
        limits = info.limits
        limits.max_model_len = m.max_model_len
        limits.max_num_seqs = m.max_num_seqs
        limits.max_num_batched_tokens = m.max_num_batched_tokens
        limits.max_queued_requests = m.config.max_queued_requests
        limits.max_logprobs = m.config.max_logprobs
        limits.max_n = m.config.max_n
        limits.max_stop_strings = m.config.max_stop_strings
        limits.max_stop_chars = m.config.max_stop_chars
        limits.max_token_ids = m.config.max_token_ids
        if m.config.speculative_method is not None:
            spec = info.speculative_decoding
            spec.method = m.config.speculative_method
            spec.num_speculative_tokens = m.config.num_speculative_tokens
            spec.num_drafts = stats.num_spec_requests
            spec.num_draft_tokens = stats.num_draft_tokens
            spec.num_accepted_tokens = stats.num_accepted_tokens
            spec.drafted_per_position.extend(stats.drafted_per_position)
            spec.accepted_per_position.extend(stats.accepted_per_position)
        return info

    async def Tokenize(self, request: generate_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.TokenizeResponse:
        try:
            m = self._loaded()
            add = request.add_special_tokens if request.HasField("add_special_tokens") else None
            _, ids = await generation_request.tokenized(request, m.tokenizer, add)
        except Exception as e:
            await abort_with(context, e)
        return generate_pb2.TokenizeResponse(token_ids=ids)

    async def LoadLoRAAdapter(self, request: generate_pb2.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext
                              ) -> generate_pb2.LoadLoRAAdapterResponse:
        try:
            lora = self._loaded().loras.load(request.lora_name, request.lora_path)
        except Exception as e:
            await abort_with(context, e)
        return generate_pb2.LoadLoRAAdapterResponse(adapter=_adapter(lora))

    async def UnloadLoRAAdapter(self, request: generate_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext
                                ) -> generate_pb2.UnloadLoRAAdapterResponse:
        try:
            self._loaded().loras.unload(request.lora_name, request.lora_path)
        except Exception as e:
            await abort_with(context, e)
        return generate_pb2.UnloadLoRAAdapterResponse()

    async def ListLoRAAdapters(self, request: generate_pb2.ListLoRAAdaptersRequest,
                               context: grpc.aio.ServicerContext
                               ) -> generate_pb2.ListLoRAAdaptersResponse:
        try:
            m = self._loaded()
        except Exception as e:
            await abort_with(context, e)
        return generate_pb2.ListLoRAAdaptersResponse(
            adapters=[_adapter(lora) for lora in m.loras.listed()])

    async def Detokenize(self, request: generate_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.DetokenizeResponse:
        try:
            m = self._loaded()
            text = wire.detokenize(request, m.tokenizer, m.vocab_size)
        except Exception as e:
            await abort_with(context, e)
        return generate_pb2.DetokenizeResponse(text=text)


def _adapter(lora: LoRARequest) -> generate_pb2.LoRAAdapter:
    return generate_pb2.LoRAAdapter(name=lora.lora_name, path=lora.lora_path,
                                    id=lora.lora_int_id)
