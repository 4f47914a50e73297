"""Sampling a step's tokens from its logits: shaping, the sampler and its metadata, the wire."""
