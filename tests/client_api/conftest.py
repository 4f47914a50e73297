"""The session server fixtures (server_process, offline_llm, server) live in tests/conftest.py,
shared with tests/structured_output."""
