"""Planning a run without building it: the model shape, FLOPs, memory per pipeline rank, the layout planner, theoretical overheads and the dry run. Imports neither torch nor Megatron."""
