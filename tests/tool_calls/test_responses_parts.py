"""The Responses API's parts that need no model: the previous_response_id store's bounds, and the
typed events a reply's deltas make (text, then a call, then text again)."""

from __future__ import annotations

from scheduler_svc.core.tool_calls import CallDelta, Deltas
from scheduler_svc.service.openai.responses_api.events import OutputEvents
from scheduler_svc.service.openai.responses_api.store import ResponseStore


def _turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_store_drops_the_least_recently_used_past_its_bounds():
    store = ResponseStore(max_responses=2, max_chars=10)
    store.put("a", _turn("xxx"))
    store.put("b", _turn("yyy"))
    assert store.get("a") == _turn("xxx")  # a is now the more recent
    store.put("c", _turn("zzz"))
    assert (store.get("a"), store.get("b"), store.get("c")) == (_turn("xxx"), None,
                                                                 _turn("zzz"))
    store.put("d", _turn("w" * 8))  # 3 + 3 + 8 characters, then 3 + 8 > 10: a and c go
    assert store.get("a") is None and store.get("c") is None and store.chars == 8
    store.put("huge", _turn("h" * 11))  # larger than the whole store: never kept
    assert store.get("huge") is None and store.get("d") == _turn("w" * 8)


def test_text_a_call_and_text_again_make_three_items():
    out = OutputEvents()
    events = [*out.deltas(Deltas("Let me")), *out.deltas(Deltas(" check.")),
              *out.deltas(Deltas("", [CallDelta(0, "", "call_1", "f"), CallDelta(0, '{"a"')])),
              *out.deltas(Deltas("", [CallDelta(0, ": 1}")])),
              *out.deltas(Deltas("Done.")), *out.close()]
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"].endswith("item.done")] == [0, 1, 2]
    message, call, last = out.items
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"]) == ("call_1", "f", '{"a": 1}')
    assert last["content"][0]["text"] == "Done."
    assert all(e["item_id"] == call["id"] for e in events
               if e["type"].startswith("response.function_call_arguments"))
