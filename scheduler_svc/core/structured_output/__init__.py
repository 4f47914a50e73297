"""Structured output: constraints compiled to grammars (compiler.py), one matcher per request
(matcher.py), and the per-step token bitmask the worker applies before sampling (bitmask.py).
xgrammar is imported only once a request asks for a constraint."""

from scheduler_svc.core.structured_output.bitmask import build_grammar_output
from scheduler_svc.core.structured_output.compiler import GrammarCompiler, compiler_for
from scheduler_svc.core.structured_output.constraint import (
    KINDS,
    Constraint,
    constraint_from_fields,
)
from scheduler_svc.core.structured_output.matcher import RequestGrammar

__all__ = [
    "KINDS", "Constraint", "GrammarCompiler", "RequestGrammar", "build_grammar_output",
    "compiler_for", "constraint_from_fields",
]
