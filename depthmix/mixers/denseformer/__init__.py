"""``mixer=denseformer`` without its model code: options, DWA geometry, plan and cost.

The method (DenseFormer's depth-weighted averages) and its Megatron modules are described
in :mod:`depthmix.mixers.denseformer.model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from depthmix.mixers.base import LOOPED, SUMMED, ExtraParams, Mixer, MixerConfig, Variant
from depthmix.mixers.base import OpCall, model_hook
from depthmix.mixers.base import SavedActivations
from depthmix.planning.depth_plan import STEM, Entry


@dataclass
class DenseFormerConfig(MixerConfig):
    """Depth-weighted averages over the embedding and the earlier block outputs."""

    name: str = "denseformer"
    dilation: int = 1
    """``k``: a DWA after block ``i`` reads only ``X_j`` with ``j = i (mod k)``."""
    period: int = 1
    """``p``: a DWA only after every ``p``-th block (``i % p == 0``)."""

    def validate(self, model, parallel) -> None:
        super().validate(model, parallel)
        self.check_at_least("dilation", 1)
        self.check_at_least("period", 1)


@dataclass(frozen=True)
class DWAGeometry:
    """Which blocks have a DWA, what it averages, and the depth-state entries."""

    num_blocks: int
    dilation: int = 1
    period: int = 1

    @classmethod
    def from_config(cls, config) -> "DWAGeometry":
        return cls(config.unrolled_layers, config.mixer.dilation, config.mixer.period)

    def has_dwa(self, i: int) -> bool:
        return i >= 1 and i % self.period == 0

    def sources(self, i: int) -> List[int]:
        """``S(i)`` in increasing order (the last one is ``i``)."""
        return list(range(i % self.dilation, i + 1, self.dilation))

    @staticmethod
    def output_name(j: int) -> str:
        return f"x{j}"

    @staticmethod
    def average_name(i: int) -> str:
        return f"y{i}"

    def stream(self, i: int) -> str:
        """Entry holding ``Y_i``, the input of block ``i + 1`` (``i = L``: the head's)."""
        return self.average_name(i) if self.has_dwa(i) else self.output_name(i)

    def output_readers(self, j: int) -> List[int]:
        """Layers reading ``X_j`` after it is written (``num_blocks`` = the head)."""
        readers = [i - 1 for i in range(j + self.dilation, self.num_blocks + 1, self.dilation)
                   if self.has_dwa(i)]
        if not self.has_dwa(j):
            readers.append(j)  # X_j is Y_j: block j + 1 (or the head) reads it
        return sorted(readers)

    def entries(self, hidden_size: int) -> List[Entry]:
        out = []
        for j in range(self.num_blocks + 1):
            readers = self.output_readers(j)
            if readers:
                writer = STEM if j == 0 else j - 1
                out.append(Entry(self.output_name(j), (writer,), tuple(readers), (hidden_size,)))
            if self.has_dwa(j):
                out.append(Entry(self.average_name(j), (j - 1,), (j,), (hidden_size,)))
        return out


def denseformer_plan(config, tp: int) -> List[Entry]:
    return DWAGeometry.from_config(config).entries(config.hidden_size)


def extra_flops_per_token(config) -> int:
    """Forward FLOPs per token added to a vanilla decoder (whole model, ``d`` hidden)::

        sum over the blocks i = 1..L with a DWA (p | i) of 2 d |S(i)|,  |S(i)| = floor(i/k) + 1

    the weighted sum ``Y_i = sum_j alpha_{i,j} X_j`` (one multiply-add per source and
    element); ``d L (L + 3)`` for ``1 x 1``. Nothing is left out.
    """
    geo = DWAGeometry.from_config(config)
    return 2 * config.hidden_size * sum(len(geo.sources(i)) for i in range(1, geo.num_blocks + 1)
                                        if geo.has_dwa(i))


def extra_io_per_token(config) -> int:
    """Activation elements read and written per token beyond vanilla (whole model, ``d``
    hidden): each DWA reads its ``|S(i)|`` sources and writes the average::

        sum over the blocks i with a DWA of (|S(i)| + 1) d

    (the paper's Appendix B.3; ``d (L (L + 5) / 2)`` for ``1 x 1``). The residual adds stay."""
    geo = DWAGeometry.from_config(config)
    return config.hidden_size * sum(len(geo.sources(i)) + 1
                                    for i in range(1, geo.num_blocks + 1) if geo.has_dwa(i))


def extra_params(config, tp: int = 1) -> ExtraParams:
    """The DWA weights ``alpha_i`` (``|S(i)|`` scalars, replicated), held by the stored
    layer applied at depth ``i``: stored layer ``u`` owns depths ``t * num_layers + u + 1``
    over the loops ``t``, so the count grows with depth; ``L (L + 3) / 2`` for ``1 x 1``."""
    geo = DWAGeometry.from_config(config)
    n = config.num_layers
    return ExtraParams(layers=tuple(
        sum(len(geo.sources(i)) for i in range(u + 1, geo.num_blocks + 1, n) if geo.has_dwa(i))
        for u in range(n)))


def saved_activations(config, tp: int, micro_batch: int) -> SavedActivations:
    """Each DWA after block ``i`` saves its ``|S(i)|`` sources by reference; the earlier
    ones are held anyway (saved by an earlier DWA, or as the next block's input where no
    DWA followed), so what it adds is the block's own output ``X_i``, ``h`` (on the
    sequence shard), which the next block does not read (it reads ``Y_i``)."""
    geo = DWAGeometry.from_config(config)
    t = tp if config.sequence_parallel else 1
    return SavedActivations(layers={
        i - 1: config.hidden_size / t
        for i in range(1, config.unrolled_layers + 1) if geo.has_dwa(i)})


def step_work(config, tokens: int) -> List[OpCall]:
    """Per DWA the weighted sum of its ``|S(i)|`` sources: read them, write the average
    (``2 h`` FLOPs a source and token); backward ``dY`` and the sources in, their gradients
    out."""
    geo, th = DWAGeometry.from_config(config), tokens * config.hidden_size
    return [OpCall("dwa", f"block {i}", "elementwise",
                   (th * len(geo.sources(i)), th, 2 * th * len(geo.sources(i))))
            for i in range(1, geo.num_blocks + 1) if geo.has_dwa(i)]


MIXER = Mixer(
    name="denseformer", config_cls=DenseFormerConfig, plan=denseformer_plan,
    model_spec=model_hook(__name__, "get_denseformer_model_spec"),
    extra_flops_per_token=extra_flops_per_token, extra_io_per_token=extra_io_per_token,
    extra_params=extra_params, saved_activations=saved_activations, step_work=step_work,
    variants=(
        Variant(checks=("accounting", "generate", "parity")),
        Variant("k2p1", {"dilation": 2, "period": 1}, checks=("decode", "recompute", "transport"),
                recompute_rtol=SUMMED),
        Variant("k2p2", {"dilation": 2, "period": 2}, checks=("accounting",)),
        Variant("p2-looped", {"period": 2}, model=LOOPED, checks=("accounting",)),
    ))
