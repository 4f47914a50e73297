"""A worker's refusal names the requests at fault, in a form the scheduler reads back
(common/refusals.py), bounded to fit a gRPC status message."""

from __future__ import annotations

from batchwire.common.refusals import (
    MAX_CARRIED_ID_CHARS,
    REFUSED_MARK,
    parse_refusal,
    refusal_message,
)


def test_refused_ids_round_trip_through_the_status_message():
    ids = ["g", "a b", 'q"\n', "\u00e9"]
    text, back = parse_refusal(refusal_message("ExecuteModel: bad", ids))
    assert (text, back) == ("ExecuteModel: bad", ids)
    assert parse_refusal("ExecuteModel: bad") == ("ExecuteModel: bad", [])
    assert parse_refusal("x" + REFUSED_MARK + "not json") == ("x" + REFUSED_MARK + "not json", [])


def test_ids_no_scheduler_sends_are_not_carried():
    long_id = "x" * (MAX_CARRIED_ID_CHARS + 1)
    assert refusal_message("m", [long_id]) == "m"
    assert parse_refusal(refusal_message("m", [long_id, "ok"]))[1] == ["ok"]
    assert len(refusal_message("m", [str(i) for i in range(10_000)])) < 1000
