"""Which layers each pipeline chunk holds.

Megatron's interleaved assignment: with ``P`` pipeline ranks and ``V`` virtual stages,
the model is cut into ``P * V`` equal chunks; chunk ``c = v * P + r`` lives on pipeline
rank ``r`` as its ``v``-th model chunk. Plain 1F1B is ``V = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineLayout:
    num_layers: int
    pp: int = 1
    vp: int = 1

    def __post_init__(self):
        if self.num_layers % (self.pp * self.vp):
            raise ValueError(
                f"num_layers={self.num_layers} is not divisible by pp*vp={self.pp * self.vp}"
            )

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vp

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // self.num_chunks

    def chunk(self, pp_rank: int, vp_stage: int = 0) -> int:
        return vp_stage * self.pp + pp_rank

    def rank_of(self, chunk: int) -> int:
        return chunk % self.pp

    def layers(self, chunk: int) -> range:
        """Global indices of the layers in ``chunk``."""
        start = chunk * self.layers_per_chunk
        return range(start, start + self.layers_per_chunk)

    def start(self, chunk: int) -> int:
        return chunk * self.layers_per_chunk

    def end(self, chunk: int) -> int:
        return (chunk + 1) * self.layers_per_chunk
