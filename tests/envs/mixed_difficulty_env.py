"""A reverse-text dataset part of which the policy has already mastered (issue 30's test of
difficulty filtering): the tiny model masters no reverse-text prompt within a CI-sized run
(its reward climbs from about 0.45 to 0.6; an exact reversal is rare), so a share
`solved_share` of the prompts are marked solved: their rubric gives full marks whatever
the answer, as a prompt the policy always gets right would. Their groups come back all
equal; difficulty filtering should set them aside. The rest is plain reverse-text."""

from __future__ import annotations

import random

from trainer.envs.reverse_text import SYSTEM_PROMPT, reward_lcs, texts


def reward(completion, answer: str, info: dict | None = None, **_) -> float:
    if (info or {}).get("solved"):
        return 1.0
    return reward_lcs(completion, answer)


def load_environment(num_examples: int = 48, solved_share: float = 0.5, seed: int = 0):
    import verifiers as vf
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [
        {"question": t, "answer": t[::-1], "info": {"solved": rng.random() < solved_share}}
        for t in texts(num_examples, seed)
    ]
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        system_prompt=SYSTEM_PROMPT,
        rubric=vf.Rubric(funcs=[reward]),
    )
