"""Every impossible configuration fails at start-up with one message naming the option."""

import pytest
from hydra.errors import MissingConfigException

from depthmix.config.load import compose_run
from depthmix.config.schema import ConfigError
from depthmix.pretrain.preflight import preflight
from depthmix.config.validate import validate


def test_derived_model_sizes():
    """The head width defaults to hidden / heads; the vocabulary is padded up to a multiple
    of make_vocab_size_divisible_by, not of TP (the initial weights must not depend on the
    layout)."""
    from depthmix.config.schema import ModelConfig

    m = ModelConfig(hidden_size=2048, num_attention_heads=16, vocab_size=50257)
    assert m.kv_channels == 128 and m.padded_vocab_size == 50304
    m.head_dim, m.make_vocab_size_divisible_by, m.vocab_size = 96, 64, 50304
    assert m.kv_channels == 96 and m.padded_vocab_size == 50304
    run = compose_run("model.vocab_size=300", "model.make_vocab_size_divisible_by=64",
                      "parallel=tp2")
    assert run.model.padded_vocab_size == 320  # 384 would be a multiple of 64 * tp
    validate(run, world_size=2)


def test_default_config_is_valid():
    run = compose_run()
    validate(run, world_size=1)
    assert run.model.name == "tiny" and run.mixer.name == "vanilla"


@pytest.mark.parametrize(
    "overrides, world, option",
    [
        (["model.num_attention_heads=6", "model.num_query_groups=6", "model.hidden_size=192",
          "parallel=tp2", "parallel.tp=4"], 4, "parallel.tp=4"),
        (["model.num_query_groups=1", "parallel=tp2"], 2, "model.num_query_groups=1"),
        (["parallel=pp2", "parallel.pp=3"], 3, "model.num_layers=4"),
        (["parallel=pp2_vp2", "model.num_layers=6"], 2, "parallel.pp * parallel.vp"),
        (["train.global_batch_size=12", "train.micro_batch_size=8"], 1,
         "train.global_batch_size=12"),
        (["parallel=dp2_distopt", "train.global_batch_size=8", "train.micro_batch_size=8"], 2,
         "data-parallel size"),
        (["parallel=tp2"], 3, "world size 3"),
        (["parallel=tp2", "parallel.dp=2"], 2, "parallel.dp"),
        (["data=pile", "data.prefixes=[/nonexistent/pile]", "data.tokenizer=/nonexistent.json"], 1,
         "data.prefixes"),
        (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel"),
        (["train.precision=fp8"], 1, "train.precision"),
        (["model.n_loops=2", "parallel=pp2"], 2, "model.n_loops"),
        (["train.on_nonfinite=ignore"], 1, "train.on_nonfinite='ignore'"),
        (["train.on_spike=stop"], 1, "train.on_spike='stop'"),
        (["train.max_nonfinite_steps=0"], 1, "train.max_nonfinite_steps=0"),
        (["train.spike_zscore=-1"], 1, "train.spike_zscore=-1"),
        (["train.spike_window=1"], 1, "train.spike_window=1"),
        (["train.ckpt_integrity=md5"], 1, "train.ckpt_integrity='md5'"),
        (["parallel.overlap_param_gather=true"], 1, "parallel.distributed_optimizer"),
        (["parallel.ddp_bucket_size=0"], 1, "parallel.ddp_bucket_size=0"),
    ],
)
def test_bad_config_names_the_option(overrides, world, option):
    with pytest.raises(ConfigError) as info:
        preflight(compose_run(*overrides), world_size=world)
    assert option in str(info.value)


@pytest.mark.parametrize("overrides, dp, grad, param", [
    ([], 1, False, False),  # the CPU default: one replica, nothing to reduce
    (["train=paper"], 8, True, False),
    (["train=moda_paper", "parallel=dp2_distopt"], 2, True, True),
    (["parallel=tp8_pp4"], 2, True, True),
    (["parallel=tp8_pp4", "parallel.overlap_grad_reduce=false"], 2, False, False),
    (["parallel=tp8_pp4", "parallel.overlap_param_gather=false"], 2, True, False),
])
def test_overlap_is_on_where_it_helps(overrides, dp, grad, param):
    """Unset (null), the overlap options turn on with data-parallel replicas (parameters:
    also the distributed optimizer's shards); explicit values win."""
    from depthmix.pretrain.overlap import settings

    chosen = settings(compose_run(*overrides).parallel, dp)
    assert (chosen.grad_reduce, chosen.param_gather) == (grad, param)


def test_missing_data_path_is_refused():
    with pytest.raises(Exception) as info:  # Hydra refuses the mandatory ``???`` value
        validate(compose_run("data=pile"), world_size=1)
    assert "prefixes" in str(info.value)


def test_unknown_preset_is_refused():
    with pytest.raises(MissingConfigException) as info:
        compose_run("model=7b")
    assert "model" in str(info.value) and "7b" in str(info.value)


@pytest.mark.parametrize("override", ["model.hiden_size=3", "+model.hiden_size=3"])
def test_unknown_key_is_refused(override):
    with pytest.raises(Exception) as info:
        compose_run(override)
    assert "hiden_size" in str(info.value)


def test_unknown_mixer_is_refused():
    with pytest.raises(Exception) as info:
        compose_run("mixer.name=nope")
    assert "nope" in str(info.value)
