"""A verifiers `ToolEnv` as verifiers' documentation writes one: a plain Python function
is the tool, the dataset has `question` and `answer`, the rubric scores the last message.
It imports nothing of this project (issue 29: "a verifiers tool environment nobody in the
project wrote runs through the pool without changes")."""

from __future__ import annotations


def lookup_capital(country: str) -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's name.
    """
    capitals = {"france": "Paris", "japan": "Tokyo", "peru": "Lima", "kenya": "Nairobi"}
    return capitals.get(country.strip().lower(), "unknown")


def load_environment(**kwargs):
    import verifiers as vf
    from datasets import Dataset

    rows = [
        {"question": f"What is the capital of {c}?", "answer": a}
        for c, a in (
            ("France", "Paris"),
            ("Japan", "Tokyo"),
            ("Peru", "Lima"),
            ("Kenya", "Nairobi"),
        )
    ] * 4

    def correct(completion, answer, **_) -> float:
        last = completion[-1] if completion else {}
        content = last.get("content") if isinstance(last, dict) else getattr(last, "content", "")
        return 1.0 if answer.lower() in (content or "").lower() else 0.0

    return vf.ToolEnv(
        dataset=Dataset.from_list(rows),
        tools=[lookup_capital],
        max_turns=3,
        system_prompt="Use the tool to answer.",
        rubric=vf.Rubric(funcs=[correct]),
    )
