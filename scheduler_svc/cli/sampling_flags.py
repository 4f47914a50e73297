"""The sampling flags of `batchwire generate` and `chat`, one per SamplingParams field of
generate.proto. An unset flag leaves the field unset, so the server's default applies: the model's
generation config where it has the field (GetModelInfo.sampling_defaults; greedy on the embedded
SmolLM2), else generate.proto's (max_tokens 16, temperature 1...)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from batchwire.v1 import generate_pb2

_SCALARS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
            "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "logprobs")


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset = the server's default)")
    g.add_argument("--max-tokens", type=int,
                   help="output tokens at most (default: the model's generation config, else "
                   "16); prompt plus this must fit in the model's max_model_len")
    g.add_argument("--min-tokens", type=int,
                   help="EOS and stop token ids are ignored until this many tokens are out")
    g.add_argument("--temperature", type=float,
                   help="0 = greedy; higher is more random (default: the model's generation "
                   "config, 0 = greedy on the embedded SmolLM2, else 1)")
    g.add_argument("--top-p", type=float, help="sample from the smallest set of tokens whose "
                   "probabilities add up to this, in (0, 1] (default: the model's generation "
                   "config, else 1 = off)")
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, help="drop tokens less likely than this fraction of "
                   "the most likely one, in [0, 1] (0 = off)")
    g.add_argument("--seed", type=int, help="seed of this request's sampling: the same seed "
                   "gives the same output")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable); "
                   "not included in the output")
    g.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append",
                   default=[], help="a token id that ends the output (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None,
                   help="keep generating past the end-of-sequence token, up to --max-tokens")
    g.add_argument("--repetition-penalty", type=float, help="> 1 discourages tokens already in "
                   "the prompt or output (1 = off)")
    g.add_argument("--presence-penalty", type=float, help="in [-2, 2]: > 0 discourages tokens "
                   "already in the output, once each (0 = off)")
    g.add_argument("--frequency-penalty", type=float, help="in [-2, 2]: > 0 discourages tokens "
                   "in proportion to how often they are already in the output (0 = off)")
    g.add_argument("--logprobs", type=int, help="print the top-n log-probabilities of each "
                   "token on stderr, after the text (0 = the sampled token's only)")
    c = p.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    c.add_argument("--json-schema", metavar="SCHEMA", help="the output follows this JSON Schema: "
                   "JSON text, or @FILE to read it from a file")
    c.add_argument("--json-object", action="store_true", default=None,
                   help="the output is a JSON object")
    c.add_argument("--regex", help="the whole output matches this regular expression")
    c.add_argument("--choice", action="append", help="the output is exactly one of these "
                   "strings (repeatable)")
    c.add_argument("--grammar", metavar="EBNF", help="the output follows this EBNF grammar "
                   "(start rule `root`): the text, or @FILE")


def defaults_line(info: generate_pb2.GetModelInfoResponse) -> str:
    """The sampling defaults a server applies to unset flags, as one line for the terminal."""
    d = info.sampling_defaults
    values = [f"{name} {getattr(d, name):.3g}" for name in _REPORTED if d.HasField(name)]
    source = f" ({info.sampling_defaults_source})" if info.sampling_defaults_source else ""
    return f"Sampling defaults: {', '.join(values) or 'the server gives none'}{source}."


_REPORTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def _text_or_file(value: str) -> str:
    if not value.startswith("@"):
        return value
    path = os.path.expanduser(value[1:])
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"batchwire: cannot read {path!r}: {e.strerror}") from None


def sampling_message(args: argparse.Namespace) -> generate_pb2.SamplingParams:
    values: dict[str, Any] = {f: getattr(args, f) for f in _SCALARS
                              if getattr(args, f) is not None}
    msg = generate_pb2.SamplingParams(stop=args.stop, stop_token_ids=args.stop_token_ids,
                                      **values)
    if args.json_schema is not None:
        msg.json_schema = _text_or_file(args.json_schema)
    elif args.json_object:
        msg.json_object = True
    elif args.regex is not None:
        msg.regex = args.regex
    elif args.choice:
        msg.choice.choices.extend(args.choice)
    elif args.grammar is not None:
        msg.grammar = _text_or_file(args.grammar)
    return msg
