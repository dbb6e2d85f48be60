"""reverse-text-chain: a two-turn environment (exercises the multi-turn path).

Turn 1 asks to reverse a text; the environment answers with a second text to reverse;
the episode ends after the second answer. Reward: the mean LCS ratio of both answers
(`reverse_text.lcs_ratio`), computed from the whole conversation on the trusted side.
"""

from __future__ import annotations

import random

from trainer.envs.reverse_text import SYSTEM_PROMPT, lcs_ratio, random_text


def load_environment(num_examples: int = 1000, seed: int = 0, min_len: int = 3, max_len: int = 6):
    import verifiers as vf
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        first, second = random_text(rng, min_len, max_len), random_text(rng, min_len, max_len)
        rows.append({"question": first, "answer": f"{first[::-1]}|{second}"})

    class ReverseChain(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            second = state["answer"].split("|")[1]
            return [vf.UserMessage(content=second)]

    def reward_both(completion, answer: str, **_) -> float:
        first_rev, second = answer.split("|")
        said = [(m.get("content") or "").strip() for m in completion if m["role"] == "assistant"]
        targets = [first_rev, second[::-1]]
        return sum(lcs_ratio(a, t) for a, t in zip(said, targets, strict=False)) / len(targets)

    return ReverseChain(
        dataset=Dataset.from_list(rows),
        system_prompt=SYSTEM_PROMPT,
        rubric=vf.Rubric(funcs=[reward_both]),
        max_turns=2,
    )
