"""POST /v1/responses: OpenAI's Responses API on the chat path (request.py: the body; items.py:
input items to a conversation and output items back; store.py: previous_response_id;
create.py: the handler; events.py: its typed SSE events)."""
