"""The training step's speed-ups: compile around the sync, CUDA-graph capture, float8 products, the weight EMA."""
