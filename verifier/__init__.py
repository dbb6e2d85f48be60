"""Proofs and checks that let one untrusted worker verify another's rollout.

`proofs` wraps TOPLOC, `sampling` is the seeded sampler every engine uses and every
verifier replays, `checks` turns a rollout plus the verifier's own prefill into a
verdict, and `calibrate` measures honest error distributions to propose thresholds.
"""
