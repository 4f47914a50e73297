"""Whether a JSON schema admits any value at all, decided on the schema before it is compiled.

xgrammar compiles `{"not": {}}` or `allOf: [string, integer]` into a grammar that accepts text
(it leaves out keywords it does not enforce), so the request would run and return JSON that
breaks its own schema. This check is conservative: it answers with a reason only when no value
can satisfy the schema, and says nothing about what it cannot decide ($ref, patterns, ...).
"""

from __future__ import annotations

from typing import Any

TYPES = frozenset(("null", "boolean", "object", "array", "number", "integer", "string"))
# Lower and upper bounds of the same kind; a lower bound above its upper bound admits nothing.
_BOUNDS = [("minLength", "maxLength"), ("minItems", "maxItems"),
           ("minProperties", "maxProperties"), ("minimum", "maximum")]


def why_unsatisfiable(schema: Any) -> str | None:
    """A reason no JSON value satisfies `schema`, or None when some may. The schema's nesting
    is bounded before this runs (constraint.MAX_CONSTRAINT_DEPTH), so recursion is safe."""
    if schema is False:
        return "the schema `false` admits no value"
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        return None  # what it refers to is not followed here
    types = _types(schema)
    if types is not None and not types:
        return "no type is left: `type` is empty, or it and the types of allOf have none in common"
    if "not" in schema and _admits_everything(schema["not"]):
        return "`not` excludes every value"
    values = _listed_values(schema)
    if values is not None:
        if not values:
            return "`enum` lists no value"
        if types is not None and not any(_type_of(v) in _widened(types) for v in values):
            return f"none of the values of enum/const has one of the types {sorted(types)}"
    for low, high in _BOUNDS:
        if isinstance(schema.get(low), int | float) and isinstance(schema.get(high), int | float):
            if schema[low] > schema[high]:
                return f"{low} {schema[low]} is greater than {high} {schema[high]}"
    for i, member in enumerate(_list(schema, "allOf")):
        reason = why_unsatisfiable(member)
        if reason is not None:
            return f"allOf[{i}]: {reason}"
    for key in ("anyOf", "oneOf"):
        branches = _list(schema, key)
        if branches:
            reasons = [why_unsatisfiable(b) for b in branches]
            if all(r is not None for r in reasons):
                return f"every branch of {key} admits no value ({key}[0]: {reasons[0]})"
    if types == {"object"}:
        return _object_reason(schema)
    if types == {"array"}:
        return _array_reason(schema)
    return None


def _object_reason(schema: dict) -> str | None:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        properties = {}
    closed = schema.get("additionalProperties") is False
    for name in _list(schema, "required"):
        if not isinstance(name, str):
            continue
        if name in properties:
            reason = why_unsatisfiable(properties[name])
            if reason is not None:
                return f"required property {name!r}: {reason}"
        elif closed:
            return f"property {name!r} is required but additionalProperties is false"
    return None


def _array_reason(schema: dict) -> str | None:
    min_items = schema.get("minItems")
    if isinstance(min_items, int) and min_items > 0 and "items" in schema:
        reason = why_unsatisfiable(schema["items"])
        if reason is not None:
            return f"minItems is {min_items} but items admits no value: {reason}"
    return None


def _types(schema: dict) -> set[str] | None:
    """The types a value may have, met over `type` and allOf's members; None when unbounded."""
    allowed: set[str] | None = None
    for member in [schema, *(m for m in _list(schema, "allOf") if isinstance(m, dict))]:
        declared = member.get("type")
        if declared is None:
            continue
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
            return None  # a malformed `type`: the compiler says what is wrong with it
        own = set(names)
        if not own <= TYPES:
            return None  # an unknown type name: the compiler says what is wrong with it
        allowed = own if allowed is None else _meet(allowed, own)
    return allowed


def _list(schema: dict, key: str) -> list:
    value = schema.get(key)
    return value if isinstance(value, list) else []


def _meet(a: set[str], b: set[str]) -> set[str]:
    """Types in both; an integer is also a number."""
    met = a & b
    if ("integer" in a and "number" in b) or ("number" in a and "integer" in b):
        met.add("integer")
    return met


def _widened(types: set[str]) -> set[str]:
    return types | {"integer"} if "number" in types else types


def _listed_values(schema: dict) -> list | None:
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return list(enum) if isinstance(enum, list) else None


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _admits_everything(schema: Any) -> bool:
    """True for `true` and for a schema with no keyword that constrains (`{}`)."""
    if schema is True:
        return True
    return isinstance(schema, dict) and not any(k not in _ANNOTATIONS for k in schema)


# Keywords that describe a value without constraining it.
_ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "$id",
                          "$schema", "deprecated", "readOnly", "writeOnly"))
