"""``preflight``: numeric ranges, the save directory, and the split as Megatron cuts it."""

import pytest

from depthmix.config.load import compose_run
from depthmix.data.checks import split_ranges
from depthmix.pretrain.preflight import preflight
from depthmix.config.schema import ConfigError


@pytest.mark.parametrize("override, message", [
    ("train.min_lr=1.0", "train.min_lr=1.0 must be <= train.lr=0.003"),
    ("train.warmup_fraction=1.0", "train.warmup_fraction=1.0 must be in [0, 1)"),
    ("train.adam_beta2=1.0", "train.adam_beta2=1.0 must be in [0, 1)"),
    ("train.weight_decay=-0.1", "train.weight_decay=-0.1 must be >= 0"),
    ("train.exit_after_steps=0", "train.exit_after_steps=0 must be >= 1"),
    ("model.init_std=0", "model.init_std=0.0 must be > 0"),
    ("logger.depth_stats_interval=-1", "logger.depth_stats_interval=-1 must be >= 0"),
    ("data.embedded_vocab_size=4096", "data.embedded_vocab_size=4096 is larger than "
                                      "model.vocab_size=2048"),
])
def test_out_of_range_values_name_the_option(tmp_path, override, message):
    with pytest.raises(ConfigError) as info:
        preflight(compose_run(override, f"output_dir={tmp_path}"), world_size=1)
    assert str(info.value) == message


def test_save_dir_must_be_creatable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"^train\.save_dir: .*a_file/ckpt cannot be created"):
        preflight(compose_run(f"train.save_dir={blocker}/ckpt"), world_size=1)
    nested = tmp_path / "new" / "deeper" / "ckpt"
    preflight(compose_run(f"train.save_dir={nested}"), world_size=1)
    assert not (tmp_path / "new").exists(), "the preflight writes nothing"


@pytest.mark.parametrize("split", ["98,2,0", "1", "99.9,0.1", "3,3,3", "0,1,1", "5,0,5"])
@pytest.mark.parametrize("documents", [1, 7, 1000])
def test_split_ranges_are_megatrons(split, documents):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )

    weights = [float(x) for x in split.split(",")] + [0.0] * (3 - len(split.split(",")))
    matrix = convert_split_vector_to_split_matrix([w / sum(weights) for w in weights])
    expected = [None if b is None else range(int(round(b[0] * documents)),
                                             int(round(b[1] * documents))) for b in matrix]
    assert split_ranges(split, documents) == expected
