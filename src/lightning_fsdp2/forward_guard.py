"""A forward of the sharded model that only some ranks run fails within a bound, naming the cause, instead of hanging.

Every forward of a sharded model all-gathers each group's parameters, a collective all ranks must join. Code written
for one device often runs a forward on rank 0 alone: "sample some text at each evaluation" (LitGPT's
``if fabric.global_rank == 0: generate_example(...)``), a callback that logs a prediction. Rank 0 then waits in an
all-gather the others never join, silently, until the process group's timeout (30 minutes by default), or worse, its
all-gathers pair up with those of the next training step on the other ranks.

Training forwards are run by every rank in the step, and pay nothing here: the check is one check of
``module.training`` and grad mode. Any other forward of an FSDP root (evaluation, a forward under
``torch.no_grad()``), and each call of a root's ``generate``, first meets the other ranks in a barrier of its own gloo
group, whose timeout is the bound. A
rank that arrives alone raises after the bound with the message below, before it has entered any collective of the
model; the ranks that did not come are then told by the launcher (or gloo) that a peer failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_fsdp2.peer_lost import PeerLostError


def guard_forwards(roots: Sequence[nn.Module], timeout: float | None) -> None:
    """Before each forward of ``roots`` outside training, wait for every rank to reach the same point, at most
    ``timeout`` seconds, then raise on the ranks that waited. Call on every rank (it makes a process group);
    ``timeout=None`` turns the check off."""
    if timeout is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    bound = timedelta(seconds=timeout)
    # A group of its own: its timeout is the bound (the model's group keeps the user's), and gloo runs the barrier
    # whatever the model's backend, on CPU, off the device's stream.
    group = dist.new_group(backend="gloo", timeout=bound)

    # Kept out of a whole-model torch.compile (a collective with a timeout), and out of the training path: the
    # wrapper torch.compiler.disable adds is paid only by forwards that wait.
    barrier = torch.compiler.disable(dist.monitored_barrier)

    def check(module: nn.Module, args: Any, always: bool = False) -> None:
        if not always and module.training and torch.is_grad_enabled():
            return
        try:
            barrier(group=group, timeout=bound, wait_all_ranks=True)
        except RuntimeError as err:
            # A PeerLostError (a RuntimeError): the peer-watch phase around a Fabric forward passes it on as it is.
            raise PeerLostError(
                f"Rank {dist.get_rank()} ran a forward of the sharded {type(module).__name__} outside training that"
                f" not every rank ran within {timeout:g} s (FSDP2Strategy(unmatched_forward_timeout=...)), or that"
                " another rank reached more than that later (rank-0-only work just before it: then raise the bound). Each"
                " forward of a sharded model all-gathers its parameters from every rank, so every rank must run it:"
                " sample (or evaluate, or `generate`) on all ranks and print or log on rank 0 only, e.g."
                " `out = generate(model, ...)` then `if fabric.global_rank == 0: print(out)`. Torch reported:"
                f" {str(err).strip()[:300]}"
            ) from None

    for root in roots:
        # Prepended after fully_shard's own pre-forward hook, so that it runs first: the barrier comes before the
        # first all-gather.
        root.register_forward_pre_hook(check, prepend=True)
        # `generate` is an FSDP forward method (register_fsdp_forward_method put a wrapper on the instance that
        # all-gathers the root before HF's loop calls the forward): the check must come before that wrapper. The
        # one attribute of a user module we replace, with a function that calls FSDP2's wrapper.
        fsdp_generate = root.__dict__.get("generate")
        if fsdp_generate is not None:
            root.generate = _checked(fsdp_generate, check, root)


def _checked(method: Any, check: Any, root: nn.Module) -> Any:
    def generate(*args: Any, **kwargs: Any) -> Any:
        check(root, args, always=True)  # generation is never a training forward (HF runs it under no_grad)
        return method(*args, **kwargs)

    return generate
