"""Free identities against an open pool (issue 26, DESIGN.md section 10 "Sybils"): real
processes on loopback, a scheduler and `prime-node join` workers (`tests.sybil_attacks`).

Three honest workers, the owner's founders, and k = 1, 3 or 12 free identities of each
strategy in turn (reject everything; accept everything, paired with a cheating generator; side with a
cheating generator; check honestly until the right to check is earned, then reject
everything), on a pool whose right to check is earned. What must hold, the fault audit:
every request is served and accepted, no honest worker loses reputation or is banned,
nothing a cheat generated is released (so nothing of it is trained), and a cheat is
banned. The control, where every admitted node checks at once, shows the attack as found:
identities that reject everything verify and cost honest workers disputes. The k x
strategy table with throughput is tests/bench/bench_sybils.py.
"""

from __future__ import annotations

import pytest

from tests.sybil_attacks import STRATEGIES, WITH_CHEAT, run_attack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
REQUESTS = 240


@pytest.mark.parametrize("k", [1, 3, 12])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_free_identities_of_each_strategy_take_nothing_down(tmp_path, report, strategy, k):
    figures = run_attack(tmp_path, strategy, k, REQUESTS)
    report(f"sybils: {k} x {strategy} against 3 honest founders, rights earned", figures)
    assert figures["results"] == REQUESTS and figures["accepted"] == REQUESTS, figures
    assert figures["honest_penalised"] == 0 and figures["honest_banned"] == 0, figures
    assert figures["cheat_released"] == 0, figures
    if strategy in WITH_CHEAT:
        assert figures["states"]["cheat"] == "banned", figures
    if strategy == "reject-all":  # they never earn the right to check
        assert figures["attacker_verdicts"] == 0 and figures["released_from_attackers"] == 0


def test_the_control_where_every_node_checks_at_once_falls(tmp_path, report):
    """The attack as found: identities that reject everything verify honest rollouts and
    honest generators lose disputes (or the pool stalls)."""
    figures = run_attack(tmp_path, "reject-all", 4, 24, earned=False)
    report("sybils: 4 x reject-all against 3 honest workers, every node checks at once", figures)
    assert figures["attacker_verdicts"] > 0, figures
    assert figures["honest_penalised"] > 0, figures
