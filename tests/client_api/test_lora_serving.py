"""LoRA adapters through a real `batchwire serve` of the tiny Llama: served from the start
(--lora-modules), loaded, used, unloaded and loaded again at run time over HTTP and gRPC while a
long request runs; bad names, paths and configs refused with the field named; the server
serves on."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading

import grpc
import pytest
from batchwire.v1 import generate_pb2

from tests.client_api.server_process import REPO, ServerProcess, collect, greedy, text_request
from tests.lora_adapters import make_adapter, peft_greedy

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(24)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama_with_tokenizer, tmp_path_factory) -> dict[int, str]:
    """rank -> a PEFT adapter folder of the tiny Llama."""
    return {
        r: make_adapter(tiny_llama_with_tokenizer, tmp_path_factory.mktemp(f"serve{r}"), r, r)
        for r in (8, 16)
    }


@pytest.fixture(scope="module")
def references(tiny_llama_with_tokenizer, adapters) -> dict[int | None, list[int]]:
    """rank (None: the base model) -> transformers + PEFT's greedy tokens for PROMPT."""
    return {
        r: peft_greedy(tiny_llama_with_tokenizer, adapters.get(r), PROMPT, MAX_TOKENS)[1]
        for r in (None, 8, 16)
    }


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, tiny_llama_with_tokenizer, adapters):
    server = ServerProcess(
        tmp_path_factory.mktemp("lora-serve"), "--model", tiny_llama_with_tokenizer,
        "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules", f"first={adapters[8]}",
    )  # fmt: skip
    try:
        server.wait_serving()
        yield server
    finally:
        server.stop()


def post(server, path: str, payload: object) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(payload), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def get(server, path: str) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def generate(server, lora_name: str = "", max_tokens: int = MAX_TOKENS) -> list[int]:
    request = generate_pb2.GenerateRequest(token_ids=PROMPT, lora_name=lora_name)
    request.sampling.temperature = 0
    request.sampling.max_tokens = max_tokens
    request.sampling.ignore_eos = True
    tokens: list[int] = []
    for message in server.stub.Generate(request, timeout=120):
        tokens.extend(message.token_ids)
    return tokens


def complete(server, model: str) -> tuple[int, dict]:
    status, body = post(server, "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True,
    })  # fmt: skip
    return status, json.loads(body)


def test_adapters_load_run_unload_and_reload_while_a_request_runs(
    lora_server, adapters, references
):
    server = lora_server
    long_run: list[int] = []
    runner = threading.Thread(target=lambda: long_run.extend(generate(server, "", 200)))
    runner.start()
    try:
        models = [card["id"] for card in get(server, "/v1/models")["data"]]
        assert models[1:] == ["first"]
        assert generate(server, "first") == references[8]

        status, text = post(server, "/v1/load_lora_adapter",
                            {"lora_name": "second", "lora_path": adapters[16]})
        assert status == 200, text
        assert generate(server, "second") == references[16]
        status, body = complete(server, "second")  # OpenAI's `model` names the adapter
        assert status == 200 and body["model"] == "second"

        server.stub.UnloadLoRAAdapter(generate_pb2.UnloadLoRAAdapterRequest(lora_name="first"))
        with pytest.raises(grpc.RpcError) as gone:
            generate(server, "first")
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        assert "first" in gone.value.details()
        assert complete(server, "first")[0] == 404

        # The name again, now on the rank-16 adapter: a new id, so neither a worker slot nor
        # the prefix cache serves the old weights.
        reply = server.stub.LoadLoRAAdapter(
            generate_pb2.LoadLoRAAdapterRequest(lora_name="first", lora_path=adapters[16]))
        assert reply.adapter.id == 3
        assert generate(server, "first") == references[16]
        info = server.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        assert [(a.name, a.id) for a in info.lora_adapters] == [("second", 2), ("first", 3)]
        assert info.max_loras == 2
        listed = server.stub.ListLoRAAdapters(generate_pb2.ListLoRAAdaptersRequest())
        assert [a.path for a in listed.adapters] == [adapters[16], adapters[16]]
    finally:
        runner.join(timeout=120)
    assert len(long_run) == 200  # the base request ran on throughout
    assert generate(server) == references[None]
    metrics = server.metrics()
    assert 'batchwire_lora_requests_finished_total{lora_name="second"} 2.0' in metrics


@pytest.mark.parametrize("payload, field, words", [
    ({"lora_name": "x", "lora_path": "/no/such/adapter"}, "lora_path", "no adapter_config.json"),
    ({"lora_name": "", "lora_path": "/tmp"}, "lora_name", "a name of 1 to 128"),
    ({"lora_name": "x", "lora_path": ""}, "lora_path", "needs a path"),
])  # fmt: skip
def test_bad_loads_are_refused_naming_the_field(lora_server, payload, field, words):
    status, text = post(lora_server, "/v1/load_lora_adapter", payload)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == field and words in error["message"]
    request = generate_pb2.LoadLoRAAdapterRequest(**payload)
    with pytest.raises(grpc.RpcError) as refused:
        lora_server.stub.LoadLoRAAdapter(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(field) and words in refused.value.details()


def test_bad_adapter_configs_and_names_are_refused(lora_server, adapters, tmp_path):
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 8,
                                                          "use_dora": True}))
    status, text = post(lora_server, "/v1/load_lora_adapter",
                        {"lora_name": "dora", "lora_path": str(dora)})
    assert status == 400 and "use_dora" in text and '"lora_path"' in text
    status, text = post(lora_server, "/v1/load_lora_adapter",
                        {"lora_name": "again", "lora_path": 7})
    assert status == 400 and "lora_path" in text
    status, text = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "nobody"})
    assert status == 404 and "nobody" in text
    with pytest.raises(grpc.RpcError) as unknown:
        generate(lora_server, "nobody")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert generate(lora_server, max_tokens=2)  # the server serves on


def test_the_generate_command_loads_and_names_an_adapter(lora_server, adapters):
    """`batchwire generate --lora-modules NAME=PATH` loads the adapter and generates with it,
    `--lora-name NAME` names one the server serves; the tokens are the gRPC API's with it."""
    server, text = lora_server, "hello adapters"

    def cli(*flags: str) -> tuple[list[int], str]:
        done = subprocess.run(
            [sys.executable, "-m", "scheduler_svc.cli", "generate", "--address", server.address,
             "--raw", "--temperature", "0", "--max-tokens", "6", "--ignore-eos", "--quiet",
             "--logprobs", "0", *flags, text],
            cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
        ids = [int(i) for i in re.findall(r"^\[logprob\] token (\d+):", done.stderr, re.M)]
        return ids, f"{done.returncode}: {done.stderr}"

    def api(lora_name: str) -> list[int]:
        request = text_request(text, greedy(6), lora_name=lora_name)
        return collect(server.stub.Generate(request, timeout=120))[0]

    loaded, log = cli("--lora-modules", f"cli8={adapters[8]}")
    assert loaded == api("cli8") and len(loaded) == 6, log
    assert loaded != api(""), "the adapter changes the tokens, so the test shows it was used"
    assert cli("--lora-name", "cli8")[0] == loaded
    # Loaded already from the same path: used as it is, next to a new one picked by name.
    named, log = cli("--lora-modules", f"cli8={adapters[8]}", "--lora-modules",
                     f"cli16={adapters[16]}", "--lora-name", "cli16")
    assert named == api("cli16") != loaded, log
    _, log = cli("--lora-modules", f"cli8={adapters[16]}")
    assert log.startswith("1: ") and f"'cli8' is loaded from {adapters[8]!r}" in log
    _, log = cli("--lora-name", "nobody")
    assert log.startswith("1: ") and "NOT_FOUND" in log and "nobody" in log
