"""Publishing off the critical path (`trainer.publisher`): the trainer hands a version
over and goes on; what is published is what it handed over, in order, and a failure
reaches the trainer."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from trainer.parallel import gather_full_state_dict
from trainer.publisher import Publisher, PublishError
from trainer.weights import FilesystemTransport


class _Lm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = torch.nn.Linear(4, 4)


def test_the_trainer_goes_on_while_a_version_is_published_and_what_is_published_is_what_it_handed_over(
    tmp_path,
):
    """A real filesystem transport behind a publisher that is slow to start: submit
    returns at once; the optimizer changes the weights in place meanwhile; the folder of
    the version holds the weights as they were at hand-off, in the serving dtype."""
    policy = _Lm()
    transport = FilesystemTransport(tmp_path, dtype="bfloat16")
    gate = threading.Event()
    config = AutoConfig.for_model(
        "llama", hidden_size=4, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1
    )

    def save(n, state):
        gate.wait(10)
        transport.save(n, state, config, None)

    publisher = Publisher(save)
    state = gather_full_state_dict(policy, torch.bfloat16)
    handed = {k: v.clone() for k, v in state.items()}
    t0 = time.monotonic()
    waited = publisher.submit(1, state)
    assert time.monotonic() - t0 < 1 and waited < 1
    assert transport.versions() == []  # not published yet: the trainer did not wait
    with torch.no_grad():
        policy.lm.weight.add_(1.0)  # the next optimizer step, in place
    gate.set()
    publisher.flush()
    assert transport.versions() == [1]
    saved = load_file(str(transport.folder(1) / "model.safetensors"))
    assert saved.keys() == handed.keys()
    for k, v in handed.items():
        assert saved[k].dtype == torch.bfloat16
        assert torch.equal(saved[k], v), k
    publisher.close()


def test_versions_are_published_in_order_and_a_trainer_ahead_of_its_publishing_waits():
    """One version waits behind the one being published (depth 1); the trainer's third
    hand-off waits for room, and says how long."""
    order: list[int] = []
    gate = threading.Event()

    def save(n, state):
        gate.wait(10)
        order.append(n)

    publisher = Publisher(save, depth=1)
    publisher.submit(1, {})
    time.sleep(0.05)  # the thread has taken version 1
    publisher.submit(2, {})  # waits in the queue
    threading.Timer(0.3, gate.set).start()
    waited = publisher.submit(3, {})
    assert waited >= 0.2  # no room until version 1 was done
    publisher.close()
    assert order == [1, 2, 3]


def test_a_failed_publication_stops_the_run_at_the_next_hand_off_and_nothing_later_is_published():
    published: list[int] = []

    def save(n, state):
        if n == 2:
            raise OSError("disk full")
        published.append(n)

    publisher = Publisher(save, depth=4)
    for n in (1, 2, 3):
        publisher.submit(n, {})
    with pytest.raises(PublishError, match="version 2 failed: disk full"):
        publisher.flush()
    with pytest.raises(PublishError):
        publisher.submit(4, {})
    assert published == [1]
    with pytest.raises(PublishError):
        publisher.close()


def test_in_the_foreground_the_trainer_publishes_each_version_itself():
    """`weights.background = false`: the hand-off returns once the version is published
    (the side-by-side baseline of bench_trainer)."""
    done: list[int] = []
    publisher = Publisher(lambda n, s: (time.sleep(0.2), done.append(n)), background=False)
    assert publisher.submit(1, {}) >= 0.2 and done == [1]
    publisher.close()
