"""Proofs and checks that let one untrusted worker verify another's rollout.

`proofs` wraps TOPLOC, `sampling` is the seeded sampler every engine uses and every
verifier replays (`noise`: its Gumbel noise from (seed, position); `fused_sampling`: its
replay in one Triton pass), `checks` turns a rollout plus the verifier's own prefill into
a verdict, and `calibration` measures honest error distributions to propose thresholds.
"""
