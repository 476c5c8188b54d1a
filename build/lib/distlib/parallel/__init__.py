"""Gradient sync and sharding: GradSync and its buckets, optimizer sharding (ZeRO-1), full sharding
(FSDP2), and the one-process-per-node fallback."""
