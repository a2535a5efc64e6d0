"""Planning a run without building it: the model shape, the pipeline layout and what crosses
its stages, FLOPs, memory per pipeline rank, the device table, the layout planner (its
step-time model, report and calibration against published layouts), theoretical overheads
and the dry run. Imports neither torch nor Megatron."""
