"""The worker's servers: the Worker service over gRPC and ZMQ, one servicer behind both."""
