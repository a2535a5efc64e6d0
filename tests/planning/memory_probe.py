"""What a real training step holds, per rank: bytes saved for backward per micro-batch
(counted with ``torch.autograd.graph.saved_tensors_hooks``, shared storages once,
parameters left out) and parameter, gradient and optimizer-state bytes.

:func:`probe_runs` runs in every rank of a :func:`depthmix.testing.spawn` group.
"""

from __future__ import annotations

import torch


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s


class SavedBytes:
    """Storages saved for backward while a model chunk runs its forward (``forward``) and
    while full recomputation re-runs layers in backward (``recompute``)."""

    def __init__(self, model, exclude_ptrs: set):
        self.exclude = exclude_ptrs
        self.phase = "recompute"
        self.seen = {"forward": {}, "recompute": {}}
        self.handles = []
        for chunk in model:
            self.handles.append(chunk.register_forward_pre_hook(self._enter))
            self.handles.append(chunk.register_forward_hook(self._leave))

    def _enter(self, *_):
        self.phase = "forward"

    def _leave(self, *_):
        self.phase = "recompute"

    def pack(self, t: torch.Tensor):
        ptr, storage = _storage_key(t)
        if ptr not in self.exclude and storage.nbytes() > 0:
            self.seen[self.phase].setdefault(ptr, storage)  # kept alive: no address reuse
        return t

    def bytes(self, phase: str) -> int:
        return sum(s.nbytes() for s in self.seen[phase].values())

    def close(self):
        for h in self.handles:
            h.remove()


def _optimizer_state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    seen = {}
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        for state in torch_opt.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and k != "step":
                    seen[v.untyped_storage().data_ptr()] = v.numel() * v.element_size()
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or []:
            for p in group:
                seen[p.untyped_storage().data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def probe_one(run) -> dict:
    """One training step of ``run`` on this rank; what it held."""
    from megatron.core import parallel_state as ps

    from depthmix.megatron_ext.model import unwrap
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import _DataForRank

    trainer = Trainer(run, data=_DataForRank(run), callbacks=[])
    chunks = [unwrap(m) for m in trainer.model]
    params = [p for c in chunks for p in c.parameters()]
    exclude = {p.untyped_storage().data_ptr() for p in params}
    saved = SavedBytes(chunks, exclude)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        trainer.train_one_step()
    saved.close()
    out = {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
        "optimizer_bytes": _optimizer_state_bytes(trainer.optimizer),
        "saved_per_micro": saved.bytes("forward") / trainer.num_microbatches,
        "recompute_bytes": saved.bytes("recompute"),
    }
    del trainer  # the parallel state stays for the next run of the same layout
    return out


def probe_runs(runs: list) -> list:
    """Every rank: :func:`probe_one` for each run; rank 0 returns them all, per rank."""
    import torch.distributed as dist

    mine = [probe_one(run) for run in runs]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [[everyone[r][i] for r in range(len(everyone))] for i in range(len(runs))]
