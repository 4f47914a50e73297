"""`batchwire serve|scheduler` task and pipeline flags reach the workers' configuration."""

from __future__ import annotations

import pytest

from scheduler_svc.cli.commands import _scheduler_config, build_parser


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_flags_pass_through_to_the_worker_config(command):
    args = build_parser().parse_args([command, "--task", "embed", "--pooling-type", "mean",
                                      "--no-normalize", "--pipeline-parallel-size", "2"])
    worker = _scheduler_config(args).worker_config()
    assert (worker.task, worker.pooling_type, worker.normalize, worker.pipeline_parallel_size
            ) == ("embed", "mean", False, 2)
    defaults = _scheduler_config(build_parser().parse_args([command])).worker_config()
    assert (defaults.task, defaults.normalize, defaults.pipeline_parallel_size
            ) == ("generate", True, 1)


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_quantization_reaches_the_workers_and_their_argv(command, monkeypatch):
    args = build_parser().parse_args([command, "--quantization", "none"])
    worker = _scheduler_config(args).worker_config()
    assert worker.quantization == "none"
    assert worker.to_argv()[worker.to_argv().index("--quantization") + 1] == "none"
    monkeypatch.setenv("BATCHWIRE_QUANTIZATION", "int8")
    from_env = _scheduler_config(build_parser().parse_args([command])).worker_config()
    assert from_env.quantization == "int8"
    # Refused in one line before anything starts, by the rules the workers' config holds.
    with pytest.raises(SystemExit, match="quantization=int4 is not served with dtype=float32"):
        _scheduler_config(build_parser().parse_args(
            [command, "--quantization", "int4", "--dtype", "float32"]))


def test_the_worker_command_takes_quantization_from_its_flag_and_env(monkeypatch):
    from worker_svc.server.options import build_parser as worker_parser
    from worker_svc.server.options import worker_config

    assert worker_config(worker_parser().parse_args(["--quantization", "int4"])).quantization \
        == "int4"
    monkeypatch.setenv("BATCHWIRE_QUANTIZATION", "none")
    assert worker_config(worker_parser().parse_args([])).quantization == "none"


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_cpu_decode_reaches_the_workers_and_their_argv(command, monkeypatch):
    from worker_svc.server.options import build_parser as worker_parser
    from worker_svc.server.options import worker_config

    default = _scheduler_config(build_parser().parse_args([command])).worker_config()
    assert default.cpu_decode == "native"
    worker = _scheduler_config(build_parser().parse_args(
        [command, "--cpu-decode", "torch"])).worker_config()
    argv = worker.to_argv()
    assert argv[argv.index("--cpu-decode") + 1] == "torch"
    assert worker_config(worker_parser().parse_args(argv)).cpu_decode == "torch"
    monkeypatch.setenv("BATCHWIRE_CPU_DECODE", "torch")
    assert worker_config(worker_parser().parse_args([])).cpu_decode == "torch"
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--cpu-decode", "fast"])
