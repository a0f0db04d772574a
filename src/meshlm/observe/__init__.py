"""What a run reports: progress and metrics.jsonl, TensorBoard / W&B sinks, the run report."""
