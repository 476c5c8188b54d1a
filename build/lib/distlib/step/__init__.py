"""The training step's speed-ups: compile around the sync, CUDA-graph capture, the weight EMA."""
