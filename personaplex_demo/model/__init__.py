"""Native PyTorch PersonaPlex: temporal LM, depformer and the Mimi codec (docs/model.md)."""
