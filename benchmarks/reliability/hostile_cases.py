"""The hostile table of `batchwire bench hostile-http` (hostile_http.py): each case is a whole
HTTP request as bytes, grouped by what it attacks: integers no message can hold, text that is
not encodable, wrong JSON types, floats past their range, deep nesting, huge bodies, malformed
JSON, and malformed HTTP, which uvicorn answers itself before the application sees it."""

from __future__ import annotations

import dataclasses
import os

MB = 1 << 20


@dataclasses.dataclass
class Case:
    group: str
    name: str
    request: bytes  # the whole HTTP request as sent, head and body
    http_layer: bool = False  # malformed HTTP: uvicorn's own plain-text 400 is the answer



def http_request(path: str, body: bytes, content_type: str = "application/json",
                 extra: str = "") -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}\r\n")
    return head.encode() + body


def js(path: str, text: str) -> bytes:
    return http_request(path, text.encode("utf-8", "surrogatepass"))


def _int_cases() -> list[Case]:
    out = []
    big = {"2**31": 2**31, "-2**31-1": -2**31 - 1, "2**63": 2**63, "2**80": 2**80,
           "-2**80": -2**80, "10**12": 10**12}
    for field in ("max_tokens", "n", "seed", "top_k", "min_tokens", "priority", "logprobs",
                  "truncate_prompt_tokens", "best_of"):
        for label in ("2**80", "-2**80") if field != "priority" else big:
            body = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {big[label]}}}'
            if field == "max_tokens":
                body = f'{{"prompt": "hi", "max_tokens": {big[label]}}}'
            out.append(Case("huge integers", f"completions {field}={label}",
                            js("/v1/completions", body)))
    for label in ("10**12", "2**31", "-2**80"):
        value = big[label]
        out += [
            Case("huge integers", f"completions prompt=[{label}]",
                 js("/v1/completions", f'{{"prompt": [{value}], "max_tokens": 2}}')),
            Case("huge integers", f"completions prompt=[[1, {label}]]",
                 js("/v1/completions", f'{{"prompt": [[1, {value}]], "max_tokens": 2}}')),
            Case("huge integers", f"detokenize tokens=[{label}]",
                 js("/detokenize", f'{{"tokens": [{value}]}}')),
            Case("huge integers", f"embeddings input=[{label}]",
                 js("/v1/embeddings", f'{{"input": [{value}]}}')),
        ]
    chat = '"messages": [{"role": "user", "content": "hi"}]'
    for field in ("max_completion_tokens", "top_logprobs", "priority"):
        out.append(Case("huge integers", f"chat {field}=2**80",
                        js("/v1/chat/completions", f'{{{chat}, "{field}": {2**80}}}')))
    for field in ("stop_token_ids", "allowed_token_ids"):
        out.append(Case("huge integers", f"completions {field}=[2**80]", js(
            "/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "{field}": [{2**80}]}}')))
    out.append(Case("huge integers", "seed with 5000 digits", js(
        "/v1/completions", '{"prompt": "hi", "max_tokens": 2, "seed": 1' + "0" * 5000 + "}")))
    return out


def _text_cases() -> list[Case]:
    s = "\\ud800"  # a lone surrogate, JSON-escaped
    chat = '"messages": [{"role": "user", "content": "hi"}]'
    escaped = [
        ("completions model", "/v1/completions", f'{{"prompt": "hi", "model": "{s}"}}'),
        ("completions prompt", "/v1/completions", f'{{"prompt": "a{s}b", "max_tokens": 2}}'),
        ("completions prompt list", "/v1/completions",
         f'{{"prompt": ["ok", "{s}"], "max_tokens": 2}}'),
        ("completions low surrogate", "/v1/completions",
         '{"prompt": "\\udfff", "max_tokens": 2}'),
        ("completions reversed pair", "/v1/completions",
         '{"prompt": "\\ude00\\ud83d", "max_tokens": 2}'),
        ("completions stop", "/v1/completions",
         f'{{"prompt": "hi", "max_tokens": 2, "stop": ["{s}"]}}'),
        ("completions bad_words", "/v1/completions",
         f'{{"prompt": "hi", "max_tokens": 2, "bad_words": ["{s}"]}}'),
        ("completions logit_bias key", "/v1/completions",
         f'{{"prompt": "hi", "max_tokens": 2, "logit_bias": {{"{s}": 1}}}}'),
        ("completions cache_salt", "/v1/completions",
         f'{{"prompt": "hi", "max_tokens": 2, "cache_salt": "{s}"}}'),
        ("completions user", "/v1/completions", f'{{"prompt": "hi", "user": "{s}"}}'),
        ("completions unknown key", "/v1/completions", f'{{"prompt": "hi", "{s}": 1}}'),
        ("chat content", "/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": "x{s}"}}], "max_tokens": 2}}'),
        ("chat content part", "/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{s}"}}]}}]}}'),
        ("chat role", "/v1/chat/completions",
         f'{{"messages": [{{"role": "{s}", "content": "hi"}}]}}'),
        ("chat name", "/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": "hi", "name": "{s}"}}]}}'),
        ("chat model", "/v1/chat/completions", f'{{{chat}, "model": "{s}"}}'),
        ("chat json schema", "/v1/chat/completions",
         f'{{{chat}, "response_format": {{"type": "json_schema", "json_schema": '
         f'{{"name": "x", "schema": {{"type": "string", "pattern": "{s}"}}}}}}}}'),
        ("chat tool name", "/v1/chat/completions",
         f'{{{chat}, "tools": [{{"type": "function", "function": {{"name": "{s}"}}}}]}}'),
        ("tokenize prompt", "/tokenize", f'{{"prompt": "{s}"}}'),
        ("tokenize messages", "/tokenize",
         f'{{"messages": [{{"role": "user", "content": "{s}"}}]}}'),
        ("embeddings input", "/v1/embeddings", f'{{"input": "{s}"}}'),
    ]
    out = [Case("lone surrogates", f"{name} (escaped)", js(path, body))
           for name, path, body in escaped]
    raw = [  # bytes that are not UTF-8
        ("surrogate bytes ed a0 80 in prompt", "/v1/completions",
         b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}'),
        ("surrogate bytes in chat", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
        ("surrogate bytes in tokenize", "/tokenize", b'{"prompt": "\xed\xb0\x80"}'),
        ("byte ff", "/v1/completions", b'{"prompt": "\xff", "max_tokens": 2}'),
        ("overlong c0 af", "/v1/completions", b'{"prompt": "\xc0\xaf", "max_tokens": 2}'),
        ("truncated e2 82", "/v1/completions", b'{"prompt": "\xe2\x82", "max_tokens": 2}'),
        ("latin-1 body", "/v1/completions", '{"prompt": "café"}'.encode("latin-1")),
        ("UTF-16 body", "/v1/completions", '{"prompt": "hi"}'.encode("utf-16")),
    ]
    out += [Case("bytes not UTF-8", name, http_request(path, body)) for name, path, body in raw]
    return out


def _type_cases() -> list[Case]:
    wrong = [
        ("max_tokens \"10\"", '"max_tokens": "10"'), ("max_tokens 10.5", '"max_tokens": 10.5'),
        ("max_tokens 2.0", '"max_tokens": 2.0'), ("max_tokens true", '"max_tokens": true'),
        ("stream \"yes\"", '"stream": "yes"'), ("stream 1", '"stream": 1'),
        ("stream \"true\"", '"stream": "true"'), ("echo \"no\"", '"echo": "no"'),
        ("n \"2\"", '"n": "2"'), ("temperature \"hot\"", '"temperature": "hot"'),
        ("stop 5", '"stop": 5'), ("logit_bias list", '"logit_bias": [1, 2]'),
        ("logit_bias key \"x\"", '"logit_bias": {"x": 1}'),
        ("stream_options \"yes\"", '"stream": true, "stream_options": "yes"'),
    ]
    out = [Case("wrong JSON types", f"completions {name}",
                js("/v1/completions", f'{{"prompt": "hi", {field}}}')) for name, field in wrong]
    out += [
        Case("wrong JSON types", "completions prompt {}", js("/v1/completions", '{"prompt": {}}')),
        Case("wrong JSON types", "completions prompt 5", js("/v1/completions", '{"prompt": 5}')),
        Case("wrong JSON types", "completions prompt [[]]",
             js("/v1/completions", '{"prompt": [[]]}')),
        Case("wrong JSON types", "chat messages \"hello\"",
             js("/v1/chat/completions", '{"messages": "hello"}')),
        Case("wrong JSON types", "chat logprobs 1", js("/v1/chat/completions",
             '{"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}')),
        Case("wrong JSON types", "detokenize tokens \"1 2\"",
             js("/detokenize", '{"tokens": "1 2"}')),
        Case("wrong JSON types", "tokenize add_special_tokens \"yes\"",
             js("/tokenize", '{"prompt": "hi", "add_special_tokens": "yes"}')),
    ]
    return out


def _float_cases() -> list[Case]:
    values = [
        ("logit_bias 1e308", '"logit_bias": {"5": 1e308}'),
        ("logit_bias Infinity", '"logit_bias": {"5": Infinity}'),
        ("logit_bias -Infinity", '"logit_bias": {"5": -Infinity}'),
        ("logit_bias NaN", '"logit_bias": {"5": NaN}'),
        ("logit_bias 101", '"logit_bias": {"5": 101}'),
        ("logit_bias 1e400", '"logit_bias": {"5": 1e400}'),
        ("temperature NaN", '"temperature": NaN'),
        ("temperature Infinity", '"temperature": Infinity'),
        ("temperature 1e400", '"temperature": 1e400'),
        ("top_p NaN", '"top_p": NaN'),
        ("presence_penalty 1e308", '"presence_penalty": 1e308'),
        ("repetition_penalty 1e400", '"repetition_penalty": 1e400'),
        ("min_p -1e308", '"min_p": -1e308'),
    ]
    return [Case("non-finite and out-of-range floats", f"completions {name}",
                 js("/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, {field}}}'))
            for name, field in values]


def _nesting_cases() -> list[Case]:
    out = []
    for depth in (1_000, 100_000, 1_000_000):
        out.append(Case("deep nesting", f"{depth} nested arrays",
                        http_request("/v1/completions", b"[" * depth + b"]" * depth)))
    deep = '{"a": ' * 200 + "1" + "}" * 200
    out += [
        Case("deep nesting", "200 nested objects in response_format",
             js("/v1/completions", f'{{"prompt": "hi", "response_format": {deep}}}')),
        Case("deep nesting", "200 nested objects in a json_schema", js(
            "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
            f'"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", '
            f'"schema": {deep}}}}}}}')),
        Case("deep nesting", "200 nested objects in tool parameters", js(
            "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
            f'"tools": [{{"type": "function", "function": {{"name": "f", '
            f'"parameters": {deep}}}}}]}}')),
        Case("deep nesting", "100k nested arrays as prompt", js(
            "/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}")),
    ]
    return out


def _size_cases() -> list[Case]:
    ids_50mb = b'{"max_tokens": 2, "prompt": [' + b"12345," * (50 * MB // 6) + b"1]}"
    many_ids = b'{"tokens": [' + b"7," * (500_000) + b"7]}"
    text_5m = b'{"prompt": "' + b"ab " * (5_000_000 // 3) + b'"}'
    text_900k = b'{"prompt": "' + b"x" * 900_000 + b'"}'
    return [
        Case("huge bodies", "50 MB of token ids to completions",
             http_request("/v1/completions", ids_50mb)),
        Case("huge bodies", "5 M characters to /tokenize", http_request("/tokenize", text_5m)),
        Case("huge bodies", "5 M characters of chat content", http_request(
            "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "'
            + b"ab " * (5_000_000 // 3) + b'"}]}')),
        Case("huge bodies", "900 k characters to /tokenize", http_request("/tokenize", text_900k)),
        Case("huge bodies", "500 k ids to /detokenize", http_request("/detokenize", many_ids)),
        Case("huge bodies", "2049 prompts", js(
            "/v1/completions", '{"max_tokens": 1, "prompt": [' + '"hi",' * 2048 + '"hi"]}')),
        Case("huge bodies", "10 k prompts", js(
            "/v1/completions", '{"max_tokens": 1, "prompt": [' + '"hi",' * 9999 + '"hi"]}')),
        Case("huge bodies", "100 k logit_bias entries", js(
            "/v1/completions", '{"prompt": "hi", "max_tokens": 1, "logit_bias": {'
            + ",".join(f'"{i}": 1' for i in range(100_000)) + "}}")),
        Case("huge bodies", "2049 embeddings inputs", js(
            "/v1/embeddings", '{"input": [' + '"hi",' * 2048 + '"hi"]}')),
        Case("huge bodies", "10 k stop strings", js(
            "/v1/completions", '{"prompt": "hi", "max_tokens": 1, "stop": ['
            + ",".join('"s"' for _ in range(10_000)) + "]}")),
        Case("huge bodies", "Content-Length 1 GB, no body", (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")),
    ]


def _json_cases() -> list[Case]:
    bodies = [("empty body", b""), ("not JSON", b"hello"), ("truncated", b'{"prompt": "hi"'),
              ("trailing garbage", b'{"prompt": "hi"} x'), ("top-level array", b"[1, 2]"),
              ("top-level null", b"null"), ("UTF-8 BOM", b'\xef\xbb\xbf{"prompt": "hi"}'),
              ("NUL bytes", b'{"prompt": "\x00"}')]
    out = [Case("malformed JSON", name, http_request("/v1/completions", body))
           for name, body in bodies]
    out.append(Case("malformed JSON", "text/plain content type",
                    http_request("/v1/completions", b'{"prompt": "hi"}', "text/plain")))
    return out


def _http_cases() -> list[Case]:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    body = b'{"prompt": "hi", "max_tokens": 1}'
    tls_hello = bytes.fromhex("16030100a5010000a10303") + os.urandom(32) + b"\x00" * 60
    cases = [
        ("bad chunk size", head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"),
        ("chunk longer than declared", head + b"Transfer-Encoding: chunked\r\n\r\n2\r\n"
         + body + b"\r\n0\r\n\r\n"),
        ("negative Content-Length", head + b"Content-Length: -5\r\n\r\n" + body),
        ("Content-Length and chunked", head + b"Content-Length: 5\r\nTransfer-Encoding: "
         b"chunked\r\n\r\n" + body),
        ("two Content-Lengths", head + b"Content-Length: 5\r\nContent-Length: 9\r\n\r\n" + body),
        ("1 MB header", head + b"X-Big: " + b"a" * MB + b"\r\n\r\n"),
        ("header name with a space", head + b"Bad Header: x\r\n\r\n"),
        ("TLS ClientHello to the plain port", tls_hello),
        ("garbage request line", b"\x00\x01\x02 / HTTP/1.1\r\n\r\n"),
        ("HTTP/9.9", b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n"),
    ]
    return [Case("malformed HTTP", name, raw, http_layer=True) for name, raw in cases]


def _responses_cases() -> list[Case]:
    """/v1/responses and tool calls: each a 400 naming the field, none a 5xx."""
    s = "\\ud800"
    call = '{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}'
    # Deeper than any body may nest (body.MAX_DEPTH): refused whatever the model's tool syntax
    # (60 levels fit under it or not depending on how the model's calls wrap the parameters).
    deep = '{"a": ' * 70 + "1" + "}" * 70
    bodies = [
        ("lone surrogate in input", f'{{"input": "a{s}"}}'),
        ("lone surrogate in instructions", f'{{"input": "hi", "instructions": "{s}"}}'),
        ("input 5", '{"input": 5}'),
        ("input []", '{"input": []}'),
        ("max_output_tokens 2**80", f'{{"input": "hi", "max_output_tokens": {2**80}}}'),
        ("max_output_tokens \"10\"", '{"input": "hi", "max_output_tokens": "10"}'),
        ("stream \"yes\"", '{"input": "hi", "stream": "yes"}'),
        ("unknown item type", '{"input": [{"type": "reasoning", "summary": []}]}'),
        ("function_call without call_id", '{"input": [{"type": "function_call", "name": "f"}]}'),
        ("function_call_output without output",
         '{"input": [{"type": "function_call_output", "call_id": "c"}]}'),
        ("a message without a role", '{"input": [{"content": "hi"}]}'),
        ("an image part", '{"input": [{"role": "user", "content": [{"type": "input_image"}]}]}'),
        ("unknown previous_response_id", '{"input": "hi", "previous_response_id": "resp_x"}'),
        ("tool_choice without tools", '{"input": "hi", "tool_choice": "required"}'),
        ("two tools of one name", '{"input": "hi", "tools": [{"type": "function", "name": "f"}, '
         '{"type": "function", "name": "f"}]}'),
        ("a function_call_output's call alone", f'{{"input": [{call}], "tools": "f"}}'),
        ("json_schema without a schema",
         '{"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}'),
        ("a schema no value satisfies", '{"input": "hi", "text": {"format": {"type": '
         '"json_schema", "name": "x", "schema": {"type": "nope"}}}}'),
        ("70 nested objects in tool parameters", '{"input": "hi", "tools": [{"type": '
         f'"function", "name": "f", "parameters": {deep}}}], "tool_choice": "required"}}'),
    ]
    out = [Case("responses API", name, js("/v1/responses", body)) for name, body in bodies]
    chat = '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1'
    out += [
        Case("responses API", "chat tool_choice auto without tools",
             js("/v1/chat/completions", f'{{{chat}, "tool_choice": "auto"}}')),
        Case("responses API", "chat tool_choice function not among the tools",
             js("/v1/chat/completions", f'{{{chat}, "tools": [{{"type": "function", '
                '"function": {"name": "f"}}], "tool_choice": {"type": "function", '
                '"function": {"name": "g"}}}')),
    ]
    return out


def cases() -> list[Case]:
    return (_int_cases() + _text_cases() + _type_cases() + _float_cases() + _nesting_cases()
            + _size_cases() + _json_cases() + _http_cases() + _responses_cases())


