"""Grammars made of xgrammar's structural tags (free text in which a tag opens a region that
must follow a format), handed on as EBNF text: a `grammar` constraint, which then takes the path
every constraint takes (shape checks, compiled at admission, cached, a token mask per step).

Also the check of one JSON Schema on its own, so that a request carrying several (a tool list)
is refused naming the one that fails rather than the whole grammar.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from scheduler_svc.core.structured_output.compiler import XGRAMMAR_PREFIX
from scheduler_svc.core.structured_output.schema_check import why_unsatisfiable


@functools.lru_cache(maxsize=128)
def structural_tag_ebnf(tag_json: str) -> str:
    """The EBNF of a structural tag given as JSON text (`{"type": "structural_tag", "format":
    ...}`). Raises ValueError with xgrammar's reason when it does not build. Cached: agents
    send the same tools on every turn."""
    import xgrammar as xgr

    try:
        return str(xgr.Grammar.from_structural_tag(tag_json))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(XGRAMMAR_PREFIX.sub("", str(e).strip())) from None


@functools.lru_cache(maxsize=128)
def schema_problem(schema_json: str) -> str | None:
    """Why the grammar backend cannot constrain output to this JSON Schema (text), or None."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(schema_json, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as e:
        return "does not compile: " + XGRAMMAR_PREFIX.sub("", str(e).strip())
    reason = why_unsatisfiable(json.loads(schema_json))
    return f"admits no value: {reason}" if reason is not None else None


def tag_json(fmt: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
