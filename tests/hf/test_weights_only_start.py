"""A weights-only load of a plain (vanilla) checkpoint into every mixer, through
``checkpoint.distributed.load``: the vanilla weights are loaded, the mixer's own parameters
keep their initialisation, and the model starts as the plain residual network exactly,
up to the norm epsilon, approximately, or not at all, as docs/checkpoints.md says."""

import pytest
import torch

from hf_models import SEQ, VOCAB, checkpoints

# case -> (mixer, options, largest logit difference from the imported vanilla model;
# None: it must differ)
CASES = {
    "vanilla": ("vanilla", {}, 0.0),
    "denseformer": ("denseformer", {}, 0.0),  # identity DWA weights
    # zero pseudo-queries: an average, the same as the sum through the RMSNorm (1.5e-5 seen)
    "attnres_full": ("attnres_full", {}, 1e-4),
    "attnres_block": ("attnres_block", {}, 1e-4),
    "mhc": ("mhc", {}, 0.5),  # the mHC paper's init: H_res ~ 0.993 I (0.24 seen, logits ~6)
    "depth_attn": ("depth_attn", {}, None),  # mixes values from the start, no parameters
    "moda": ("moda", {}, None),  # depth keys/values join every softmax
    "ddl": ("ddl", {}, None),  # the Delta operator with beta = 1 is not the identity
    "short_swa": ("vanilla", {"short_swa_window": 2}, None),  # its output is added at once
}


@pytest.fixture(scope="module")
def vanilla(imported, megatron_single):
    from depthmix.inference.load import load_model

    loaded = load_model(checkpoints(imported["qwen3"]))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return loaded, x, loaded.model(x)


def test_every_mixer_is_listed():
    from depthmix.mixers import available

    assert sorted({mixer for mixer, _, _ in CASES.values()}) == available()


@pytest.mark.parametrize("case", list(CASES))
def test_weights_only_start_from_a_plain_checkpoint(case, vanilla):
    import dataclasses

    from depthmix.checkpoint.distributed import load
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.megatron_ext.model import build_chunk
    from depthmix.mixers import get_mixer
    from depthmix.pretrain.parallelize import init_distributed

    mixer, options, limit = CASES[case]
    loaded, x, want = vanilla
    run = dataclasses.replace(loaded.run)
    run.mixer = get_mixer(mixer).config_cls(name=mixer, impl="torch", **options)
    run.mixer.resolve(run.model)
    topo = init_distributed(run)
    model = build_chunk(to_transformer_config(run), get_mixer(run.mixer.name))
    load(loaded.path, run=run, model=[model], topo=topo, weights_only=True)
    ours = dict(model.named_parameters())
    for name, param in loaded.model.named_parameters():  # every vanilla weight was loaded
        assert torch.equal(ours[name], param), name
    with torch.no_grad():
        gap = (model.eval()(x) - want).abs().max().item()
    if limit is None:
        assert gap > 1e-2, f"{case} starts as the plain residual network ({gap:.1e})"
    else:
        assert gap <= limit, f"{case}: logits {gap:.1e} from the plain residual network"


def test_a_missing_model_weight_is_still_an_error(imported, megatron_single):
    """Only the new mixer's parameters may be absent: the tied import (no output layer of its
    own) into an untied model with another mixer is refused, naming the option."""
    from depthmix.checkpoint.distributed import load
    from depthmix.checkpoint.record import run_from_record
    from depthmix.checkpoint.store import find_checkpoint, read_meta
    from depthmix.config.schema import ConfigError
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.megatron_ext.model import build_chunk
    from depthmix.mixers import get_mixer
    from depthmix.pretrain.parallelize import init_distributed

    path = find_checkpoint(checkpoints(imported["qwen3_tied"]))
    run = run_from_record(read_meta(path)["record"], impl="torch")
    run.model.tie_embeddings = False
    run.mixer = get_mixer("denseformer").config_cls(name="denseformer", impl="torch")
    run.mixer.resolve(run.model)
    topo = init_distributed(run)
    model = build_chunk(to_transformer_config(run), get_mixer(run.mixer.name))
    with pytest.raises(ConfigError, match="model.tie_embeddings"):
        load(path, run=run, model=[model], topo=topo, weights_only=True)
