"""The run configuration: typed dataclasses (``schema``), Hydra's config store (``store``),
loading a composed config into them (``load``) and the option checks (``validate``).
Nothing here imports Megatron."""
