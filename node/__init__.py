"""The worker node: inference engines, the worker HTTP server and the `prime-node` CLI.

Untrusted by design: everything a node returns is signed by its key and checked by
another node before anyone uses it. Nothing imports `node`.
"""

import importlib.util

if importlib.util.find_spec("torch") is None:  # the base install is the scheduler's
    raise ImportError(
        "the worker node needs torch and the rest of its extra: pip install 'prime-swarm[node]'"
    )
