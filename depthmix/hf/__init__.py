"""Hugging Face ``transformers`` checkpoints and ours, both ways.

* :mod:`.architecture`: which ``config.json`` maps onto our decoder (Qwen3, Llama) and the
  ``config.json`` of our model (no torch);
* :mod:`.names` (no torch) and :mod:`.weights`: tensor names and layouts, ours <->
  Hugging Face's;
* :mod:`.importer`: ``depthmix-import`` (a Hugging Face folder -> a depthmix checkpoint, a
  model preset and the tokenizer). Export is :mod:`depthmix.export.hf` (``depthmix-export``).
"""
