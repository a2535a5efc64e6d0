"""build_data from two processes at once on a cold cache: with a gloo group (rank 0 builds
the corpus and indices, the other waits on barriers) and without one (a file lock)."""

import multiprocessing
import os

import pytest
import torch

from depthmix.data import build_data
from depthmix.runtime.env import free_port


def _rank_main(rank, world, port, use_group, run, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    if use_group:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    data = build_data(run, rank, world)
    tokens = torch.cat([next(data.train_iterator)["tokens"] for _ in range(4)])
    torch.save(tokens, os.path.join(out, f"rank{rank}.pt"))
    if use_group:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("use_group", [True, False], ids=["gloo", "no_group"])
def test_two_processes_on_a_cold_cache(tmp_path, data_cache, make_run, use_group):
    run, out = make_run(str(tmp_path / "cache")), str(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, use_group, run, out))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]

    # Same data as a single process on a warm cache: DP rank r of 2 holds micro-batch
    # r of each chunk of mbs*dp samples.
    ref = build_data(make_run(data_cache), 0, 1).train_iterator
    ref = torch.cat([next(ref)["tokens"] for _ in range(8)])  # 8 micro-batches of 2
    got = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    chunks = ref.view(4, 2, 2, -1)  # [chunk, rank, mbs, s]
    for r in range(2):
        assert torch.equal(got[r], chunks[:, r].reshape(8, -1))
