"""An engine on a test host (`python -m tests.hosts.engine_script SPEC`): an EngineCore over the
worker group the JSON spec lists, running its requests greedily to the end; prints one JSON line
with each request's tokens.

spec: {"model": path, "transport": "zmq" | "grpc", "group": "host:port,host:port",
       "requests": [{"id", "prompt", "max_tokens"}]}
"""

from __future__ import annotations

import json
import sys

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.engine_core import EngineCore
from tests.services.conftest import scheduler_config


def greedy_tokens(config: SchedulerConfig, requests: list[dict]) -> dict[str, list[int]]:
    """Each request's tokens, greedy with ignore_eos, from an EngineCore run to its end."""
    engine = EngineCore(config)
    for r in requests:
        engine.add_request(r["prompt"], SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                       ignore_eos=True), request_id=r["id"])
    tokens: dict[str, list[int]] = {}
    while engine.has_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.shutdown()
    return tokens


def main() -> None:
    spec = json.loads(sys.argv[1])
    config = scheduler_config(spec["model"], spec["transport"], (spec["group"],))
    print(json.dumps(greedy_tokens(config, spec["requests"])), flush=True)


if __name__ == "__main__":
    main()
