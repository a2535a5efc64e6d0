"""Evaluation of checkpoints: ``depthmix-eval`` (perplexity on token datasets, lm-eval tasks)."""
