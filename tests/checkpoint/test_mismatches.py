"""A checkpoint of another mixer is refused naming only what differs, one option per line."""

import pytest

from depthmix.checkpoint.record import mismatches, record
from depthmix.checkpoint.resume import check_record
from depthmix.checkpoint.store import write_meta
from depthmix.config.schema import ConfigError
from depthmix.testing import tiny_run


def test_another_mixer_is_one_line_not_every_option_it_lacks():
    saved = record(tiny_run("vanilla"))
    assert mismatches(saved, tiny_run("depth_attn")) == [
        "mixer.name: checkpoint 'vanilla', this run 'depth_attn'"]
    other = tiny_run("depth_attn")
    other.model.num_layers += 2
    assert mismatches(record(tiny_run("depth_attn")), other) == [
        "model.num_layers: checkpoint 4, this run 6"]


def test_the_resume_refusal_lists_each_mismatch_on_its_own_line(tmp_path):
    saved = tiny_run("vanilla")
    saved.model.hidden_size *= 2
    write_meta(str(tmp_path), {"record": record(saved), "step": 1})
    with pytest.raises(ConfigError) as e:
        check_record(str(tmp_path), tiny_run("moda"), weights_only=False)
    lines = str(e.value).splitlines()
    assert lines[1:3] == ["  mixer.name: checkpoint 'vanilla', this run 'moda'",
                          "  model.hidden_size: checkpoint 128, this run 64"], lines
    assert "<absent>" not in str(e.value) and len(lines) == 4
