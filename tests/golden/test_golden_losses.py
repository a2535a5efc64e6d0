"""Golden losses: ``model=tiny`` trained 10 steps per mixer at TP1 and PP2, bit for bit.

The reference values (``tests/assets/losses/tiny.json``, float hex strings) were recorded
before the package was restructured; code that only moves must reproduce them exactly.
A change that alters the numerics on purpose re-records them with
``DEPTHMIX_RECORD_GOLDEN=1 python -m pytest tests/golden`` and says why in its commit.
"""

import json
import os
from pathlib import Path

import pytest

from depthmix.config.load import compose_run
from depthmix.testing import run_layouts

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ASSET = Path(__file__).parent.parent / "assets" / "losses" / "tiny.json"
STEPS = 10
LAYOUTS = {"tp1": (1, []), "pp2": (2, ["parallel=pp2"])}
# every mixer with its defaults, plus ShortSWA (an option of every mixer)
CASES = {
    "vanilla": ["mixer=vanilla"],
    "vanilla+short_swa": ["mixer=vanilla", "mixer.short_swa_window=4"],
    "depth_attn": ["mixer=depth_attn"],
    "moda": ["mixer=moda"],
    "attnres_full": ["mixer=attnres_full"],
    "attnres_block": ["mixer=attnres_block", "mixer.block_size=2"],
    "mhc": ["mixer=mhc"],
    "denseformer": ["mixer=denseformer"],
    "ddl": ["mixer=ddl"],
}


def make_run(case: str, layout: str):
    overrides = ["model=tiny", "model.seq_length=32", "train.micro_batch_size=2",
                 "train.global_batch_size=4", f"train.steps={STEPS}", "train.precision=fp32",
                 "mixer.impl=torch", *CASES[case], *LAYOUTS[layout][1]]
    return compose_run(*overrides)


def record() -> dict:
    out = {}
    for layout, (world, _) in LAYOUTS.items():
        results = run_layouts([make_run(c, layout) for c in CASES], world_size=world,
                              steps=STEPS, mode="losses")
        out[layout] = {c: [float(x).hex() for x in r["losses"]]
                       for c, r in zip(CASES, results)}
    return out


def test_golden_losses():
    measured = record()
    if os.environ.get("DEPTHMIX_RECORD_GOLDEN") == "1":
        ASSET.parent.mkdir(parents=True, exist_ok=True)
        ASSET.write_text(json.dumps(measured, indent=1) + "\n")
    golden = json.loads(ASSET.read_text())
    assert set(golden) == set(LAYOUTS), "re-record: the layouts changed"
    for layout in LAYOUTS:
        assert set(golden[layout]) == set(CASES), f"{layout}: re-record, the cases changed"
        for case in CASES:
            got = [float.fromhex(x) for x in measured[layout][case]]
            want = [float.fromhex(x) for x in golden[layout][case]]
            assert got == want, f"{case}@{layout}: losses {got} != golden {want}"
