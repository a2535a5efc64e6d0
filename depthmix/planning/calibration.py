"""Published training layouts the planner is checked against (docs/scaling.md,
"Calibration"): each row's model, sequence length, global batch and GPU count go in, and
the planner must choose the published layout or predict it within :data:`TOLERANCE` of
its own choice's step time.

    python -m depthmix.planning.calibration      # the comparison table, as markdown

Rows map onto this codebase's decoder (RMSNorm, SwiGLU): a GELU MLP of width ``4h`` becomes
a SwiGLU of ``8h/3`` (rounded to 64; the same FLOPs and parameters). FP8 runs are planned
with the FP8 dense peak (:data:`FP8_PEAK`); their memory is not the memory
model's (:func:`compare`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from tabulate import tabulate

from depthmix.planning.hardware import H100
from depthmix.planning.units import GIB

FP8_PEAK = H100.tflops["fp8"]

TOLERANCE = 0.05

_MEGATRON_README = "Megatron-LM README, Training speed and scalability (H100)"
_NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU "
              "Clusters Using Megatron-LM, Table 1 (A100)")
_NEMO = "NeMo Framework 24.12 Performance Summary, LLM pre-training (H100, FP8)"


def _model(layers: int, hidden: int, heads: int, ffn: int, vocab: int, seq: int,
           groups: Optional[int] = None) -> Tuple[str, ...]:
    return ("model=1p5b", f"model.num_layers={layers}", f"model.hidden_size={hidden}",
            f"model.ffn_hidden_size={ffn}", f"model.num_attention_heads={heads}",
            f"model.num_query_groups={groups or heads}", f"model.vocab_size={vocab}",
            f"model.seq_length={seq}")


def _swiglu(hidden: int) -> int:
    return round(8 * hidden / 3 / 64) * 64


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    model: Tuple[str, ...]
    global_batch: int
    gpus: int
    gpu: str
    tp: int
    pp: int
    vp: Optional[int] = None
    micro_batch: Optional[int] = None
    """As published; None: not stated (any)."""
    fp8: bool = False
    published_mfu: Optional[float] = None

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def overrides(self) -> List[str]:
        # overlap on for every row, as Megatron-LM's and NeMo's performance recipes run
        # (--overlap-grad-reduce --overlap-param-gather); the 2021 rows' DP term is small
        return [*self.model, "train.precision=bf16",
                f"train.global_batch_size={self.global_batch}",
                "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]

    def cluster(self):
        from depthmix.planning.planner import Cluster

        return Cluster(gpus=self.gpus, gpu=self.gpu,
                       peak_tflops=FP8_PEAK if self.fp8 else None)

    def published(self) -> str:
        vp = f" vp{self.vp}" if self.vp else ""
        mb = f" mb{self.micro_batch}" if self.micro_batch else ""
        return f"tp{self.tp} pp{self.pp}{vp} dp{self.dp}{mb}"


ROWS = (
    Row("GPT 1.7B", _MEGATRON_README, _model(24, 2048, 16, _swiglu(2048), 51200, 4096),
        global_batch=1152, gpus=48, gpu="h100", tp=1, pp=1, published_mfu=0.41),
    Row("GPT 1.7B", _NARAYANAN, _model(24, 2304, 24, _swiglu(2304), 51200, 2048),
        global_batch=512, gpus=32, gpu="a100", tp=1, pp=1, published_mfu=0.44),
    Row("GPT 3.6B", _NARAYANAN, _model(30, 3072, 32, _swiglu(3072), 51200, 2048),
        global_batch=512, gpus=64, gpu="a100", tp=2, pp=1, published_mfu=0.44),
    Row("GPT 7.5B", _NARAYANAN, _model(36, 4096, 32, _swiglu(4096), 51200, 2048),
        global_batch=512, gpus=128, gpu="a100", tp=4, pp=1, published_mfu=0.46),
    Row("GPT3 5B", _NEMO, _model(24, 4096, 32, _swiglu(4096), 51200, 2048),
        global_batch=2048, gpus=64, gpu="h100", tp=1, pp=1, micro_batch=4, fp8=True,
        published_mfu=765 / FP8_PEAK),
    Row("Llama 2 7B", _NEMO, _model(32, 4096, 32, 11008, 32000, 4096),
        global_batch=128, gpus=8, gpu="h100", tp=1, pp=1, micro_batch=1, fp8=True,
        published_mfu=780 / FP8_PEAK),
    Row("Llama 2 13B", _NEMO, _model(40, 5120, 40, 13824, 32000, 4096),
        global_batch=128, gpus=16, gpu="h100", tp=1, pp=4, vp=10, micro_batch=1, fp8=True,
        published_mfu=760 / FP8_PEAK),
    Row("Nemotron 8B", _NEMO, _model(32, 4096, 32, _swiglu(4096 * 4 // 2), 256000, 4096),
        global_batch=256, gpus=64, gpu="h100", tp=2, pp=1, micro_batch=4, fp8=True,
        published_mfu=643 / FP8_PEAK),
)


@dataclass
class Comparison:
    row: Row
    chosen: object  # planner.Candidate
    published: Optional[object]  # the published layout's fastest fitting candidate
    mixer: object  # the vanilla Mixer the rows are planned with

    @property
    def ratio(self) -> float:
        """Published layout's predicted step time over the chosen one's (inf: not fitting)."""
        if self.published is None:
            return float("inf")
        return self.published.step_seconds / self.chosen.step_seconds

    @property
    def ok(self) -> bool:
        return self.ratio <= 1 + TOLERANCE

    def predicted_mfu(self, candidate) -> float:
        from depthmix.config.load import compose_run
        from depthmix.planning.flops import flops_per_token

        run = compose_run(*self.row.overrides())
        kind = self.row.cluster().kind()
        flops = flops_per_token(run, self.mixer)["train"]
        tflops = flops * candidate.tokens_per_s / self.row.gpus
        return tflops / (kind.peak_tflops * 1e12)


def _matches(lay, row: Row) -> bool:
    return ((lay.tp, lay.pp, lay.vp, lay.dp) == (row.tp, row.pp, row.vp, row.dp)
            and row.micro_batch in (None, lay.micro_batch))


def compare(row: Row, vanilla) -> Comparison:
    """The planner's choice and the published layout's fastest fitting candidate
    (``vanilla``: the vanilla :class:`~depthmix.mixers.base.Mixer`, the rows' models). For a
    Transformer Engine + FP8 row the memory model does not apply (it counts the PyTorch
    attention's saved tensors): the published layout is taken to fit as published (no
    recomputation), and so is every layout that needs no more memory."""
    from depthmix.config.load import compose_run
    from depthmix.planning import planner

    cluster = row.cluster()
    budget = (cluster.kind().memory_gib - cluster.reserve_gib) * GIB
    if row.fp8:
        cluster.memory_gib = 1e6
    fitting, _ = planner.plan(compose_run(*row.overrides()), vanilla, cluster)
    if row.fp8:
        as_run = [c for c in fitting if _matches(c.layout, row) and c.layout.recompute == "none"]
        budget = max([budget] + [c.peak_bytes for c in as_run[:1]])
        fitting = [c for c in fitting if c.peak_bytes <= budget]
    published = next((c for c in fitting if _matches(c.layout, row)), None)
    return Comparison(row, fitting[0], published, vanilla)


def table(vanilla, rows=ROWS) -> str:
    """Markdown: each row's published layout against the planner's choice."""
    body = []
    for row in rows:
        c = compare(row, vanilla)
        mfu = f"{row.published_mfu:.0%}" if row.published_mfu else "–"
        ratio = "does not fit" if c.published is None else f"{c.ratio:.3f}"
        body.append([row.name, f"{row.gpus} x {row.gpu.upper()}", row.source, row.published(),
                     mfu, c.chosen.layout.short(), ratio, f"{c.predicted_mfu(c.chosen):.0%}"])
    head = ["model", "GPUs", "source", "published", "MFU published", "planner's choice",
            "published / chosen step time", "MFU predicted"]
    return tabulate(body, head, tablefmt="pipe", disable_numparse=True,
                    colalign=("left", "right", "left", "left", "right", "left", "right",
                              "right"))


if __name__ == "__main__":  # a program: above the mixers, it may look one up
    from depthmix.mixers import get_mixer

    print(table(get_mixer("vanilla")))
