"""Generation.Embed on real `batchwire serve --task embed` processes, float32: vectors equal
transformers' final hidden states, mean-pooled by one server and last-pooled by another (the
pooling type is the server's), normalised, for a text chunked across steps and a batch of mixed
lengths; each bad input gets its status, naming the field, and the server serves the next request.

Both serve the tiny Llama: what a server adds to the worker's pooling (tokenizing, chunking inputs
across steps, batching, usage, the OpenAI route) does not depend on the weights, and the default
model's vectors, mean- and last-pooled, are compared with transformers' once, in the worker
(tests/worker/test_pooler.py::test_default_model_matches_transformers)."""

from __future__ import annotations

import grpc
import pytest
import torch
import torch.nn.functional as F
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import ServerProcess

pytestmark = pytest.mark.slow

# A 64-token step budget chunks any input longer than that; 64 requests may run at once.
EMBED_ARGS = ("--task", "embed", "--max-model-len", "1024", "--max-num-batched-tokens", "64",
              "--max-num-seqs", "64", "--kv-cache-memory", "128M")
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly box "
         "frogs near an old river bank").split()
MIN_COSINE = 0.9999
SIZE = 64  # the tiny Llama's hidden size (tests/conftest.py)


def text_of(n_words: int, offset: int = 0) -> str:
    return " ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_llama_with_tokenizer):
    """A mean-pooling and a last-pooling server of the tiny Llama, loading side by side."""
    started = {
        pooling: ServerProcess(tmp_path_factory.mktemp(f"embed-{pooling}"), *EMBED_ARGS,
                               "--pooling-type", pooling, "--model", tiny_llama_with_tokenizer)
        for pooling in ("mean", "last")
    }
    try:
        for server in started.values():
            server.wait_serving()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def hf_base(tiny_llama_with_tokenizer):
    """transformers' decoder of the tiny Llama without the LM head: final (normed) states."""
    from transformers import AutoModelForCausalLM

    tiny = AutoModelForCausalLM.from_pretrained(tiny_llama_with_tokenizer, dtype=torch.float32)
    return tiny.eval().model


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_with_tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_with_tokenizer)


def reference(hf_base, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_base(torch.tensor([ids])).last_hidden_state[0]  # (T, hidden)
    vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return F.normalize(vector, dim=0)


def embed(server: ServerProcess, **fields) -> generate_pb2.EmbedResponse:
    return server.stub.Embed(generate_pb2.EmbedRequest(**fields), timeout=300)


def assert_close(response, hf_base, batch: list[list[int]], pooling: str, size: int) -> None:
    assert [e.index for e in response.embeddings] == list(range(len(batch)))
    for ids, e in zip(batch, response.embeddings, strict=True):
        ours = torch.tensor(list(e.values))
        assert ours.shape == (size,)
        assert abs(float(ours.norm()) - 1) < 1e-4
        cosine = float(ours @ reference(hf_base, ids, pooling))
        assert cosine >= MIN_COSINE, f"{len(ids)} tokens: cosine {cosine:.6f}"


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embed_matches_transformers_with_a_chunked_text(servers, hf_base, tokenizer, pooling):
    server = servers[pooling]
    size = SIZE
    info = server.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.task, info.pooling_type, info.embedding_size) == ("embed", pooling, size)
    texts = ["The capital of France is Paris.", text_of(90), "def fibonacci(n):"]
    batch = [tokenizer(t).input_ids for t in texts]
    assert len(batch[1]) > 64  # more than one step's budget: pooled across chunks
    response = embed(server, request_id="chunked", texts=texts)
    assert_close(response, hf_base, batch, pooling, size)
    assert response.usage.prompt_tokens == sum(len(ids) for ids in batch)
    # The same inputs as token ids, truncated and not normalised.
    raw = embed(server, token_ids=[generate_pb2.EmbedTokenIds(ids=ids) for ids in batch],
                dimensions=SIZE // 2, normalize=False)
    for full, short in zip(response.embeddings, raw.embeddings, strict=True):
        short_values = torch.tensor(list(short.values))
        assert short_values.shape == (SIZE // 2,)
        assert abs(float(short_values.norm()) - 1) > 1e-3  # not normalised
        assert float(F.cosine_similarity(short_values, torch.tensor(full.values[:SIZE // 2]),
                                         dim=0)) >= MIN_COSINE
    assert server.wait_idle().kv_blocks_used == 0  # every request's blocks freed once pooled


def test_a_batch_of_mixed_lengths(servers, hf_base, tokenizer):
    # 24 inputs of 3 to 52 words through a 64-token step budget: chunked and batched together
    # (64 inputs took ~110 s of the suite and showed nothing more).
    texts = [text_of(3 + (37 * i) % 50, offset=i) for i in range(24)]
    batch = [tokenizer(t).input_ids for t in texts]
    response = embed(servers["mean"], texts=texts)
    # The reference in one right-padded batch: a causal model's real tokens never see the pads.
    longest = max(len(ids) for ids in batch)
    ids = torch.tensor([x + [0] * (longest - len(x)) for x in batch])
    mask = torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in batch])
    with torch.no_grad():
        hidden = hf_base(ids, attention_mask=mask).last_hidden_state  # (24, T, hidden)
    expected = F.normalize((hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True), dim=1)
    ours = torch.tensor([list(e.values) for e in response.embeddings])  # (24, hidden)
    cosines = (ours * expected).sum(1)
    assert float(cosines.min()) >= MIN_COSINE, cosines


BAD = [
    (dict(), grpc.StatusCode.INVALID_ARGUMENT, "texts"),
    (dict(texts=["fine", ""]), grpc.StatusCode.INVALID_ARGUMENT, "texts[1]"),
    (dict(token_ids=[generate_pb2.EmbedTokenIds(ids=[])]), grpc.StatusCode.INVALID_ARGUMENT,
     "token_ids[0]"),
    (dict(token_ids=[generate_pb2.EmbedTokenIds(ids=[5] * 1024)]),
     grpc.StatusCode.INVALID_ARGUMENT, "token_ids[0]"),
    (dict(texts=["x"], dimensions=SIZE + 1), grpc.StatusCode.INVALID_ARGUMENT, "dimensions"),
]


@pytest.mark.parametrize(("fields", "code", "field"), BAD)
def test_bad_embed_input_gets_a_status_and_the_next_request_is_served(servers, fields, code,
                                                                      field):
    server = servers["last"]
    with pytest.raises(grpc.RpcError) as info:
        embed(server, **fields)
    assert info.value.code() == code
    assert info.value.details().startswith(field), info.value.details()
    assert len(embed(server, texts=["next"]).embeddings[0].values) == SIZE


@pytest.mark.parametrize(("sampling", "code", "field"), [
    (None, grpc.StatusCode.FAILED_PRECONDITION, "Generate"),
    (generate_pb2.SamplingParams(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "sampling"),
])
def test_generate_on_an_embedding_server_is_refused(servers, sampling, code, field):
    server = servers["mean"]
    request = generate_pb2.GenerateRequest(text="Hello", sampling=sampling)
    with pytest.raises(grpc.RpcError) as info:
        list(server.stub.Generate(request, timeout=30))
    assert info.value.code() == code
    assert info.value.details().startswith(field), info.value.details()
    assert len(embed(server, texts=["next"]).embeddings) == 1


def test_the_openai_sdk_embeds_the_same_vectors(servers, tokenizer):
    """/v1/embeddings through the official SDK: the vectors Embed returns, as base64 (what the
    SDK asks for by default) and as floats; the generation routes refuse."""
    import numpy as np
    import openai

    server = servers["mean"]
    texts = ["The capital of France is Paris.", "def fibonacci(n):"]
    expected = embed(server, texts=texts)
    client = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0)
    model = server.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10).model_name
    reply = client.embeddings.create(model=model, input=texts)
    assert [d.index for d in reply.data] == [0, 1]
    for got, want in zip(reply.data, expected.embeddings, strict=True):
        assert np.allclose(got.embedding, want.values, atol=1e-6)
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
    ids = tokenizer(texts[0]).input_ids
    short = client.embeddings.create(model=model, input=[ids], dimensions=8,
                                     encoding_format="float")  # the SDK's default is base64
    assert len(short.data[0].embedding) == 8
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=model, input=[])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert "use /v1/embeddings here" in e.value.body["message"]  # HTTP's words, not Embed's
    assert e.value.body["code"] == "wrong_task"
