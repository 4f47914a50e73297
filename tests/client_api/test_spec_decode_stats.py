"""Speculative decoding's counts, from the scheduler through the async engine to /metrics and
GetServerInfo, on the fake worker's copy model (every draft right)."""

from __future__ import annotations

import asyncio

from batchwire.v1 import generate_pb2

from scheduler_svc import SamplingParams
from scheduler_svc.engine.async_engine import AsyncEngine
from scheduler_svc.service.generation_servicer import GenerationServicer
from scheduler_svc.service.loaded_model import LoadedModel
from scheduler_svc.service.metrics import SchedulerMetrics
from tests.scheduler.conftest import make_fake_engine
from tests.scheduler.fake_worker import copy_next_token

CYCLE = [10, 11, 12, 13, 14, 15]


def test_drafted_and_accepted_counts_reach_metrics_and_server_info():
    async def main():
        core, _ = make_fake_engine(num_blocks=64, block_size=4, vocab_size=64, max_model_len=128,
                                   next_token=copy_next_token, speculative_method="ngram",
                                   num_speculative_tokens=3, prompt_lookup_min=1)
        metrics = SchedulerMetrics()
        engine = AsyncEngine(core, observer=metrics)
        engine.start()
        for i in range(2):
            stream = await engine.add_request(str(i), CYCLE * 2, SamplingParams(
                temperature=0, max_tokens=25, ignore_eos=True))
            async for _ in stream:
                pass
        while engine.stats.kv_blocks_used or engine.stats.num_running:
            await asyncio.sleep(0.005)
        stats = engine.stats
        # 25 tokens: the prefill's, then 6 steps of 1 + 3 accepted drafts; the last 0 drafts.
        assert stats.num_draft_tokens == stats.num_accepted_tokens == 2 * 18
        assert stats.drafted_per_position == stats.accepted_per_position == (12, 12, 12)
        sample = metrics.registry.get_sample_value
        assert sample("batchwire_spec_decode_num_draft_tokens_total") == 36
        assert sample("batchwire_spec_decode_num_accepted_tokens_total") == 36
        assert sample("batchwire_spec_decode_num_drafts_total") == 12
        assert sample("batchwire_spec_decode_num_accepted_tokens_per_pos_total",
                      {"position": "2"}) == 12

        servicer = GenerationServicer("test", 1 << 20)
        servicer.attach(LoadedModel(engine, None, core.config, "fake", 64, 128, 16, 2048, [1],
                                    "none", "uni", lambda: []))
        info = await servicer.GetServerInfo(generate_pb2.GetServerInfoRequest(), None)
        spec = info.speculative_decoding
        assert info.HasField("speculative_decoding") and spec.method == "ngram"
        assert (spec.num_speculative_tokens, spec.num_drafts, spec.num_draft_tokens,
                spec.num_accepted_tokens) == (3, 12, 36, 36)
        assert list(spec.accepted_per_position) == [12, 12, 12]
        engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_server_info_has_no_speculative_field_when_it_is_off():
    async def main():
        core, _ = make_fake_engine(num_blocks=64, block_size=4, vocab_size=64, max_model_len=128)
        engine = AsyncEngine(core)
        servicer = GenerationServicer("test", 1 << 20)
        servicer.attach(LoadedModel(engine, None, core.config, "fake", 64, 128, 16, 2048, [1],
                                    "none", "uni", lambda: []))
        info = await servicer.GetServerInfo(generate_pb2.GetServerInfoRequest(), None)
        assert not info.HasField("speculative_decoding")

    asyncio.run(asyncio.wait_for(main(), 30))
