"""Data: the sharded, resumable loader."""
