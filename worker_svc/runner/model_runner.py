"""The model runner: diffs the persistent batch, lays out the inputs, runs the model, samples.

One step is two calls. execute_model() runs the forward pass, parks the logits and returns None;
sample_tokens() unparks them, applies the grammar bitmask and samples. The scheduler builds the
bitmask on its CPU in the window between the two.

The protobuf SchedulerOutput is read directly here, on the hot path, instead of being copied into
dataclasses first: at 256 running requests the copy would cost more than the diff it feeds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from batchwire import kernels
from batchwire.common.worker_config import WorkerConfig
from batchwire.kernels import AttentionMetadata
from batchwire.v1 import worker_pb2

from worker_svc.batch.input_batch import CachedRequestState, InputBatch
from worker_svc.batch.staging import InputFence, host_buffer
from worker_svc.batch.validation import (
    CheckedStep,
    InvalidStepError,
    StepLimits,
    validate_grammar_output,
    validate_scheduler_output,
)
from worker_svc.lora.slots import LoRASlots
from worker_svc.lora.step_adapters import load_step_adapters, token_slot_mask
from worker_svc.models.forward_context import set_forward_context
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.parallel.pipeline import IntermediateTensors
from worker_svc.pooling.pooler import Pooler
from worker_svc.runner.prompt_logprobs import attach_prompt_logprobs, compute_prompt_logprobs
from worker_svc.sample.sampled_wire import SampledTokensEncoder
from worker_svc.sample.sampler import Sampler, SamplerOutput
from worker_svc.spec_decode.metadata import (
    SpecDecodeMetadata,
    build_spec_decode_metadata,
    stage_draft_tokens,
)
from worker_svc.spec_decode.output import record_verified
from worker_svc.spec_decode.rejection_sampler import RejectionSampler


@dataclasses.dataclass(slots=True)
class ExecuteModelState:
    """Parked between execute_model() and sample_tokens()."""

    scheduler_output: worker_pb2.SchedulerOutput
    # [num_reqs, vocab] float32, one row per request in batch order; with drafts
    # [num_drafts + num_reqs, vocab], laid out as spec says
    logits: torch.Tensor
    discard: np.ndarray  # [num_reqs] bool: rows still mid-prefill, whose samples are dropped
    prompt_logprobs: dict[int, worker_pb2.PromptLogprobs]  # row -> this step's prompt positions
    spec: SpecDecodeMetadata | None = None  # the step's draft layout; None = no drafts


class ModelRunner:
    def __init__(self, config: WorkerConfig, model: LlamaForCausalLM, num_blocks: int) -> None:
        self.config = config
        self.model = model
        self.device = torch.device(config.device)
        self.vocab_size = model.config.vocab_size
        self.limits = StepLimits(
            self.vocab_size, num_blocks, config.block_size, config.max_model_len,
            config.max_num_reqs, config.max_num_batched_tokens, config.max_logprobs,
            samples=config.task != "embed",
        )  # fmt: skip
        self.requests: dict[str, CachedRequestState] = {}  # every request held, batched or not
        self.input_batch = InputBatch(
            config.max_num_reqs, config.max_model_len, config.max_num_batched_tokens,
            config.block_size, self.vocab_size, self.device,
        )  # fmt: skip
        shared_generator = torch.Generator(device=self.device)
        shared_generator.manual_seed(config.seed)
        self.sampler = Sampler(shared_generator)  # for requests that bring no seed
        self.rejection_sampler = RejectionSampler(self.sampler)  # for steps with drafts
        self.execute_model_state: ExecuteModelState | None = None
        self.prompt_logprobs_reqs: set[str] = set()  # held requests that asked for them
        self.pooler = (
            Pooler(config.pooling_type, config.normalize, model.config.hidden_size)
            if config.task == "embed"
            else None
        )
        # Buffers sized once for the largest step; each step overwrites a prefix.
        max_tokens, max_reqs = config.max_num_batched_tokens, config.max_num_reqs
        self.arange_np = np.arange(max(max_tokens, max_reqs) + 1, dtype=np.int64)
        # Pinned on CUDA, for asynchronous copies fenced by input_fence (staging.py).
        self.positions = host_buffer(max_tokens, torch.int64, self.device)  # [tokens]
        self.positions_np = self.positions.numpy()
        self.input_ids = host_buffer(max_tokens, torch.int32, self.device)  # [tokens]
        self.query_start_loc_np = host_buffer(max_reqs + 1, torch.int32, self.device).numpy()
        self.seq_lens_np = host_buffer(max_reqs, torch.int32, self.device).numpy()  # [reqs]
        self.input_fence = InputFence(self.device)
        self._sampled_encoder = SampledTokensEncoder()
        self.lora_slots = (
            LoRASlots(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
            if config.max_loras
            else None
        )
        self.lora_mask: torch.Tensor | None = None  # the step's (tokens, max_loras) slot mask
        self.lora_dtype = next(model.parameters()).dtype


    def execute_model(self, so: worker_pb2.SchedulerOutput) -> worker_pb2.ModelRunnerOutput | None:
        if self.execute_model_state is not None:
            raise RuntimeError("sample_tokens() must be called after execute_model() returns None")
        checked = validate_scheduler_output(
            so, self.requests, self.limits, not self.model.stage.is_last
        )
        if self.lora_slots is not None or so.scheduled_new_reqs:
            load_step_adapters(self.lora_slots, so, checked.cached_req_ids, self.requests)
        if self.pooler is not None:
            self.pooler.begin_step(so)
        self.input_fence.wait()  # the last step's copies have read the host buffers
        self._update_states(so, checked)
        if so.total_num_scheduled_tokens == 0:
            return worker_pb2.ModelRunnerOutput()
        logits_indices, discard, metadata, spec = self._prepare_inputs(so, checked.cached_req_ids)
        num_tokens = so.total_num_scheduled_tokens
        with torch.inference_mode(), set_forward_context(metadata, self.lora_mask):
            hidden = self._run_stage(num_tokens)
            self.input_fence.record()  # after the copies of this step's inputs
            if hidden is None:  # a stage before the last: its output went to the next stage
                return worker_pb2.ModelRunnerOutput()
            if self.pooler is not None:  # a pooling model answers now and parks nothing
                return self._pooled_output(hidden, discard)
            logits = self.model.compute_logits(hidden[logits_indices])  # [num_logits, vocab]
            prompt_logprobs = {}
            if self.prompt_logprobs_reqs:
                batch = self.input_batch
                prompt_logprobs = compute_prompt_logprobs(
                    hidden, self.model.compute_logits, batch.states[: batch.num_reqs],
                    batch.num_computed_tokens_np[: batch.num_reqs],
                    self._num_scheduled_per_row(so),
                )  # fmt: skip
        self.execute_model_state = ExecuteModelState(so, logits, discard, prompt_logprobs, spec)
        return None

    def sample_tokens(
        self, grammar: worker_pb2.GrammarOutput | None
    ) -> worker_pb2.ModelRunnerOutput:
        state = self.execute_model_state
        if state is None:
            return worker_pb2.ModelRunnerOutput()
        batch = self.input_batch
        if grammar is not None and grammar.req_ids:
            drafted = [e.req_id for e in state.scheduler_output.scheduled_spec_decode_tokens]
            validate_grammar_output(grammar, batch.req_id_to_index, self.vocab_size, drafted)
        self.execute_model_state = None
        logits = state.logits
        with torch.inference_mode():
            if grammar is not None and grammar.req_ids:
                rows_np = np.array([batch.req_id_to_index[r] for r in grammar.req_ids])
                if state.spec is not None:  # an undrafted request's one row is its bonus row
                    rows_np = state.spec.bonus_logits_indices[rows_np]
                rows = self._on_device(torch.from_numpy(rows_np))
                words = np.frombuffer(grammar.bitmask, dtype="<i4").reshape(
                    len(grammar.req_ids), -1
                )
                bitmask = self._on_device(torch.from_numpy(words.copy()))
                kernels.apply_token_bitmask(logits, bitmask, rows)
            metadata = batch.sampling_metadata
            if state.spec is not None:
                verified = self.rejection_sampler(logits, metadata, state.spec, state.discard)
                return record_verified(batch, verified)
            # A mid-prefill row's draw is thrown away; rewind its generator so a seeded request's
            # tokens do not depend on how its prefill was chunked.
            rewind = {
                row: g.get_state() for row, g in metadata.generators.items() if state.discard[row]
            }
            sampled = self.sampler(logits, metadata)
            for row, generator_state in rewind.items():
                metadata.generators[row].set_state(generator_state)
        out = self._record_sampled(sampled, state.discard)
        attach_prompt_logprobs(out, state.prompt_logprobs)
        return out

    def reset(self) -> None:
        """Forgets every request and any parked step."""
        for req_id in list(self.requests):
            self.input_batch.remove_request(req_id)
        self.requests.clear()
        self.prompt_logprobs_reqs.clear()
        self.input_batch.condense()
        self.execute_model_state = None
        if self.pooler is not None:
            self.pooler.reset()


    def _update_states(
        self, so: worker_pb2.SchedulerOutput, checked: CheckedStep | None = None
    ) -> None:
        """checked: what validation read of so (None: read it here)."""
        batch = self.input_batch
        # Finished requests leave for good: the runner's record and the batch row.
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs_reqs.discard(req_id)
            batch.remove_request(req_id)

        # Held but not scheduled this step (preempted, or skipped): leave the batch, keep the state.
        # Resumed requests count as unscheduled here so the resume path below re-adds them cleanly.
        cached = so.scheduled_cached_reqs
        req_ids = list(cached.req_ids) if checked is None else checked.cached_req_ids
        scheduled = {r.req_id for r in so.scheduled_new_reqs}
        scheduled.update(req_ids)
        scheduled.difference_update(cached.resumed_req_ids)
        for req_id in batch.req_id_to_index.keys() - scheduled:
            batch.remove_request(req_id)
        if not self.model.stage.is_last:
            self._append_new_tokens(so)

        to_add: list[CachedRequestState] = []
        for new in so.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling=new.sampling,
                generator=self._generator(new.sampling, len(new.output_token_ids)),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=list(new.output_token_ids),
                lora_id=new.lora.id,
            )
            self.requests[new.req_id] = state
            if new.sampling.HasField("prompt_logprobs"):
                self.prompt_logprobs_reqs.add(new.req_id)
            to_add.append(state)

        # The common path, a running request decoding on: two writes into its existing row.
        # The state's computed count is synced from the row only when the row goes away.
        resumed = set(cached.resumed_req_ids)
        index = batch.req_id_to_index
        if checked is not None and checked.no_new_blocks and not resumed:
            rows = [index.get(r, -1) for r in req_ids]
            if -1 not in rows:  # all in the batch, no block added: one write in all
                batch.num_computed_tokens_np[rows] = np.fromiter(
                    cached.num_computed_tokens, np.int32, len(rows)
                )
                for state in to_add:
                    batch.add_request(state)
                batch.condense()
                return
        rows, positions = [], []
        for i, (req_id, blocks) in enumerate(zip(req_ids, cached.new_block_ids, strict=True)):
            row = index.get(req_id)
            if row is not None:
                rows.append(row)
                positions.append(i)
                if blocks.ids:
                    self.requests[req_id].block_ids.extend(blocks.ids)
                    batch.block_table.append_row(list(blocks.ids), row)
                continue
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if req_id in resumed:
                state.block_ids = list(blocks.ids)  # it lost its blocks: these are the whole table
            else:
                state.block_ids.extend(blocks.ids)
            to_add.append(state)
        if rows:
            computed = np.asarray(cached.num_computed_tokens, dtype=np.int32)
            batch.num_computed_tokens_np[rows] = computed[positions]

        for state in to_add:
            batch.add_request(state)
        batch.condense()

    def _append_new_tokens(self, so: worker_pb2.SchedulerOutput) -> None:
        """A stage before the last samples nothing: the scheduler sends it the tokens sampled."""
        batch = self.input_batch
        cached = so.scheduled_cached_reqs
        for req_id, tokens in zip(cached.req_ids, so.cached_new_token_ids, strict=True):
            self.requests[req_id].output_token_ids.extend(tokens.ids)
            row = batch.req_id_to_index.get(req_id)
            if row is not None:  # else the row is rebuilt from the state when it is re-added
                for token in tokens.ids:
                    batch.append_token(row, token)

    def _generator(
        self, sampling: worker_pb2.RequestSamplingParams, num_drawn: int
    ) -> torch.Generator | None:
        """A seeded request's generator, past the `num_drawn` draws of a worker it moved from."""
        if not sampling.HasField("seed"):
            return None
        generator = torch.Generator(device=self.device)  # on the logits' device
        generator.manual_seed(sampling.seed)
        if num_drawn and sampling.temperature > 0:
            self.sampler.skip_draws(generator, self.vocab_size, num_drawn)
        return generator


    def _num_scheduled_per_row(
        self, so: worker_pb2.SchedulerOutput, cached_req_ids: list[str] | None = None
    ) -> np.ndarray:
        """cached_req_ids: so.scheduled_cached_reqs.req_ids as a list, when the caller has it."""
        batch = self.input_batch
        counts = np.zeros(batch.num_reqs, dtype=np.int64)  # [reqs]
        for new in so.scheduled_new_reqs:
            counts[batch.req_id_to_index[new.req_id]] = new.num_scheduled_tokens
        cached = so.scheduled_cached_reqs
        index = batch.req_id_to_index
        rows = [index[r] for r in (cached.req_ids if cached_req_ids is None else cached_req_ids)]
        counts[rows] = np.fromiter(cached.num_scheduled_tokens, np.int64, len(rows))
        return counts

    def _prepare_inputs(
        self, so: worker_pb2.SchedulerOutput, cached_req_ids: list[str] | None = None
    ) -> tuple[torch.Tensor, np.ndarray, AttentionMetadata, SpecDecodeMetadata | None]:
        batch = self.input_batch
        num_reqs, num_tokens = batch.num_reqs, so.total_num_scheduled_tokens
        num_scheduled = self._num_scheduled_per_row(so, cached_req_ids)  # [reqs]
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled)  # [tokens]
        cu_num_tokens = np.cumsum(num_scheduled)  # [reqs]
        # Offset of each token inside its request's slice of this step: 0, 1, .. per request.
        query_pos = self.arange_np[:num_tokens] - np.repeat(
            cu_num_tokens - num_scheduled, num_scheduled
        )
        computed = batch.num_computed_tokens_np[:num_reqs]
        positions = self.positions_np[:num_tokens]
        np.add(computed[req_indices], query_pos, out=positions)

        num_drafts = stage_draft_tokens(so, batch)  # [reqs]; None = no drafts this step
        # One gather pulls every scheduled token id out of the [rows, max_model_len] buffer.
        token_indices = torch.from_numpy(positions + req_indices * batch.token_ids_np.shape[1])
        torch.index_select(
            batch.token_ids.view(-1), 0, token_indices, out=self.input_ids[:num_tokens]
        )

        query_start_loc = self.query_start_loc_np
        query_start_loc[0] = 0
        query_start_loc[1 : num_reqs + 1] = cu_num_tokens
        query_start_loc[num_reqs + 1 :] = num_tokens  # padded non-decreasing for the kernels
        seq_lens = self.seq_lens_np[:num_reqs]
        # Optimistic with drafts: as if every draft will be accepted.
        np.add(computed, num_scheduled, out=seq_lens)
        # Rows that will still be short of their tokens after this step are mid-prefill.
        discard = seq_lens < batch.num_tokens_np[:num_reqs]  # [reqs]
        spec = None
        if num_drafts is None:
            logits_indices = self._on_device(torch.from_numpy(cu_num_tokens - 1))  # [reqs] last
        else:
            spec = build_spec_decode_metadata(
                num_drafts, cu_num_tokens, self.input_ids[:num_tokens]
            )
            logits_indices = self._on_device(spec.logits_indices)  # [drafts + reqs]

        slot_mapping = batch.block_table.compute_slot_mapping(req_indices, positions)
        self.lora_mask = token_slot_mask(
            self.lora_slots, batch.lora_ids_np[:num_reqs], req_indices,
            self.lora_dtype, self.device,
        )  # fmt: skip
        max_seq_len = int(seq_lens.max())
        metadata = AttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=self._on_device(torch.from_numpy(query_start_loc[: num_reqs + 1])),
            seq_lens=self._on_device(torch.from_numpy(seq_lens)),
            block_table=self._on_device(batch.block_table.rows(num_reqs)),
            slot_mapping=self._on_device(slot_mapping),
            max_query_len=int(num_scheduled.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc[: num_reqs + 1],
            seq_lens_cpu=seq_lens,
        )
        return logits_indices, discard, metadata, spec

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        """The step's inputs are laid out in host buffers; an accelerator gets one copy of each."""
        if self.device.type == "cpu":
            return host
        return host.to(self.device, non_blocking=True)

    def _run_stage(self, num_tokens: int) -> torch.Tensor | None:
        """This stage's layers: hidden states (T, hidden) on the last stage; None on the others,
        which receive the previous stage's stream (not the first) and send theirs on."""
        stage = self.model.stage
        intermediate = None
        if not stage.is_first:
            dtype = getattr(torch, self.config.dtype)
            hidden_size = self.model.config.hidden_size
            intermediate = stage.recv_previous(num_tokens, hidden_size, dtype, self.device)
        out = self.model(
            self._on_device(self.input_ids[:num_tokens]),
            self._on_device(self.positions[:num_tokens]),
            intermediate,
        )
        if isinstance(out, IntermediateTensors):
            stage.send_next(out)
            return None
        return out

    def _pooled_output(
        self, hidden: torch.Tensor, discard: np.ndarray
    ) -> worker_pb2.ModelRunnerOutput:
        """One vector per request whose input ends this step; empty entries for the others."""
        assert self.pooler is not None
        batch = self.input_batch
        num_reqs = batch.num_reqs
        req_ids = [r for r in batch.req_ids[:num_reqs] if r is not None]
        vectors = self.pooler.pool(
            hidden, req_ids, self.query_start_loc_np[: num_reqs + 1],
            batch.num_computed_tokens_np[:num_reqs], ~discard,
        )  # fmt: skip
        out = worker_pb2.ModelRunnerOutput(req_ids=req_ids)
        for vector in vectors:
            out.sampled_token_ids.add()
            entry = out.pooler_output.add()
            if vector is not None:
                entry.values.extend(vector.cpu().tolist())
        return out


    def _record_sampled(
        self, sampled: SamplerOutput, discard: np.ndarray
    ) -> worker_pb2.ModelRunnerOutput:
        """Appends each kept token to its request and builds the reply; discarded rows get []."""
        batch = self.input_batch
        tokens_np = sampled.sampled_token_ids.cpu().numpy()  # [reqs]
        tokens = tokens_np.tolist()
        discard = discard[: len(tokens)]
        out = worker_pb2.ModelRunnerOutput()
        req_ids = batch.req_ids[: batch.num_reqs]
        out.req_ids.extend(req_ids)  # type: ignore[arg-type]
        out.MergeFromString(self._sampled_encoder.encode(tokens, discard.tolist()))
        kept = np.flatnonzero(~discard)  # [kept rows]
        states = batch.states
        for row in kept.tolist():
            states[row].output_token_ids.append(tokens[row])  # type: ignore[union-attr]
        ends = batch.num_tokens_np[kept]
        batch.token_ids_np[kept, ends] = tokens_np[kept]
        batch.num_tokens_np[kept] = ends + 1
        logprobs = sampled.logprobs
        if logprobs is None:
            return out
        want_logprobs = [
            s is not None and s.sampling.HasField("logprobs") for s in batch.states[: len(tokens)]
        ]
        if any(want_logprobs):
            ids, values, ranks = (
                logprobs.token_ids.tolist(),
                logprobs.logprobs.tolist(),
                logprobs.sampled_rank.tolist(),
            )
            for row in range(len(tokens)):
                entry = out.logprobs.add()
                state = batch.states[row]
                if discard[row] or not want_logprobs[row] or state is None:
                    continue
                n = 1 + state.sampling.logprobs
                entry.token_ids.extend(ids[row][:n])
                entry.logprobs.extend(values[row][:n])
                entry.sampled_token_rank = ranks[row]
        return out


__all__ = ["ModelRunner", "InvalidStepError"]
