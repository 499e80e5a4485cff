"""Native PyTorch PersonaPlex: temporal LM, depformer and the Mimi codec (spec §B-D)."""
