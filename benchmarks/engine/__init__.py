"""A step's own cost apart from the model: `batchwire bench step` and `overhead`, the scheduler,
runner and transport parts they time, CPU attention and the n-gram proposer."""
