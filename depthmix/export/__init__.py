"""Export checkpoints to other frameworks (``depthmix-export``: Hugging Face transformers)."""
