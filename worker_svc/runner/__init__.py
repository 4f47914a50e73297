"""The model runner (ExecuteModel, SampleTokens) and the Worker that loads it."""
