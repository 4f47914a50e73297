"""The native CPU decode step (worker_svc/native) against the torch path it replaces.

In float32 both compute from the same weights (the file's Q4_1 and Q8_0 values, de-quantised
exactly). The native step writes each product's input as two int8 digits per group of 32; with
that rounding put on the torch path's projections too (rounded_inputs), a native step's logits
equal the torch path's up to summation order and the rounding's last digit. The step is run
through the model's own forward, as the runner calls it, over rows whose blocks are not
consecutive, from position 0 (the native step writes each token's K/V as it goes). How far the
rounding moves the served model from the float32 reference is measured in
test_quantized_quality.py.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch
from batchwire.kernels import AttentionMetadata
from batchwire.v1 import worker_pb2 as pb

from tests.worker.step_driver import greedy
from tests.worker.test_native_kernels import round_to_digits
from worker_svc.batch.validation import InvalidStepError
from worker_svc.loaders import gguf_file
from worker_svc.loaders.weights import load_weights
from worker_svc.models.forward_context import set_forward_context
from worker_svc.models.llama import LlamaForCausalLM
from worker_svc.native import library
from worker_svc.native.decoder import PROMPT_CONTEXT_LIMIT, NativeAttention, NativeDecoder

# Each more than a block (16 tokens) long, so that the steps cross into a row's second block.
PROMPTS = [
    "The lighthouse keeper climbed the winding stairs at dusk, lit the great lamp, and watched "
    "the ships pass far out beyond the reef until the morning came.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])",
    "Paris is the capital of France, Berlin is the capital of Germany, Madrid is the capital of "
    "Spain, and Rome is the capital of",
]


@pytest.fixture(scope="module")
def float32_native(default_worker):
    """The float32 reference worker with a native step built from the file's stored weights:
    attached to its model for the module's tests, detached after."""
    model = default_worker.model
    reader = gguf_file.GgufFile.open(default_worker.model_path)
    cfg = gguf_file.read_config(reader)
    with torch.device("meta"):
        fresh = LlamaForCausalLM(cfg, model.max_position)
    fresh = fresh.to_empty(device="cpu")
    fresh.tie_weights()
    stored = load_weights(fresh, gguf_file.iter_tensors(reader, cfg, keep_quantized=True))
    # Built on every CPU (its arithmetic is the same with AVX2 only, just slower there).
    native = NativeDecoder.build(model, stored, model.max_position, where_faster=False)
    assert native is not None
    yield default_worker, native, stored
    model.native = None


def decode_metadata(tokens_so_far: list[int], tables: list[list[int]], block: int
                    ) -> AttentionMetadata:
    """One decode row per request: request r's token at position tokens_so_far[r]."""
    rows = len(tokens_so_far)
    positions = np.array(tokens_so_far)
    seq = (positions + 1).astype(np.int32)
    table = np.array(tables, dtype=np.int32)
    slots = table[np.arange(rows), positions // block] * block + positions % block
    qsl = np.arange(rows + 1, dtype=np.int32)
    return AttentionMetadata(
        num_actual_tokens=rows, query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq), block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots.astype(np.int64)), max_query_len=1,
        max_seq_len=int(seq.max()), query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )  # fmt: skip


def step_logits(model, ids: list[int], positions: list[int], metadata) -> torch.Tensor:
    with torch.inference_mode(), set_forward_context(metadata):
        hidden = model(torch.tensor(ids), torch.tensor(positions))
        return model.compute_logits(hidden)


def same_top_token(ours: torch.Tensor, reference: torch.Tensor, tolerance: float) -> bool:
    """Each row's top token is the reference's, or one the reference puts within `tolerance` of
    its top logit: a near-tie that differences within the tolerance may flip (steps of these
    prompts have top-2 margins of 0.0024 in float32)."""
    chosen = reference.gather(-1, ours.argmax(-1, keepdim=True)).squeeze(-1)
    return bool((chosen >= reference.max(-1).values - tolerance).all())


@contextlib.contextmanager
def rounded_inputs(model):
    """The torch path with each projection's input (q|k|v, o, gate|up, down, LM head) rounded
    as the native step rounds it."""
    projections = [model.lm_head] + [module for layer in model.decoder_layers() for module in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
        layer.mlp.down_proj)]
    hooks = [p.register_forward_pre_hook(lambda _, args: (round_to_digits(args[0]),))
             for p in projections]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("rows", [1, 3])
def test_native_steps_give_the_torch_paths_logits_in_float32(float32_native, default_tokenizer,
                                                             rows):
    worker, native, _ = float32_native
    model, block = worker.model, worker.config.block_size
    texts = [default_tokenizer(p).input_ids for p in PROMPTS[:rows]]
    steps = min(len(t) for t in texts)
    assert steps > block
    # Interleaved, non-consecutive blocks: row r holds blocks 1 + r, 1 + r + rows, ...
    tables = [[1 + r + rows * i for i in range(4)] for r in range(rows)]
    worst = 0.0
    for t in range(steps):
        ids = [text[t] for text in texts]
        metadata = decode_metadata([t] * rows, tables, block)
        model.native = None
        with rounded_inputs(model):
            reference = step_logits(model, ids, [t] * rows, metadata)
        model.native = native
        ours = step_logits(model, ids, [t] * rows, metadata)
        assert ours.dtype == torch.float32 and ours.shape == reference.shape
        assert same_top_token(ours, reference, 2e-2), f"step {t}"
        worst = max(worst, float((ours - reference).abs().max()))
    print(f"\n{rows} rows, {steps} steps: largest logit difference {worst:.2e}")
    # Not summation order alone: where the paths' floats differ in the last bit, a low digit
    # rounds the other way now and then, moving an input by 1/16129 of its group's largest
    # value (the LM head's input alone: ~3e-3 on a logit). Measured 7.6e-3 (1 row) over 30
    # layers; a wrong read of the cache or the weights moves logits by whole units.
    assert worst < 2e-2


def prefill_metadata(lengths: list[int], tables: list[list[int]], block: int
                     ) -> AttentionMetadata:
    """Each request's first `length` tokens in one step (the torch path's prefill)."""
    return chunk_metadata([0] * len(lengths), lengths, tables, block)


def chunk_metadata(starts: list[int], ends: list[int], tables: list[list[int]], block: int
                   ) -> AttentionMetadata:
    """Each request's tokens [start, end) in one step, after its first `start` cached."""
    lengths = [e - s for s, e in zip(starts, ends, strict=True)]
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    seq = np.array(ends, dtype=np.int32)
    table = np.array(tables, dtype=np.int32)
    slots = np.concatenate([table[r, np.arange(s, e) // block] * block + np.arange(s, e) % block
                            for r, (s, e) in enumerate(zip(starts, ends, strict=True))])
    return AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq), block_table=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots.astype(np.int64)), max_query_len=max(lengths),
        max_seq_len=max(ends), query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )  # fmt: skip


def test_attention_over_contexts_of_several_chunks(float32_native):
    """Contexts of 300, 129 and 17 tokens (3, 2 and 1 chunks of 128 positions, in blocks laid
    out backwards): one native decode step after a torch prefill gives the torch path's logits,
    its inputs rounded alike."""
    worker, native, _ = float32_native
    model, block = worker.model, worker.config.block_size
    lengths = [300, 129, 17]
    width = -(-(max(lengths) + 1) // block)
    tables = [[1 + r + 3 * (width - 1 - i) for i in range(width)] for r in range(3)]
    torch.manual_seed(1)
    prompts = [torch.randint(100, 10_000, (n,)).tolist() for n in lengths]
    model.native = None
    step_logits(model, sum(prompts, []), [p for n in lengths for p in range(n)],
                prefill_metadata(lengths, tables, block))
    ids, metadata = [7, 8, 9], decode_metadata(lengths, tables, block)
    with rounded_inputs(model):
        reference = step_logits(model, ids, lengths, metadata)
    model.native = native
    ours = step_logits(model, ids, lengths, metadata)
    assert same_top_token(ours, reference, 2e-2)
    assert float((ours - reference).abs().max()) < 2e-2


def last_token_logits(model, ids: list[int], positions: list[int], metadata) -> torch.Tensor:
    """Each request's last token's logits (what the runner samples from) after one step."""
    with torch.inference_mode(), set_forward_context(metadata):
        hidden = model(torch.tensor(ids), torch.tensor(positions))
        last = torch.from_numpy(metadata.query_start_loc_cpu[1:] - 1).long()
        return model.compute_logits(hidden[last]).float()


def test_steps_of_prompt_chunks_and_many_rows_run_between_torchs_products(float32_native,
                                                                         monkeypatch):
    """Twelve prompts in two chunks each (the second attending the first in the cache), then
    one decode step of 12 rows (more than one native call takes): each step's products on the
    torch path, the rest of each layer in C (between), attention reading the cache in place.
    Every step gives the torch path's logits up to summation order. Without the native step (a
    step with adapters), a decode step attends through NativeAttention, alike."""
    worker, native, _ = float32_native
    model, block = worker.model, worker.config.block_size
    lengths = [5, 17, 40, 128, 129, 200, 300, 31, 64, 90, 250, 3]
    rows, width = len(lengths), -(-(max(lengths) + 1) // block)
    tables = [[1 + r + rows * (width - 1 - i) for i in range(width)] for r in range(rows)]
    torch.manual_seed(2)
    prompts = [torch.randint(100, 10_000, (n,)).tolist() for n in lengths]
    halves = [n // 2 for n in lengths]
    first = (sum((p[:h] for p, h in zip(prompts, halves, strict=True)), []),
             [t for h in halves for t in range(h)], prefill_metadata(halves, tables, block))
    second = (sum((p[h:] for p, h in zip(prompts, halves, strict=True)), []),
              [t for h, n in zip(halves, lengths, strict=True) for t in range(h, n)],
              chunk_metadata(halves, lengths, tables, block))
    decode = (list(range(200, 200 + rows)), lengths, decode_metadata(lengths, tables, block))
    between: list[int] = []
    run_between = native.between
    monkeypatch.setattr(native, "between",
                        lambda e, p, md: between.append(len(e)) or run_between(e, p, md))
    logits = {}
    for path in (None, native):  # the second run rewrites the same slots in place
        model.native = path
        logits[path] = [last_token_logits(model, *step) for step in (first, second, decode)]
    assert between == [sum(halves), sum(lengths) - sum(halves), rows]
    for ours, reference in zip(logits[native], logits[None], strict=True):
        assert same_top_token(ours, reference, 2e-3)
        torch.testing.assert_close(ours, reference, rtol=0, atol=2e-3)
    model.native = None
    calls = native_attention(monkeypatch, native, model)
    ours = last_token_logits(model, *decode)
    assert calls == [rows] * len(model.attention_layers())  # every layer, natively
    calls.clear()
    step_logits(model, [1, 2, 3], [0, 1, 2], prefill_metadata([3], [tables[0]], block))
    assert calls == []  # a prompt chunk: the torch kernel
    assert same_top_token(ours, logits[None][2], 2e-3)
    torch.testing.assert_close(ours, logits[None][2], rtol=0, atol=2e-3)


def native_attention(monkeypatch, native, model) -> list[int]:
    """The model's attention layers on NativeAttention until the test ends (monkeypatch puts
    the torch kernels back); returns the rows of each native call, as they come."""
    for attention in model.attention_layers():
        monkeypatch.setattr(attention, "attend", attention.attend)  # restored at teardown
    NativeAttention.install(native, model)
    calls: list[int] = []
    attend = native.attend
    monkeypatch.setattr(native, "attend",
                        lambda layer, q, md: calls.append(md.num_reqs) or attend(layer, q, md))
    return calls


def test_a_prompt_chunk_runs_between_torchs_products_not_in_one_call(float32_native,
                                                                    monkeypatch):
    worker, native, _ = float32_native
    model = worker.model
    model.native = native
    calls: dict[str, list[int]] = {"decode": [], "between": []}
    monkeypatch.setattr(native, "decode", lambda *a: calls["decode"].append(len(a[0])))
    run_between = native.between
    monkeypatch.setattr(native, "between", lambda e, p, md: calls["between"].append(len(e))
                        or run_between(e, p, md))
    block = worker.config.block_size
    logits = step_logits(model, [1, 2, 3, 4], [0, 1, 2, 3],
                         prefill_metadata([4], [[1]], block))
    assert calls == {"decode": [], "between": [4]} and logits.shape[0] == 4
    # A prompt attending past PROMPT_CONTEXT_LIMIT positions: the torch path (faster there).
    long = PROMPT_CONTEXT_LIMIT + 1
    table = [list(range(1, -(-long // block) + 1))]
    with torch.inference_mode(), set_forward_context(prefill_metadata([long], table, block)):
        model(torch.arange(100, 100 + long), torch.arange(long))
    assert calls == {"decode": [], "between": [4]}


def test_without_avx2_the_torch_path_serves(float32_native, monkeypatch, caplog):
    """Where the compiler finds neither AVX-512 VNNI nor AVX2, the step's portable loop is
    slower than the torch path: it is not built there unless asked (where_faster=False, as the
    tests here do)."""
    worker, _, stored = float32_native
    portable = library.load("x86-64")
    monkeypatch.setattr(library, "load", lambda: portable)
    with caplog.at_level(logging.INFO, logger="worker_svc.native.decoder"):
        assert NativeDecoder.build(worker.model, stored, 1024) is None
        assert NativeDecoder.build(worker.model, stored, 1024, where_faster=False) is not None
    assert "native CPU decode off: this CPU has neither AVX-512 VNNI nor AVX2" in caplog.text


def test_float_weights_keep_the_torch_path(default_worker, caplog):
    """The float32 reference serves de-quantised weights: nothing stored quantized, no native
    step (the loader builds none, and says why)."""
    assert "native" not in default_worker.get_info().weights
    with caplog.at_level(logging.INFO, logger="worker_svc.native.decoder"):
        assert NativeDecoder.build(default_worker.model, {}, 1024) is None
    assert "native CPU decode off: layers.0.self_attn.qkv_proj.weight is not stored quantized" \
        in caplog.text


def runner_step(runner, new=(), cached=(), finished=()):
    """One ExecuteModel + SampleTokens; cached: (req_id, new_blocks, computed) decode rows."""
    so = pb.SchedulerOutput(finished_req_ids=list(finished))
    so.scheduled_new_reqs.extend(new)
    for req_id, blocks, computed in cached:
        so.scheduled_cached_reqs.req_ids.append(req_id)
        so.scheduled_cached_reqs.new_block_ids.add().ids.extend(blocks)
        so.scheduled_cached_reqs.num_computed_tokens.append(computed)
        so.scheduled_cached_reqs.num_scheduled_tokens.append(1)
    so.total_num_scheduled_tokens = sum(r.num_scheduled_tokens for r in new) + len(cached)
    out = runner.execute_model(so)
    out = out if out is not None else runner.sample_tokens(None)
    return dict(zip(out.req_ids, ([*t.ids] for t in out.sampled_token_ids), strict=True))


def test_through_the_runner_a_refused_step_and_a_cancelled_request_leave_the_rest_native(
        float32_native, monkeypatch):
    """Two streams decode through ExecuteModel/SampleTokens on the native step; a step the
    worker refuses reaches neither the batch nor the native call, a stream cancelled mid-way
    leaves the other decoding natively, and its tokens are the torch path's."""
    worker, native, _ = float32_native
    runner, model = worker.runner, worker.model
    calls = []
    decode = native.decode
    monkeypatch.setattr(native, "decode", lambda *a: calls.append(len(a[0])) or decode(*a))

    def run(path, prefix: str, first_block: int) -> list[int]:
        model.native = path
        a, b = f"{prefix}a", f"{prefix}b"
        # a's greedy tokens have top-2 margins of 0.07 or more in float32 on the torch path:
        # well above what the native step's rounding moves a logit (< 2e-2, tests above).
        prompts = {a: list(range(40, 48)), b: list(range(10, 18))}
        tokens = runner_step(runner, new=[pb.NewRequestData(
            req_id=r, prompt_token_ids=p, sampling=greedy(), block_ids=[first_block + i],
            num_computed_tokens=0, num_scheduled_tokens=8) for i, (r, p) in
            enumerate(prompts.items())])
        for computed in (8, 9):
            for r, t in runner_step(runner, cached=[(a, [], computed), (b, [], computed)]).items():
                tokens[r] += t
        with pytest.raises(InvalidStepError):  # a block the cache does not have
            runner_step(runner, cached=[(a, [10**9], 10), (b, [], 10)])
        for computed in (10, 11):  # b cancelled: a alone goes on
            tokens[a] += runner_step(runner, cached=[(a, [], computed)],
                                     finished=[b] if computed == 10 else [])[a]
        runner_step(runner, finished=[a])
        return tokens[a]

    native_tokens = run(native, "native-", 1)
    assert calls == [2, 2, 1, 1]  # the decode steps, and nothing of the refused one
    assert native_tokens == run(None, "torch-", 3) and len(native_tokens) == 5
    # Both runs' requests have left the runner (the shared worker may hold other tests' ones).
    assert not [r for r in runner.requests if r.startswith(("native-", "torch-"))]


def test_through_the_runner_ten_streams_decode_natively_past_a_refusal_and_a_cancel(
        float32_native, monkeypatch):
    """Ten streams (more rows than one native call takes) decode through ExecuteModel /
    SampleTokens on NativeDecoder.between: a step the worker refuses reaches none of it, a stream
    cancelled mid-way leaves the other nine decoding there, and every stream's tokens are the
    torch path's (the decode tokens of these prompts have top-2 margins of 0.028 or more in
    float32; the two paths differ by ~2e-5 on a logit)."""
    worker, native, _ = float32_native
    runner, model = worker.runner, worker.model
    calls: list[int] = []
    run_between = native.between
    monkeypatch.setattr(native, "between",
                        lambda e, p, md: calls.append(len(e)) or run_between(e, p, md))

    def run(path, prefix: str, first_block: int) -> dict[str, list[int]]:
        model.native = path
        ids = [f"{prefix}{i}" for i in range(10)]
        tokens = runner_step(runner, new=[pb.NewRequestData(
            req_id=r, prompt_token_ids=list(range(100 + 8 * i, 108 + 8 * i)), sampling=greedy(),
            block_ids=[first_block + i], num_computed_tokens=0, num_scheduled_tokens=8)
            for i, r in enumerate(ids)])
        for computed in (8, 9):
            for r, t in runner_step(runner, cached=[(r, [], computed) for r in ids]).items():
                tokens[r] += t
        with pytest.raises(InvalidStepError):  # a block the cache does not have
            runner_step(runner, cached=[(ids[0], [10**9], 10)] + [(r, [], 10) for r in ids[1:]])
        for computed in (10, 11):  # the last stream cancelled: nine go on
            step = runner_step(runner, cached=[(r, [], computed) for r in ids[:9]],
                               finished=[ids[9]] if computed == 10 else [])
            for r, t in step.items():
                tokens[r] += t
        runner_step(runner, finished=ids[:9])
        return tokens

    reference = run(None, "torch-", 40)
    ours = run(native, "native-", 60)
    # The prompts' step (80 tokens), then decode steps of 10, 10, 9 and 9 rows; the refused one
    # never reaches it.
    assert calls == [80, 10, 10, 9, 9]
    assert [ours[f"native-{i}"] for i in range(10)] == [reference[f"torch-{i}"] for i in range(10)]
    assert [len(ours[f"native-{i}"]) for i in range(10)] == [5] * 9 + [3]
    assert not [r for r in runner.requests if r.startswith(("native-", "torch-"))]
