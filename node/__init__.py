"""The worker node: inference engines, the worker HTTP server and the `prime-node` CLI.

Untrusted by design: everything a node returns is signed by its key and checked by
another node before anyone uses it. Nothing imports `node`.
"""
