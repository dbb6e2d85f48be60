"""The trusted side: orchestrator and FSDP2 trainer (built in the trainer issue)."""

import importlib.util

if importlib.util.find_spec("torch") is None:  # the base install is the scheduler's
    raise ImportError(
        "the trainer needs torch and the rest of its extra: pip install 'prime-swarm[trainer]'"
    )
