"""Checkpoints: the one-file checkpointer and sharded (DCP) checkpoints."""
