"""The planner against published layouts (docs/scaling.md, "Calibration"): for each row of
:data:`depthmix.planning.calibration.ROWS` (its source named in the row), given the row's
model, sequence length, global batch and GPU count, the planner chooses the published
layout or predicts it within 5% of its own choice's step time."""

import functools

import pytest

from depthmix.mixers import get_mixer
from depthmix.planning import calibration as cal


@functools.lru_cache(maxsize=None)
def compare(row):
    return cal.compare(row, get_mixer("vanilla"))


@pytest.mark.parametrize("row", cal.ROWS, ids=lambda r: f"{r.name}-{r.gpus}x{r.gpu}")
def test_planner_chooses_the_published_layout_or_one_within_5_percent(row):
    c = compare(row)
    assert c.published is not None, f"{row.published()} does not fit in the memory model"
    assert c.ratio <= 1 + cal.TOLERANCE, (
        f"{row.source}: published {row.published()} is predicted {c.ratio - 1:.1%} slower "
        f"than the planner's {c.chosen.layout.short()}")


def test_megatron_core_1p7b_row_is_the_planners_choice():
    """Megatron-LM README, H100 table: 1.7B (24 layers, hidden 2048, seq 4096) on 48 H100
    runs TP1 PP1 DP48 at 41% MFU; the planner picks exactly that layout and predicts an MFU
    within 10 points."""
    row = cal.ROWS[0]
    assert (row.gpus, row.tp, row.pp) == (48, 1, 1)
    c = compare(row)
    lay = c.chosen.layout
    assert (lay.tp, lay.pp, lay.vp, lay.dp) == (1, 1, None, 48)
    assert c.predicted_mfu(c.chosen) == pytest.approx(row.published_mfu, abs=0.10)
