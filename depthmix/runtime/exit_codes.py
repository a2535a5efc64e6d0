"""The exit status of every depthmix command (each ``--help`` prints :data:`HELP`)."""

OK = 0
"""Done; for ``depthmix-train`` also stopped by a preemption signal after saving its
checkpoint (re-run or requeue the same command to resume)."""
CRASH = 1
"""Anything else, including a failed save."""
CONFIG_ERROR = 2
"""A configuration error: one line on stderr naming the option, before any compute."""
DIVERGED = 3
"""Training diverged (``train.on_nonfinite=stop`` or ``train.max_nonfinite_steps``)."""
INTERRUPTED = 130
"""A second Ctrl-C: aborted without saving (128 + SIGINT, as a shell reports it)."""

HELP = (f"Exit status: {OK} done (depthmix-train: also stopped by a preemption signal after "
        f"saving a checkpoint; re-run to resume), {CRASH} crashed, {CONFIG_ERROR} configuration "
        f"error (one line naming the option), {DIVERGED} training diverged, {INTERRUPTED} "
        "aborted by a second Ctrl-C.")
