"""Imported Hugging Face models at TP2, PP2 and TP2 x PP2, and what starts from them, in one
group of 4 gloo processes:

* each import's logits (the last stage's output layer, gathered over TP) and eval loss
  equal transformers' (fp32, 1e-5); the Qwen3-MoE import at TP2 x PP2 (experts with
  sequence parallelism), every layout of both Qwen3-MoE imports in the full lane;
* ``depthmix-eval`` at TP2 x PP2 holds the weights and nothing else: measured as the bytes
  of every live tensor the evaluator added (no DDP gradient buffer, no main grads), against
  today's training-built model evaluated alike (same loss);
* ``mixer=attnres_block train.load_weights_only=true`` from the Qwen3 import trains 5 steps
  at PP2 with finite losses; its first loss is the imported model's (AttnRes starts as the
  plain residual network up to the norm epsilon);
* tied embeddings train at PP2 and TP2 x PP2 as on one rank (losses, gradients): Megatron's
  embedding-group all-reduce of the shared weight.
"""

import gc
import math

import pytest
import torch

from depthmix.testing import SyntheticData, assert_same_training, spawn, tiny_run
from hf_models import DENSE_KINDS, MOE_KINDS, SEQ, VOCAB, checkpoints, hf_window_loss

pytestmark = pytest.mark.multiproc

LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}, "tp2_pp2": {"tp": 2, "pp": 2}}  # DP fills 4
BATCH = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))


def batch() -> dict:
    return {"tokens": BATCH[:, :-1], "labels": BATCH[:, 1:],
            "loss_mask": torch.ones(2, SEQ), "position_ids": torch.arange(SEQ).expand(2, SEQ)}


def live_tensor_bytes() -> int:
    """Bytes of every storage a live tensor of this process holds (parameters, buffers,
    gradient buffers and their views counted once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            if storage.data_ptr():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _logits_and_loss(ckpt: str, parallel: dict):
    """Build the imported model lean at ``parallel``, load it, run one eval step; returns
    (full logits on the logging rank else None, loss)."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from depthmix.checkpoint.distributed import load
    from depthmix.checkpoint.record import run_from_record
    from depthmix.checkpoint.store import find_checkpoint, read_meta
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.megatron_ext.model import unwrap
    from depthmix.mixers import mixer_of
    from depthmix.pretrain.parallelize import (
        build_chunks,
        destroy_model_parallel,
        init_distributed,
    )
    from depthmix.pretrain.step import eval_step

    path = find_checkpoint(ckpt)
    run = run_from_record(read_meta(path)["record"], impl="torch")
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    run.parallel.sequence_parallel = run.model.experts is not None and run.parallel.tp > 1
    topo = init_distributed(run)
    model = build_chunks(run, mixer_of(run), to_transformer_config(run), topo)
    load(path, run=run, model=model, topo=topo, weights_only=True)
    captured = []
    last = unwrap(model[-1])
    if last.post_process:
        # a copy: Megatron's vocab-parallel cross entropy overwrites the logits in place
        last.output_layer.register_forward_hook(
            lambda m, i, out: captured.append(out[0].detach().clone()))
    loss = eval_step(model, [batch()], SEQ).loss
    logits = None
    if captured:  # [s, b, vocab/tp] -> [b, s, vocab]
        full = tensor_parallel.gather_from_tensor_model_parallel_region(captured[0])
        logits = full.transpose(0, 1)
    keep = topo.is_logging_rank
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, logits if keep else None)
    destroy_model_parallel()
    return next(x for x in everyone if x is not None), loss


def _lean_evaluation(ckpt: str, dataset: str, tmp: str) -> dict:
    """depthmix-eval's evaluator at TP2 x PP2, then today's DDP-wrapped model evaluated
    alike: their loss and the tensor bytes each added, next to the weights' bytes."""
    from depthmix.checkpoint.distributed import load
    from depthmix.evaluate.job import compose_job
    from depthmix.evaluate.perplexity import Evaluator
    from depthmix.mixers import mixer_of
    from depthmix.pretrain.parallelize import build_model, destroy_model_parallel

    job = compose_job(f"eval.checkpoint={ckpt}", f"eval.datasets={{d: {dataset}}}",
                      "eval.batch_size=2", f"eval.output={tmp}/lean.json", "logger=none",
                      "parallel.tp=2", "parallel.pp=2", world_size=4)
    before = live_tensor_bytes()
    evaluator = Evaluator(job.run, job.checkpoint)
    out = {"lean_bytes": live_tensor_bytes() - before,
           "weights": sum(p.numel() * p.element_size() for c in evaluator.model
                          for p in c.parameters()),
           "main_grads": sum(hasattr(p, "main_grad") for c in evaluator.model
                             for p in c.parameters())}
    evaluate = lambda: evaluator.evaluate(job.datasets[0], 2, job.num_microbatches)  # noqa: E731
    out["lean_loss"] = evaluate().loss
    evaluator.model = None
    before = live_tensor_bytes()
    evaluator.model = build_model(job.run, mixer_of(job.run), evaluator.config,
                                  evaluator.topo)
    load(job.checkpoint, run=job.run, model=evaluator.model, topo=evaluator.topo,
         weights_only=True)
    out["ddp_bytes"] = live_tensor_bytes() - before
    out["ddp_loss"] = evaluate().loss
    del evaluator
    destroy_model_parallel()
    return out


def _continue_with_attnres(out_dir: str, name: str) -> list:
    from depthmix.config.load import compose_run
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer

    run = compose_run(f"hydra.searchpath=[file://{out_dir}/configs]", f"model={name}",
                      "mixer=attnres_block", "parallel.pp=2",
                      f"train.load_dir={checkpoints(out_dir)}", "train.load_weights_only=true",
                      "train.steps=5", "train.micro_batch_size=1", "train.global_batch_size=4",
                      "train.eval_interval=0", "logger=none", "logger.progress=false",
                      f"output_dir={out_dir}_attnres")
    trainer = Trainer(run, data=SyntheticData, callbacks=[])
    losses = [trainer.train_one_step().loss for _ in range(5)]
    del trainer
    destroy_model_parallel()
    return losses


def tied_run(**parallel):
    run = tiny_run()
    run.model.tie_embeddings = True
    run.train.micro_batch_size, run.train.global_batch_size, run.train.lr = 2, 8, 1e-2
    for key, value in parallel.items():
        setattr(run.parallel, key, value)
    return run


def _train_tied(destroy: bool = True, **parallel) -> dict:
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import gather_full

    run = tied_run(**parallel)
    trainer = Trainer(run, data=SyntheticData, callbacks=[])
    result = {"losses": []}

    def grads(model):
        full = gather_full(model, "grad")
        full.pop("output_layer.weight", None)  # the last stage's copy of the embedding
        result["grads"] = full

    for step in range(3):
        result["losses"].append(trainer.train_one_step(after_backward=grads if step == 0
                                                       else None).loss)
    del trainer
    if destroy:
        destroy_model_parallel()
    return result


def _at_layouts(imported: dict, layouts: dict) -> dict:
    """kind -> layout name -> (logits, loss), for ``layouts``: kind -> {name: parallel}."""
    return {kind: {name: _logits_and_loss(checkpoints(imported[kind]), parallel)
                   for name, parallel in of_kind.items()} for kind, of_kind in layouts.items()}


def _everything(imported: dict, dataset: str, tmp: str) -> dict:
    """One rank of the 4-process group."""
    out = {"layouts": _at_layouts(imported, {kind: LAYOUTS for kind in DENSE_KINDS}
                                  | {"qwen3_moe": {"tp2_pp2": LAYOUTS["tp2_pp2"]}})}
    out["lean"] = _lean_evaluation(checkpoints(imported["qwen3"]), dataset, tmp)
    out["attnres"] = _continue_with_attnres(imported["qwen3"], "qwen3")
    out["tied"] = {name: _train_tied(**parallel) for name, parallel in
                   {"pp2": {"pp": 2}, "tp2_pp2": {"tp": 2, "pp": 2}}.items()}
    return out


@pytest.fixture(scope="module")
def group(imported, dataset, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("layouts"))
    return spawn(_everything, 4, (imported, dataset, tmp), timeout=900)[0]


@pytest.fixture(scope="module")
def hf(hf_dirs):
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for k, p in hf_dirs.items()}


def assert_transformers(result, model) -> None:
    logits, loss = result
    b = batch()
    with torch.no_grad():
        theirs = model(b["tokens"]).logits
    torch.testing.assert_close(logits, theirs, rtol=0, atol=1e-5)
    ce = torch.nn.functional.cross_entropy(theirs.reshape(-1, VOCAB), b["labels"].reshape(-1))
    assert loss == pytest.approx(ce.item(), rel=1e-6)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", DENSE_KINDS)
def test_logits_and_loss_equal_transformers_at_every_layout(kind, layout, group, hf):
    assert_transformers(group["layouts"][kind][layout], hf[kind])


def test_experts_at_tp2_pp2_equal_transformers(group, hf):
    """Megatron's MoE layer under TP2 + sequence parallelism and PP2: routers and experts
    resharded from the single-rank import."""
    assert_transformers(group["layouts"]["qwen3_moe"]["tp2_pp2"], hf["qwen3_moe"])


@pytest.mark.full
def test_experts_equal_transformers_at_every_layout(imported, hf):
    results = spawn(_at_layouts, 4, (imported, {kind: LAYOUTS for kind in MOE_KINDS}),
                    timeout=900)[0]
    for kind in MOE_KINDS:
        for layout in LAYOUTS:
            assert_transformers(results[kind][layout], hf[kind])


def test_evaluation_holds_the_weights_and_no_gradient_buffers(group, hf, dataset):
    lean = group["lean"]
    print(f"\nTP2xPP2 rank 0: weights {lean['weights']} B, lean evaluator added "
          f"{lean['lean_bytes']} B, DDP-wrapped {lean['ddp_bytes']} B")
    assert lean["main_grads"] == 0
    assert lean["weights"] <= lean["lean_bytes"] <= 1.05 * lean["weights"] + 64 * 1024
    assert lean["ddp_bytes"] >= 1.9 * lean["weights"]  # what it no longer allocates
    assert lean["lean_loss"] == lean["ddp_loss"]
    assert lean["lean_loss"] == pytest.approx(hf_window_loss(hf["qwen3"], dataset)[0], rel=1e-6)


def test_attnres_block_trains_from_the_import_at_pp2(group, hf):
    from depthmix.testing import synthetic_sample

    losses = group["attnres"]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    tokens, labels = zip(*(synthetic_sample(1234, i, SEQ, VOCAB) for i in range(4)))
    with torch.no_grad():
        logits = hf["qwen3"](torch.stack(tokens)).logits
    vanilla = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                torch.stack(labels).reshape(-1)).item()
    assert losses[0] == pytest.approx(vanilla, rel=1e-3)


@pytest.fixture(scope="module")
def tied_reference(megatron_single):
    return _train_tied(destroy=False)  # this process's world of one stays for other tests


@pytest.mark.parametrize("layout", ["pp2", "tp2_pp2"])
def test_tied_embeddings_train_as_on_one_rank(layout, group, tied_reference):
    result = group["tied"][layout]
    assert_same_training(result, tied_reference, f"tied@{layout}", loss_rtol=1e-5,
                         grad_rtol=1e-5)
    assert "output_layer.weight" not in tied_reference["grads"]
