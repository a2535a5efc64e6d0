"""Evaluation of checkpoints: ``depthmix-eval`` (perplexity on token datasets at any layout;
lm-eval tasks through ``harness``)."""
