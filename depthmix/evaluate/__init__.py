"""Evaluation of depthmix checkpoints: perplexity on token datasets and downstream tasks
through lm-evaluation-harness (``harness``)."""
