"""A server under load: the gRPC and OpenAI-compatible load generators, the serving metrics, and
`batchwire bench serve`."""
