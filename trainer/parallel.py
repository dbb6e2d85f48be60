"""Parallelism pieces, composed torchtitan-style: process group, AC, compile, FSDP2.

Apply them in this order: `apply_activation_checkpointing`, `apply_compile`,
`apply_fsdp`. Each one changes the model in place and works on any HF causal LM whose
blocks sit in `model.model.layers`.

Invariants: a single process never needs torchrun, never creates a process group and
is never wrapped in FSDP (on CPU or GPU: one rank has nothing to shard, and FSDP2's
per-unit copies and DTensor dispatch cost a single GPU about a third of its speed; the
trainer then computes in bf16 under autocast on fp32 master weights); under torchrun every rank shards every decoder layer then the root (`PolicyModel`), so
the final norm and LM head are one FSDP unit with the embedding; state-dict keys are
those of the HF model (AC wrappers and in-place compile leave them unchanged).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from protocol.processes import die_with_parent
from trainer.model import decoder_layers


def init_distributed(kind: str = "auto") -> tuple[int, int]:
    """(rank, world_size); joins the process group only under torchrun (WORLD_SIZE > 1),
    and then dies with its torchrun agent (a killed trainer leaves no rank behind). The
    backend follows the trainer's device (`TrainerConfig.device`), not the host: NCCL
    bound to this rank's GPU (LOCAL_RANK) for CUDA, gloo for a CPU run on any host."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    # A trainer killed with -9 is its torchrun agent: no rank may train on without it.
    die_with_parent()
    if not dist.is_initialized():
        if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
            gpu = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(gpu)
            # Bound at once: the first collective (a barrier, say) need not guess the GPU.
            dist.init_process_group("nccl", device_id=gpu)
        else:
            dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (a no-op in a single process); returns `t`, reduced in place."""
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def destroy_distributed() -> None:
    if is_distributed():
        dist.destroy_process_group()


def end_rank(code: int = 0) -> NoReturn:
    """Leave a torchrun rank whose work is done: destroy the process group, flush, and
    `os._exit` without the interpreter's finalization. There, with torch 2.13 on CPU, a
    gloo rank sometimes dies of std::terminate ("terminate called without an active
    exception", SIGABRT) after `destroy_process_group` returned: 2 of about 12 tiny
    2-rank runs on a busy 2-core machine, and torchrun then fails the whole run."""
    destroy_distributed()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def apply_activation_checkpointing(policy: nn.Module) -> None:
    """Recompute every decoder layer in the backward (non-reentrant checkpoint)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = decoder_layers(policy.lm)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)


def apply_compile(policy: nn.Module) -> None:
    """torch.compile each decoder layer in place (same module objects, same keys)."""
    for layer in decoder_layers(policy.lm):
        layer.compile()


def apply_fsdp(policy: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Shard with FSDP2 over all ranks; returns False (and does nothing) for one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size() if is_distributed() else 1
    if world == 1:
        # One rank has nothing to shard: FSDP2 would only add copy-in/out of every unit
        # per micro-batch and DTensor dispatch (25% vs 39% MFU on one H200).
        return False
    mesh = init_device_mesh(device.type, (world,))
    kwargs: dict = {"mesh": mesh}
    if dtype == torch.bfloat16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    layers = decoder_layers(policy.lm)
    for i, layer in enumerate(layers):
        # The last block's params are needed again at once by the backward: keep them.
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(policy, **kwargs)
    return True


def gather_full_state_dict(
    policy: nn.Module, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The HF model's full state dict on CPU, on rank 0 (other ranks get {}), its
    floating-point tensors in `dtype` (None: as trained): a copy the caller owns, which
    later optimizer steps never change (cast on the device first: half the bytes to copy
    for bf16)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def cast(v: torch.Tensor) -> torch.Tensor:
        return v.detach().to(dtype if dtype is not None and v.is_floating_point() else None)

    if not is_distributed():
        # The live parameters: copied unless the cast or the move to CPU made a new tensor.
        out = {}
        for k, v in policy.lm.state_dict().items():
            t = cast(v).cpu()
            out[k] = t.clone() if t.data_ptr() == v.data_ptr() else t
        return out
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(policy, options=opts)  # already gathered into new tensors
    return {k.removeprefix("lm."): cast(v) for k, v in state.items()}
