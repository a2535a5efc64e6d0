"""Checkpoints, one concern per module: ``store`` (files on disk, tracker, metadata, health
marks), ``resume`` (which checkpoint a run starts from or rolls back to), ``retention`` (the
one keep/prune rule), ``guard`` (save-dir lock, room for a checkpoint, clean failure of a
save), ``distributed`` (Megatron dist_checkpointing save/load), ``integrity`` (file manifests) and
``record`` (the model record). No other module touches checkpoint files."""
