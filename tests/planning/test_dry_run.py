"""``train.dry_run=true``: the 3b preset on a 64-GPU layout prints the layout and memory
estimate without building the model or a process group; a wrong world size is refused."""

import io

import pytest

from depthmix.cli.train import dry_run
from depthmix.config.load import compose_run
from depthmix.runtime import exit_codes

from cli_runs import base_env
from run_harness import run_cli


@pytest.fixture
def no_model_no_process_group(monkeypatch):
    """Any attempt to build the model or a process group fails the test."""
    import torch.distributed as dist

    from depthmix.megatron_ext import model as model_module
    from depthmix.pretrain import parallelize

    def forbidden(*args, **kwargs):
        raise AssertionError("the dry run must not build models or process groups")

    monkeypatch.setattr(model_module.DepthMixModel, "__init__", forbidden)
    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(parallelize, "init_distributed", forbidden)


def test_3b_on_64_gpus(no_model_no_process_group):
    run = compose_run("model=3b", "parallel=tp2_pp4", "train=paper")
    out = io.StringIO()
    assert dry_run(run, world_size=64, out=out) == 0
    text = out.getvalue()
    assert "hidden_size: 2048" in text  # the resolved config
    assert "world size 64 = tp 2 x pp 4 x dp 8" in text
    assert "pp rank 0 (global ranks 0-15): chunk 0: layers 0-11 + embedding" in text
    assert "pp rank 3 (global ranks 48-63): chunk 3: layers 36-47 + head" in text
    assert "model parameters: 2.75B (2,747,998,208)" in text
    assert "dry run OK for world size 64" in text
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit()
            and "GiB" in line]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    # 1F1B: the first stage holds the most activations (4 micro-batches in flight)
    assert [int(r[6]) for r in rows] == [4, 3, 2, 1]


def test_interleaved_layout(no_model_no_process_group):
    run = compose_run("model=3b", "parallel=tp4_pp4_vp2", "train=paper")
    out = io.StringIO()
    assert dry_run(run, world_size=64, out=out) == 0
    text = out.getvalue()
    assert "world size 64 = tp 4 x pp 4 x dp 4 (vp 2 virtual stages" in text
    assert ("pp rank 0 (global ranks 0-15): chunk 0: layers 0-5 + embedding; "
            "chunk 4: layers 24-29") in text
    assert "pp rank 3 (global ranks 48-63): chunk 3: layers 18-23; chunk 7: layers 42-47 + head" \
        in text


@pytest.mark.parametrize("world,message", [
    (60, "world size 60 is not divisible by parallel.tp * parallel.pp = 2 * 4"),
    (16, "train.global_batch_size=1024 is not divisible by"),
])
def test_wrong_world_size_is_refused(no_model_no_process_group, capsys, world, message):
    run = compose_run("model=3b", "parallel=tp2_pp4", "train=paper", "train.micro_batch_size=3")
    if world == 60:
        run.train.micro_batch_size = 4
    assert dry_run(run, world_size=world, out=io.StringIO()) == exit_codes.CONFIG_ERROR
    assert message in capsys.readouterr().err


def test_parallel_world_size_must_match_the_launch():
    from depthmix.config.schema import ConfigError
    from depthmix.config.validate import validate

    run = compose_run("parallel.world_size=8", "train.micro_batch_size=2")
    validate(run, 8)
    with pytest.raises(ConfigError, match="parallel.world_size=8 but this job has 4"):
        validate(run, 4)


@pytest.mark.multiproc(at_once=1)
def test_cli_exit_codes(tmp_path):
    env = base_env(str(tmp_path), str(tmp_path / "cache"))
    args = ["model=3b", "parallel=tp2_pp4", "train=paper", "train.dry_run=true"]
    ok = run_cli([*args, "parallel.world_size=64"], cwd=str(tmp_path), env=env, timeout=180)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "dry run OK for world size 64" in ok.stdout
    env["WORLD_SIZE"] = "60"  # the world size may also come from the environment
    bad = run_cli(args, cwd=str(tmp_path), env=env, timeout=180)
    assert bad.returncode == 2
    assert "world size 60 is not divisible by parallel.tp * parallel.pp = 2 * 4" in bad.stderr
