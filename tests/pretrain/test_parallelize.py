"""Re-initialising Megatron's parallel state in one process (a multirun's next layout, a test
running many layouts) leaves no process group behind: each live gloo group keeps a thread
that wakes every 10 ms."""

from torch.distributed import distributed_c10d


def test_destroying_model_parallel_destroys_its_process_groups(megatron_single):
    from megatron.core import parallel_state

    from depthmix.pretrain.parallelize import destroy_model_parallel

    destroy_model_parallel()
    alone = set(distributed_c10d._world.pg_map)  # the default group
    try:
        for _ in range(3):
            parallel_state.initialize_model_parallel(1, 1)
            assert len(distributed_c10d._world.pg_map) > len(alone)
            destroy_model_parallel()
            assert set(distributed_c10d._world.pg_map) == alone
    finally:
        parallel_state.initialize_model_parallel(1, 1)  # what the session's fixture set up
