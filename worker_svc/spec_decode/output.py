"""Records a verifying step's kept tokens in the persistent batch and builds the reply."""

from __future__ import annotations

from batchwire.v1 import worker_pb2

from worker_svc.batch.input_batch import InputBatch
from worker_svc.spec_decode.rejection_sampler import RejectionSamplerOutput


def record_verified(
    batch: InputBatch, result: RejectionSamplerOutput
) -> worker_pb2.ModelRunnerOutput:
    """Appends each request's kept tokens one by one, as plain decode steps would have.

    Logprobs go in token_logprobs, one entry per kept token, since a request may keep several.
    """
    num_reqs = batch.num_reqs
    out = worker_pb2.ModelRunnerOutput()
    out.req_ids.extend(batch.req_ids[:num_reqs])  # type: ignore[arg-type]
    states = batch.states[:num_reqs]
    for row, tokens in enumerate(result.token_ids):
        out.sampled_token_ids.add().ids.extend(tokens)
        state = states[row]
        assert state is not None
        state.output_token_ids.extend(tokens)
        for token in tokens:
            batch.append_token(row, token)

    want = [s is not None and s.sampling.HasField("logprobs") for s in states]
    logprobs = result.logprobs
    if logprobs is None or not any(want):
        return out
    ids, values = logprobs.token_ids.tolist(), logprobs.logprobs.tolist()
    ranks = logprobs.sampled_rank.tolist()
    for row, tokens in enumerate(result.token_ids):
        entry = out.token_logprobs.add()
        state = states[row]
        if not want[row] or state is None:
            continue
        n = 1 + state.sampling.logprobs
        first = int(result.first_logits_rows[row])
        for logits_row in range(first, first + len(tokens)):
            position = entry.positions.add(sampled_token_rank=ranks[logits_row])
            position.token_ids.extend(ids[logits_row][:n])
            position.logprobs.extend(values[logits_row][:n])
    return out
