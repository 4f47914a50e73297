"""Pooling (embeddings): one vector per request from its final hidden states."""
