"""Session-wide fixtures: the embedded default model, loaded once per test session, and a tiny
random Llama checkpoint for tests that need a real model but not its answers."""

from __future__ import annotations

import os

# One torch thread in every test process and every server or worker it starts (they inherit the
# environment): on 2 cores, two processes each splitting its work over an OpenMP team of two
# stall each other, which once made the suite's server tests ten times slower.
os.environ["OMP_NUM_THREADS"] = "1"

import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE, set on CI's
# machines): the suite starts many Python processes (servers, workers, CLI clients), and
# without a cache each one compiles batchwire's own sources again (0.6 s of a 3 s start here).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# One temp folder for the run, its processes and every server or worker they start: a test that
# SIGKILLs a server (or takes a Ray node away) leaves that server's folders behind (its worker
# token, ready files), and they go with this folder at the end instead of piling up in /tmp.
# The run's first process (xdist's controller) makes it; the processes it starts inherit it.
# pytest's tmp_path folders live in it too: to look at one after a failure, run with
# BATCHWIRE_TEST_TMPDIR set to a folder of your own, which is then kept.
if "BATCHWIRE_TEST_TMPDIR" not in os.environ:
    os.environ["BATCHWIRE_TEST_TMPDIR"] = tempfile.mkdtemp(prefix="bwt-", dir="/tmp")
    _OWN_TMPDIR = True
else:
    _OWN_TMPDIR = False
os.environ["TMPDIR"] = os.environ["BATCHWIRE_TEST_TMPDIR"]
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

import pytest  # noqa: E402
import torch  # noqa: E402
from batchwire.common.model_files import default_model_path  # noqa: E402

torch.set_num_threads(1)  # in case a plugin imported torch before this file

TINY_LLAMA = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    initializer_range=0.3,  # peaked logits: greedy choices are not near-ties
)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A random two-layer Llama checkpoint (config.json + safetensors), no tokenizer."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_LLAMA))
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_with_tokenizer(tiny_llama, tmp_path_factory) -> str:
    """tiny_llama with a byte-level tokenizer (3 special tokens, then one per byte), so that a
    scheduler process can serve it: any text encodes within its 512-token vocabulary."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama-tokenizer") / "model"
    shutil.copytree(tiny_llama, path)
    vocab = {s: i for i, s in enumerate(("<unk>", "<s>", "</s>"))}  # bos 1, eos 2: Llama's
    for char in pre_tokenizers.ByteLevel.alphabet():
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def default_model_file() -> str:
    return default_model_path()


@pytest.fixture(scope="session", autouse=True)
def tokenizer_cache(tmp_path_factory, worker_id) -> str:
    """One cache folder for this run (scheduler_svc/core/tokenizer.py): the test processes and
    every server they start (they inherit the environment) share it, and no test reads what an
    earlier run or a user's own ~/.cache left behind."""
    base = tmp_path_factory.getbasetemp()
    folder = str((base.parent if worker_id != "master" else base) / "batchwire-cache")
    os.environ["BATCHWIRE_CACHE_DIR"] = folder
    return folder


@pytest.fixture(scope="session")
def default_tokenizer(tokenizer_cache):
    from scheduler_svc.core.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def hf_default_model(default_model_file, tokenizer_cache):
    """transformers' own reading of the GGUF file, in float32: the parity reference.

    transformers takes ~20 s to read the file (it parses its metadata twice and dequantizes
    every tensor), so the first test process to need the model pickles the object it read into
    the run's cache folder, and the other one unpickles that same object (half a second); a
    lock makes it wait while the first one reads and writes."""
    import fcntl

    from transformers import AutoModelForCausalLM

    saved = os.path.join(tokenizer_cache, "hf-default-model.pt")
    os.makedirs(tokenizer_cache, exist_ok=True)
    with open(saved + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if os.path.exists(saved):
            return torch.load(saved, weights_only=False)
        folder, name = os.path.split(default_model_file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        model.eval()
        torch.save(model, saved + ".partial")
        os.rename(saved + ".partial", saved)  # whole or absent
        return model


@pytest.fixture(scope="session")
def default_worker():
    """The real default model in a float32 worker (the parity tests' dtype), with two LoRA
    adapter slots (empty slots cost nothing: a step with no adapter row skips them)."""
    from batchwire.common.worker_config import WorkerConfig

    from worker_svc.runner.worker import Worker

    return Worker(
        WorkerConfig(
            dtype="float32",
            kv_cache_memory_bytes=256 << 20,
            max_num_reqs=32,
            max_model_len=1024,
            max_num_batched_tokens=1024,
            max_loras=2,
            max_lora_rank=16,
        )  # fmt: skip
    )


# One shared `batchwire serve` per test session (model loading dominates the time), and the
# offline API in this process as the reference for what it streams. Every folder's server tests
# use the server (tests/client_api, tests/structured_output); only the files that compare with
# the offline API load it, so a test process that runs none of them loads the model once.
@pytest.fixture(scope="session")
def server_process(tmp_path_factory):
    """Started (port bound, model loading), not yet serving."""
    from tests.client_api.server_process import ServerProcess

    process = ServerProcess(tmp_path_factory.mktemp("server"))
    yield process
    process.stop()


@pytest.fixture(scope="session")
def offline_llm(server_process, default_tokenizer):
    """The offline API on the server's settings (same dtype and step budget); it loads while
    the server does when asked for first."""
    from scheduler_svc import LLM

    llm = LLM(dtype="float32", tokenizer=default_tokenizer, kv_cache_memory_bytes=64 << 20,
              max_model_len=256, max_num_batched_tokens=512)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def server(server_process):
    server_process.wait_serving()
    return server_process


# `make test-fast` runs the tests not marked slow: a few minutes on 2 cores. Slow are the tests
# that load the real default model (through these fixtures, or a file below that picks it by
# parameter) and the files whose tests each start several processes, a cluster or a benchmark
# (tens of seconds each on a slow 2-core machine).
DEFAULT_MODEL_FIXTURES = {"default_worker", "hf_default_model", "server_process", "server",
                          "offline_llm", "e2e_llm"}
SLOW_FILES = {
    "benchmarks/test_bench_quick.py", "benchmarks/test_bench_hostile_http.py",
    "benchmarks/test_bench_latency.py",
    "benchmarks/test_bench_sigterm.py", "deploy/test_dev_cpu_overlay.py",
    "deploy/test_worker_auth.py", "hosts/test_across_hosts.py", "hosts/test_tp_across_hosts.py",
    "kernels/test_triton_interpret.py", "kernels/test_kernel_dispatch.py",
    "services/test_async_scheduling.py", "services/test_async_spec_decode.py",
    "services/test_batch_invariant_served.py", "services/test_executors.py",
    "services/test_external_launcher.py", "services/test_pipeline_engine.py",
    "services/test_pipeline_group.py", "services/test_ports_in_use.py", "services/test_ray.py",
    "services/test_registration.py", "services/test_replicas.py",
    "services/test_spec_decode_services.py", "services/test_worker_grace.py",
    "services/test_worker_protocol.py", "scheduler/test_sampling_rules.py",
    "worker/test_parity.py", "worker/test_pipeline_parallel.py", "worker/test_pooler.py",
    "worker/test_spec_decode.py", "worker/test_tensor_parallel.py",
}
SLOW_TESTS = {"test_lint.py::test_mypy_passes"}


def pytest_collection_modifyitems(config, items):
    tests = os.path.dirname(__file__)
    slow_files = set()
    for item in items:
        path = os.path.relpath(str(item.path), tests)
        if (path in SLOW_FILES or f"{path}::{item.name}" in SLOW_TESTS
                or DEFAULT_MODEL_FIXTURES & set(item.fixturenames)):
            item.add_marker(pytest.mark.slow)
            slow_files.add(item.path)
    # The files with a slow test first, each file's tests still in their order: `make test`
    # hands out whole files to its two processes in this order (pytest_xdist_make_scheduler),
    # so the many short files come last and both processes run out of work at about the same
    # time, instead of one of them starting a minute-long file when the other is nearly done.
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the rest keeps its order


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile in the order of the collection. By default xdist hands out the files
    with the most tests first, which puts the single-test files last: among them the longest
    ones (bench all --quick alone runs for minutes on a slow machine)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


def pytest_unconfigure(config):
    if _OWN_TMPDIR:
        shutil.rmtree(os.environ["BATCHWIRE_TEST_TMPDIR"], ignore_errors=True)
