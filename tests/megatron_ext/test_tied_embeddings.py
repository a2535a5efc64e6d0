"""``model.tie_embeddings``: one matrix for the input embedding and the output layer, on one
rank (its layouts: ``tests/hf/test_import_layouts.py``), and counted once by the
accounting and the memory model."""

import torch

from depthmix.mixers import get_mixer
from depthmix.planning import flops, memory
from depthmix.testing import build_model, tiny_run


def tied_run():
    run = tiny_run()
    run.model.tie_embeddings = True
    return run


def test_the_output_layer_reads_the_embedding(megatron_single):
    model = build_model(tied_run())
    names = [n for n, _ in model.named_parameters()]
    assert "output_layer.weight" not in names and "embedding.word_embeddings.weight" in names
    hidden = []
    model.final_layernorm.register_forward_hook(lambda m, i, out: hidden.append(out))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x)  # [b, s, vocab]
    want = hidden[0].transpose(0, 1) @ model.embedding.word_embeddings.weight.t()
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    assert "output_layer.weight" not in model.sharded_state_dict()


def test_parameters_and_memory_count_the_matrix_once(megatron_single):
    run, vanilla = tied_run(), get_mixer("vanilla")
    numel = sum(p.numel() for p in build_model(run).parameters())
    assert flops.total_params(run, vanilla) == numel
    assert memory.estimate(run, vanilla, world_size=1)[0].params == numel
    untied = tiny_run()
    assert flops.total_params(untied, vanilla) - numel == 128 * 64  # padded vocab x hidden
    run.parallel.pp = 2  # each end stage holds a copy
    first, last = memory.estimate(run, vanilla, world_size=2)
    untied.parallel.pp = 2
    assert [r.params for r in memory.estimate(untied, vanilla, world_size=2)] == [first.params,
                                                                                  last.params]
