"""reverse-text: reverse a short text; the reward is the longest-common-subsequence ratio
between the answer and the reversed text (1.0 for an exact reversal, partial credit for
near misses, so a small model gets a gradient from the start).

Data are generated locally from a seed (no hub download): lowercase words of 3 to 8
letters. `sft_examples` gives the warm-up data (the exact answers) from another seed range,
so SFT never sees the RL prompts.
"""

from __future__ import annotations

import random
import string

SYSTEM_PROMPT = "Reverse the text."


def random_text(rng: random.Random, min_len: int = 3, max_len: int = 8) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))


def lcs_len(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(answer: str, target: str) -> float:
    """2 * LCS / (len(answer) + len(target)): 1.0 only for an exact match."""
    if not answer and not target:
        return 1.0
    return 2 * lcs_len(answer, target) / (len(answer) + len(target))


def _answer_text(completion) -> str:
    if isinstance(completion, str):
        return completion.strip()
    for m in reversed(completion or []):
        if m.get("role") == "assistant":
            return (m.get("content") or "").strip()
    return ""


def reward_lcs(completion, answer: str, **_) -> float:
    return lcs_ratio(_answer_text(completion), answer)


def texts(num: int, seed: int, min_len: int = 3, max_len: int = 8) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, min_len, max_len) for _ in range(num)]


def load_environment(
    num_examples: int = 1000,
    seed: int = 0,
    min_len: int = 3,
    max_len: int = 8,
    num_eval_examples: int = 0,
):
    """`num_eval_examples`: a held-out eval split (texts of a seed range neither the
    training set nor SFT uses); 0: none (evaluation then reads the training set)."""
    import verifiers as vf
    from datasets import Dataset

    def rows(n: int, s: int) -> list[dict]:
        return [{"question": t, "answer": t[::-1]} for t in texts(n, s, min_len, max_len)]

    held_out = rows(num_eval_examples, 2_000_003 + seed) if num_eval_examples else None
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows(num_examples, seed)),
        eval_dataset=Dataset.from_list(held_out) if held_out else None,
        system_prompt=SYSTEM_PROMPT,
        rubric=vf.Rubric(funcs=[reward_lcs]),
    )


def sft_examples(
    num_examples: int, seed: int, min_len: int = 3, max_len: int = 8, **_
) -> list[dict]:
    """Prompt/completion pairs with exact answers, from a seed range the RL data never use."""
    return [
        {
            "prompt": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": t},
            ],
            "completion": [{"role": "assistant", "content": t[::-1]}],
        }
        for t in texts(num_examples, 1_000_003 + seed, min_len, max_len)
    ]
