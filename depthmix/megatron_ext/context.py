"""Per-forward context handed to every layer alongside the depth state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from torch import Tensor


@dataclass
class ForwardContext:
    rotary_pos_emb: Optional[Tensor] = None
    """RoPE frequencies for the positions of this forward ``[s, 1, 1, d]``."""
    layer: int = 0
    """Unrolled global index of the running layer (differs from the module's own index
    in a looped transformer). Depth logic must use this, not ``layer_number``."""
    inference: Optional["KVCache"] = None  # noqa: F821
    """KV cache for incremental decoding; None in training."""
    stats: Optional[Dict[str, Tensor]] = None
    """When a dict, mixers record depth-weight statistics into it (no-grad passes only)."""
    extras: Dict[str, object] = field(default_factory=dict)

    def record(self, key: str, value: Tensor) -> None:
        if self.stats is not None:
            self.stats[f"layer{self.layer}/{key}"] = value.detach().float()
