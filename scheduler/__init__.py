"""The scheduler daemon: pools, admission, dispatch, verification routing, reputation.

Invariant: never imports torch (it installs and starts in seconds on a CPU box).
"""
