"""SFT examples (chat messages) -> training samples, tokenized the way workers tokenize.

A prompt is rendered with the model's chat template and a generation prompt, exactly as a
worker's `/v1/chat/completions` renders it; the completion is the assistant's text
followed by the end-of-turn token, so the model learns to stop.

Invariant: the loss covers completion tokens only (the prompt is context).
"""

from __future__ import annotations

from trainer.batch import TrainingSample


def tokenize_example(tokenizer, example: dict) -> TrainingSample:
    ids = tokenizer.apply_chat_template(
        example["prompt"], add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns an encoding with input_ids; older versions a list.
    prompt_ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "".join(m["content"] for m in example["completion"] if m["role"] == "assistant")
    completion_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    return TrainingSample(
        input_ids=prompt_ids + completion_ids,
        loss_mask=[False] * len(prompt_ids) + [True] * len(completion_ids),
        logprobs=[0.0] * (len(prompt_ids) + len(completion_ids)),
        advantage=1.0,
    )


def tokenize_examples(tokenizer, examples: list[dict]) -> list[TrainingSample]:
    return [tokenize_example(tokenizer, e) for e in examples]
