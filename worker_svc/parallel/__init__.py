"""Splitting the model over ranks: tensor-parallel shards and pipeline stages."""
