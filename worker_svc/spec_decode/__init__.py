"""Speculative decoding on the worker: a verifying step's layout, rejection sampling, the reply."""
