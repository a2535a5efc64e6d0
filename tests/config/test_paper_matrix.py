"""Every shipped model preset composes with every mixer and passes the dry run at the world
size a paper-scale run would use (no model, no process group): by default each preset with
one mixer, in rotation over every mixer; the other pairs in the full lane."""

import io

import pytest

from depthmix.cli.train import dry_run
from depthmix.config.load import compose_run
from depthmix.mixers import available

from layouts import full_except

# preset -> (overrides, world size) of a paper-scale run
PAPER_LAYOUTS = {
    "360m": (["train=paper"], 8),
    "500m": (["train=paper"], 8),
    "500m_looped3": (["train=paper"], 8),
    "710m": (["train=paper"], 8),
    "1p5b": (["train=paper", "parallel=tp2"], 32),
    "3b": (["train=paper", "parallel=tp2_pp4"], 64),
    "moda_700m": (["train=moda_paper"], 64),
    "moda_1p5b": (["train=moda_paper", "parallel=tp2"], 64),
    "moda_w384_l24": (["train=moda_paper"], 8),
    "moda_w384_l48": (["train=moda_paper"], 8),
    "1p5b_moe": (["train=paper", "parallel=tp2"], 32),
    "kimi_moe_small": ([], 1),  # small: the default training
    "deepseek_moe_small": ([], 1),
}


def test_every_preset_has_a_paper_layout():
    from importlib import resources

    shipped = {p.name[:-5] for p in resources.files("depthmix.configs").joinpath("model").iterdir()
               if p.name.endswith(".yaml")}
    assert shipped - {"tiny", "tiny_moe"} == set(PAPER_LAYOUTS)


PAIRS = [(p, m) for p in sorted(PAPER_LAYOUTS) for m in available()]
ROTATION = {(p, available()[i % len(available())]) for i, p in enumerate(sorted(PAPER_LAYOUTS))}


@pytest.mark.parametrize("pair", full_except(PAIRS, ROTATION, ids="-".join))
def test_preset_and_mixer_dry_run(pair):
    preset, mixer = pair
    overrides, world_size = PAPER_LAYOUTS[preset]
    run = compose_run(f"model={preset}", f"mixer={mixer}", *overrides)
    out = io.StringIO()
    assert dry_run(run, world_size=world_size, out=out) == 0, out.getvalue()
    assert f"dry run OK for world size {world_size}" in out.getvalue()


def test_710m_block_attnres_uses_eight_blocks():
    run = compose_run("model=710m", "mixer=attnres_block")
    assert run.mixer.block_size == 8  # 64 sublayers / 8 blocks
