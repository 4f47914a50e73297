"""The OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/embeddings and
their neighbours, served by FastAPI + uvicorn in the scheduler's own process and event loop.

Each HTTP request's prompts are tokenized as Generate tokenizes them and become the plain
`GenerationRequest` that Generate parses its message into (`service/generation_request.py`;
an embedding request becomes an `EmbedRequest`), admitted through the Generation servicer's
own path (`GenerationServicer.admit`): the same validation at admission, the same streams.
Nothing here validates a sampling field a second time; errors are renamed to the HTTP field the
client sent and mapped from the gRPC status to an HTTP one in errors.py.
"""
