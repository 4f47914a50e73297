"""What the scheduler and worker services share, installed as `batchwire.common`: TLS settings,
model-file lookup, size parsing and the worker's launch settings. Nothing here imports torch,
so a scheduler that drives remote workers runs without it."""
