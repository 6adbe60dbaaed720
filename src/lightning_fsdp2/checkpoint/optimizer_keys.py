"""Optimizer state dicts between their two key forms: ``torch.optim``'s index-keyed one (what a single-device run
and a full checkpoint hold) and ``torch.distributed.checkpoint``'s name-keyed one (what a sharded checkpoint holds)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_fsdp2.checkpoint.files import CheckpointFileError


def optimizer_state_by_index(state: Mapping[str, Any]) -> dict[str, Any]:
    """Turn a name-keyed optimizer state dict (``torch.distributed.checkpoint``'s form) into ``torch.optim``'s
    index-keyed form, which single-device Lightning checkpoints hold. Indices follow the order of the parameters
    in the param groups, as ``Optimizer.state_dict()`` numbers them."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups = [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state: Mapping[str, Any], optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_index` for ``optimizer``, whose parameters belong to ``module``."""
    names = {id(p): n for n, p in module.named_parameters()}
    ours = [[names.get(id(p), "<not in the model>") for p in group["params"]] for group in optimizer.param_groups]
    theirs = [list(group["params"]) for group in state["param_groups"]]
    if [len(g) for g in ours] != [len(g) for g in theirs]:
        raise CheckpointFileError(
            f"The checkpoint's optimizer state has parameter groups of sizes {[len(g) for g in theirs]}, but the"
            f" optimizer's are {[len(g) for g in ours]}. Were different parameters trainable (or a different"
            " `configure_optimizers`) when it was saved? Resume with the same ones."
        )
    order = dict(zip((i for g in theirs for i in g), (n for g in ours for n in g)))
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {order[i]: value for i, value in state["state"].items()}, "param_groups": groups}
