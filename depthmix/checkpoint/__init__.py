"""Checkpoints: files on disk and which one a run resumes, the model record, integrity manifests, the save guard and Megatron distributed save/load."""
