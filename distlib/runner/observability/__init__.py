"""What a run shows and leaves behind: the metrics and their sinks (metrics.jsonl, TensorBoard,
W&B, MLflow), the progress display, curves, where the time went, the profiler, throughput and the
environment it ran on."""
