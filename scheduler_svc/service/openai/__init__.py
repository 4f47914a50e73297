"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/embeddings and
their neighbours, served by FastAPI + uvicorn in the scheduler's own process and event loop.

Each HTTP request becomes a `GenerateRequest` (or `EmbedRequest`) and is admitted through the
Generation servicer's own path (`GenerationServicer.admit`): the same parsing, the same
validation at admission, the same streams. Nothing here validates a sampling field a second
time; errors are renamed to the HTTP field the client sent and mapped from the gRPC status to an
HTTP one in errors.py.
"""
