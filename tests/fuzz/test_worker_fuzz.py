"""Stateful fuzzing of a real worker process over gRPC and ZMQ (tiny random Llama).

A model of the scheduler (scheduler_model.py) draws valid steps, sent to the worker process and
to an in-process reference Worker that never sees anything else. Between them come hostile
messages (worker_messages.py): a valid next step broken in one way, which must be refused with
INVALID_ARGUMENT; bad grammar bitmasks, refused while the logits stay parked; two ExecuteModels
in a row and a SampleTokens with nothing parked (FAILED_PRECONDITION); messages and bytes built
from scratch, which get OK or a documented status, never INTERNAL. After every hostile message
the same valid step is sent and must give the reference's tokens (the batch is intact); each
run ends with every request finished and the worker holding none; the process never dies.
"""

from __future__ import annotations

import grpc
import pytest
from batchwire.v1 import worker_pb2 as pb
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from tests.services.conftest import WireClient
from worker_svc.runner.worker import Worker

from .scheduler_model import SchedulerModel, StepPlan
from .worker_messages import (
    MUTATIONS,
    garbage_scheduler_output,
    hostile_grammar,
    touches_model,
)

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
# What a message built from scratch may get: it may happen to be valid, or out of turn.
DOCUMENTED = {OK, INVALID, PRECONDITION, grpc.StatusCode.UNIMPLEMENTED}
METHODS = {"GetInfo", "ExecuteModel", "SampleTokens", "Reset", "Shutdown"}
# derandomize: the same examples on every run. No shrinking: against a real process it can take
# minutes, and the failing run (steps and draws) is printed whole and replays as it is.
FUZZ = settings(stateful_step_count=16, deadline=None, derandomize=True,
                database=None, phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def tokens_of(out: pb.ModelRunnerOutput) -> dict[str, list[int]]:
    return {r: list(t.ids) for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True)}


def fuzz_machine(client: WireClient, reference: Worker) -> type[RuleBasedStateMachine]:
    info = pb.WorkerInfo.FromString(client.call("GetInfo", b"")[1])

    class WorkerFuzz(RuleBasedStateMachine):
        @initialize()
        def fresh(self) -> None:
            assert client.call("Reset", b"")[0] == OK
            reference.reset()
            self.model = SchedulerModel(info)
            self.garbage_ids: set[str] = set()

        def call(self, method: str, message, expected: set[grpc.StatusCode]) -> bytes:
            payload = message if isinstance(message, bytes) else message.SerializeToString()
            code, reply = client.call(method, payload)
            assert code in expected, (method, code, reply[:2000], message)
            return reply if code == OK else b""

        def execute(self, plan: StepPlan) -> None:
            """The plan's step on both workers: refused by neither, parked alike."""
            reply = pb.ExecuteModelResponse.FromString(
                self.call("ExecuteModel", plan.so, {OK}))
            expected = reference.execute_model(plan.so)
            assert reply.HasField("output") == (expected is not None)
            self.model.commit(plan)
            self.parked = expected is None

        def sample(self, plan: StepPlan) -> None:
            if self.parked:
                out = pb.ModelRunnerOutput.FromString(
                    self.call("SampleTokens", plan.grammar, {OK}))
                expected = reference.sample_tokens(plan.grammar if plan.grammar.req_ids else None)
                got, want = tokens_of(out), tokens_of(expected)
                assert got == want, f"step {plan.so}\ngot {got}\nreference {want}"
                self.model.record(plan, tokens_of(out))
            else:  # an answered step: SampleTokens takes the no-parked-state branch
                out = pb.ModelRunnerOutput.FromString(self.call("SampleTokens", b"", {OK}))
                assert not out.req_ids
                self.model.record(plan, {})
            self.parked = False

        def valid_step(self, plan: StepPlan) -> None:
            self.execute(plan)
            self.sample(plan)

        @rule(data=st.data())
        def step(self, data) -> None:
            self.valid_step(self.model.plan_step(data.draw))

        @rule(data=st.data(), name=st.sampled_from(sorted(MUTATIONS)))
        def broken_step(self, data, name) -> None:
            plan = self.model.plan_step(data.draw)
            broken = pb.SchedulerOutput()
            broken.CopyFrom(plan.so)
            if MUTATIONS[name](broken, self.model, data.draw):
                self.call("ExecuteModel", broken, {INVALID})
            self.valid_step(plan)  # refused whole: the same step runs as if it had not come

        @rule(data=st.data())
        def broken_grammar(self, data) -> None:
            plan = self.model.plan_step(data.draw)
            self.execute(plan)
            if self.parked:
                grammar = hostile_grammar(plan, info.vocab_size, data.draw)
                if grammar is not None:
                    self.call("SampleTokens", grammar, {INVALID})
            self.sample(plan)  # the logits stayed parked for the valid bitmask

        @rule(data=st.data())
        def out_of_turn(self, data) -> None:
            self.call("SampleTokens", b"", {PRECONDITION})  # nothing parked
            plan = self.model.plan_step(data.draw)
            self.execute(plan)
            if self.parked:
                again = self.model.plan_step(data.draw).so
                self.call("ExecuteModel", again, {PRECONDITION})
            self.sample(plan)

        @rule(data=st.data())
        def garbage_message(self, data) -> None:
            so = data.draw(garbage_scheduler_output(self.model))
            self.garbage(so.SerializeToString(), data)

        @rule(data=st.data(), payload=st.binary(max_size=200))
        def garbage_bytes(self, data, payload) -> None:
            self.garbage(payload, data)
            grammar = self.call("SampleTokens", payload, {INVALID, PRECONDITION, OK})
            assert not grammar, "SampleTokens answered with nothing parked"

        def garbage(self, payload: bytes, data) -> None:
            try:
                so = pb.SchedulerOutput.FromString(payload)
            except Exception:
                so = None
            if so is not None and touches_model(so, self.model):
                return  # accepted, it would run the model's own requests behind its back
            reply = self.call("ExecuteModel", payload, {OK, INVALID, PRECONDITION})
            if not reply:
                return
            # Accepted: it was a valid step of its own. Finish it, and its requests.
            if not pb.ExecuteModelResponse.FromString(reply).HasField("output"):
                self.call("SampleTokens", data.draw(st.binary(max_size=40)), DOCUMENTED)
                self.call("SampleTokens", b"", {OK, PRECONDITION})
            else:
                self.call("SampleTokens", b"", {OK})  # the answered step's empty SampleTokens
            self.garbage_ids.update(n.req_id for n in so.scheduled_new_reqs)
            done = pb.SchedulerOutput(finished_req_ids=sorted(self.garbage_ids))
            self.call("ExecuteModel", done, {OK})
            self.call("SampleTokens", b"", {OK})

        @rule(frames=st.lists(st.binary(max_size=24), min_size=1, max_size=4))
        def garbage_frames(self, frames) -> None:
            if client.transport != "zmq" or (frames and frames[0].decode(errors="replace")
                                             in METHODS):
                return
            code, _ = client.frames(frames)
            assert code in {INVALID, grpc.StatusCode.UNIMPLEMENTED}, (frames, code)

        def teardown(self) -> None:
            """Every request finished; the worker then knows none of them."""
            if not hasattr(self, "model"):
                return
            held = sorted(self.model.requests) + sorted(self.garbage_ids)
            done = pb.SchedulerOutput(finished_req_ids=held)
            self.call("ExecuteModel", done, {OK})
            self.call("SampleTokens", b"", {OK})
            for req_id in sorted(self.model.ever_added | self.garbage_ids):
                probe = pb.SchedulerOutput()
                probe.scheduled_cached_reqs.req_ids.append(req_id)
                probe.scheduled_cached_reqs.new_block_ids.add()
                probe.scheduled_cached_reqs.num_computed_tokens.append(0)
                probe.scheduled_cached_reqs.num_scheduled_tokens.append(0)
                code, message = client.call("ExecuteModel", probe.SerializeToString())
                assert code == INVALID and b"unknown to this worker" in message, (req_id, message)

    return WorkerFuzz


# The servicer (the protocol's rules) is shared by both transports: ZMQ gets fewer runs, enough
# for its framing and its malformed frames.
@pytest.mark.parametrize(("transport", "examples"), [("grpc", 14), ("zmq", 6)])
def test_fuzzed_steps_never_hurt_the_worker(transport, examples, fuzz_workers):
    worker, reference = fuzz_workers
    client = WireClient(transport, worker.address(transport))
    try:
        run_state_machine_as_test(fuzz_machine(client, reference),
                                  settings=settings(FUZZ, max_examples=examples))
    finally:
        client.close()
    assert worker.process.poll() is None, "the worker process died"
