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
