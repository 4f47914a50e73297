"""Sampling a step's tokens from its logits: shaping, the sampler, its metadata, the reply's wire."""
