"""The offline engine (LLM) measured in one process: `batchwire bench throughput`, `prefix` and
`spec`, and the scripts for structured output, embeddings and pipeline parallelism."""
