"""The two checkpoint formats, saved and resumed at any world size: ``"full"`` (one file) and ``"sharded"`` (DCP).

These are the functions ``FSDP2Strategy``'s checkpoint hooks call: :func:`save`, :func:`load`, :func:`load_model`,
:func:`load_optimizers`.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fsdp2.checkpoint.files import (
    FORMAT_KEY,
    META_FILENAME,
    CheckpointError,
    atomic_save,
    check_sharded_files,
    is_local,
    load_torch_file,
    on_rank0,
    replace,
)
from lightning_fsdp2.checkpoint.plan import listing, plan_load, run_plan, tied_aliases
from lightning_fsdp2.checkpoint.pretrained import has_pretrained
from lightning_fsdp2.checkpoint.shards import gather_to_rank0, local_slice
from lightning_fsdp2.checkpoint.sources import StateDictSource

# Added to a checkpoint dict when it is read (never saved): the file it came from, and for a sharded checkpoint the
# directory its tensors are still in.
LOADED_FROM_KEY = "_lightning_fsdp2_loaded_from"
SHARDED_PATH_KEY = "_lightning_fsdp2_sharded_path"


# =============================================================================================== what is saved
def model_state(module: nn.Module, *, sharded: bool, trainable_only: bool) -> dict[str, Any]:
    """The model's state dict with clean names, as a checkpoint holds it.

    ``sharded=True``: each rank's ``DTensor`` shards, for ``torch.distributed.checkpoint``. ``sharded=False``: whole
    tensors on CPU on rank 0 (empty elsewhere), gathered by :func:`gather_to_rank0`, tied weights as one tensor.
    ``trainable_only`` leaves out parameters with ``requires_grad=False``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=trainable_only))
    if sharded:
        return state
    return gather_to_rank0(state, same_as=tied_aliases(module, state))


def optimizer_state(module: nn.Module, optimizer: Optimizer, *, sharded: bool) -> dict[str, Any]:
    """The optimizer's state as a checkpoint holds it.

    ``sharded=True``: name-keyed ``DTensor`` shards. ``sharded=False``: whole tensors on CPU on rank 0 (empty
    elsewhere) in ``torch.optim``'s index-keyed form, the form a single-device run writes.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer)
    if sharded:
        return state
    full = gather_to_rank0(state)
    return optimizer_state_by_index(full) if full else {}


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
        raise CheckpointError(
            f"The checkpoint's optimizer state has parameter groups of sizes {[len(g) for g in theirs]}, but the"
            f" optimizer's are {[len(g) for g in ours]}. Were different parameters trainable (or a different"
            " `configure_optimizers`) when it was saved? Resume with the same ones."
        )
    order = dict(zip((i for g in theirs for i in g), (n for g in ours for n in g)))
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {order[i]: value for i, value in state["state"].items()}, "param_groups": groups}


# =============================================================================================== saving
def save(
    checkpoint: dict[str, Any],
    path: str,
    *,
    sharded: bool,
    trainable_only: bool,
    world_size: int,
    checkpoint_io: Any,
    storage_options: Any = None,
) -> None:
    """Write a Lightning checkpoint atomically; call on every rank.

    ``sharded=False``: rank 0 writes one file (through the user's own ``CheckpointIO`` if one was given, or for
    a remote path). ``sharded=True``: a directory (:func:`save_sharded`). A plain full checkpoint gets no extra
    key, so it is exactly what a single-device run writes; the others record how they were written.
    """
    from lightning.fabric.plugins import TorchCheckpointIO

    if sharded or trainable_only:
        checkpoint[FORMAT_KEY] = {
            "state_dict_type": "sharded" if sharded else "full",
            "trainable_only": trainable_only,
            "world_size": world_size,
        }
    if sharded:
        if storage_options is not None or not is_local(path):
            raise CheckpointError(
                f"Sharded checkpoints are written to a local or mounted directory; got {path!r}"
                + (" with storage_options" if storage_options is not None else "")
                + ". Save to a local path, or use state_dict_type='full' with a CheckpointIO plugin."
            )
        save_sharded(checkpoint, Path(path))
    elif type(checkpoint_io) is TorchCheckpointIO and is_local(path):
        on_rank0(lambda: atomic_save(checkpoint, path), f"write the checkpoint {path}")
    else:  # the user's own CheckpointIO plugin, or a remote path: Lightning's writer decides
        on_rank0(lambda: checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options), "save")


def save_sharded(checkpoint: Mapping[str, Any], path: Path) -> None:
    """Write a sharded checkpoint directory; call on every rank.

    Tensors (``state_dict``, ``optimizer_<i>``, the layout Lightning's ``ModelParallelStrategy`` uses) go through
    ``torch.distributed.checkpoint``, each rank writing its own shards; everything else goes to ``meta.pt``
    from rank 0. All of it is written into a temporary directory that replaces ``path`` only once complete.
    """
    import torch.distributed.checkpoint as dcp

    tensors = {"state_dict": checkpoint["state_dict"]}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.get("optimizer_states", []))})
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    token = [uuid.uuid4().hex[:8]]
    dist.broadcast_object_list(token, src=0)  # every rank must write into the same temporary directory
    tmp = path.with_name(f".{path.name}.tmp-{token[0]}")
    dcp.save(tensors, checkpoint_id=tmp)  # collective; DCP raises on every rank if any rank fails

    def finish() -> None:
        try:
            atomic_save(meta, tmp / META_FILENAME)
            replace(tmp, path)
        finally:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp)

    on_rank0(finish, f"finish the sharded checkpoint {path}")


# =============================================================================================== resuming
def load(path: str, *, weights_only: bool | None, checkpoint_io: Any) -> dict[str, Any]:
    """Read a checkpoint of either format; tensors stay on disk (``mmap``) until loaded into the shards.

    ``weights_only`` defaults to ``True``: nothing but tensors and plain containers is unpickled. A sharded
    checkpoint returns its ``meta.pt`` with placeholders: its tensors are read by :func:`load_model` and
    :func:`load_optimizers`, straight into the shards.
    """
    from lightning.fabric.plugins import TorchCheckpointIO

    weights_only = True if weights_only is None else weights_only
    if not is_local(path) or type(checkpoint_io) is not TorchCheckpointIO:
        checkpoint = checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    elif Path(path).is_dir():
        checkpoint = read_sharded_meta(Path(path), weights_only=weights_only)
    else:
        checkpoint = load_torch_file(path, weights_only=weights_only)
    checkpoint[LOADED_FROM_KEY] = str(path)
    return checkpoint


def read_sharded_meta(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """Check a sharded checkpoint's files and return its non-tensor part (``meta.pt``).

    ``optimizer_states`` holds placeholders (``"optimizer_0"``...), one per optimizer whose state is in the
    directory: Lightning checks the key exists before it asks the strategy to load the states.
    """
    metadata = check_sharded_files(path)
    checkpoint = load_torch_file(path / META_FILENAME, weights_only=weights_only)
    saved = {k.split(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith("optimizer_")}
    if saved:
        checkpoint["optimizer_states"] = sorted(saved, key=lambda k: int(k.split("_")[1]))
    checkpoint[SHARDED_PATH_KEY] = str(path)
    return checkpoint


def load_model(module: nn.Module, checkpoint: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load the model's weights from a checkpoint of either format into its shards, at any world size."""
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    may_be_missing = None
    if checkpoint.get(FORMAT_KEY, {}).get("trainable_only"):
        # A trainable-only checkpoint leaves out the frozen base, which load_pretrained must have loaded already.
        may_be_missing = frozen.__contains__
        if frozen and not has_pretrained(module):
            warnings.warn(
                "This checkpoint holds only trainable parameters; the frozen ones keep the values they have now, and"
                " no load_pretrained call gave them any. Call load_pretrained(...) in configure_model."
            )
    if SHARDED_PATH_KEY in checkpoint:
        load_sharded_model(module, Path(checkpoint[SHARDED_PATH_KEY]), strict=strict, may_be_missing=may_be_missing)
    else:
        origin = checkpoint.get(LOADED_FROM_KEY, "the checkpoint")
        load_full_state_dict(module, checkpoint["state_dict"], strict=strict, may_be_missing=may_be_missing, origin=origin)


def load_optimizers(module: nn.Module, optimizers: Sequence[Optimizer], checkpoint: Mapping[str, Any]) -> None:
    """Load each optimizer's state into its sharded state, from either format, at any world size."""
    states = checkpoint.get("optimizer_states", [])
    if len(states) != len(optimizers):
        raise CheckpointError(
            f"The checkpoint holds state for {len(states)} optimizer(s), but `configure_optimizers` returned"
            f" {len(optimizers)}. Resume with the same optimizers."
        )
    for i, (optimizer, state) in enumerate(zip(optimizers, states)):
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        if SHARDED_PATH_KEY in checkpoint:
            load_sharded_optimizer(module, optimizer, Path(checkpoint[SHARDED_PATH_KEY]), i)
        else:
            load_full_optimizer(module, optimizer, state)


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    may_be_missing: Callable[[str], bool] | None = None,
    origin: str = "the checkpoint",
) -> None:
    """Load a full (unsharded) state dict into a sharded or plain ``module``: each rank copies only its slices.

    With the file ``mmap``-ed, every rank reads just the bytes its shards hold. ``may_be_missing(name)`` exempts
    parameters the checkpoint is known to leave out (a trainable-only checkpoint leaves out the frozen base).
    """
    source = StateDictSource(state_dict, origin)
    plan = plan_load(module, source)
    missing = [n for n in plan.missing if not (may_be_missing and may_be_missing(n))]
    _raise_if_misfit(module, origin, plan.mismatched, missing if strict else [], plan.unexpected if strict else [])
    run_plan(module, source, plan)


@torch.no_grad()
def load_full_optimizer(module: nn.Module, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    """Load a full (index-keyed) optimizer state into the optimizer's sharded state: each rank copies its slices."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    saved = optimizer_state_by_name(state, optimizer, module)
    target = get_optimizer_state_dict(module, optimizer)  # sharded; creates the state tensors to load into
    for name, slots in target["state"].items():
        if name not in saved["state"]:
            continue  # never stepped when saved: the optimizer creates its state at the first step, as it would
        for slot, tensor in slots.items():
            value = saved["state"][name].get(slot)
            if not isinstance(value, Tensor) or tuple(value.shape) != tuple(tensor.shape):
                found = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise CheckpointError(
                    f"The optimizer state {slot!r} of {name!r} is {found} in the checkpoint but"
                    f" {tuple(tensor.shape)} in the optimizer. Resume with the optimizer that saved it."
                )
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if local.numel():
                local.copy_(value[local_slice(tensor)])
    target["param_groups"] = saved["param_groups"]
    target["state"] = {n: s for n, s in target["state"].items() if n in saved["state"]}
    set_optimizer_state_dict(module, optimizer, target)


def load_sharded_model(
    module: nn.Module, path: Path, *, strict: bool = True, may_be_missing: Callable[[str], bool] | None = None
) -> None:
    """Load the model part of a sharded checkpoint into ``module``, at any world size (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    metadata = check_sharded_files(path)
    saved = {
        k[len("state_dict.") :]: m
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("state_dict.") and isinstance(m, TensorStorageMetadata)
    }
    state = get_model_state_dict(module)
    missing = [k for k in state if k not in saved and not (may_be_missing and may_be_missing(k))]
    unexpected = [k for k in saved if k not in state]
    mismatched = [
        f"{k!r} has shape {tuple(saved[k].size)} in the checkpoint but {tuple(state[k].shape)} in the model"
        for k in state
        if k in saved and tuple(saved[k].size) != tuple(state[k].shape)
    ]
    _raise_if_misfit(module, str(path), mismatched, missing if strict else [], unexpected if strict else [])
    state = {k: v for k, v in state.items() if k in saved}
    dcp.load({"state_dict": state}, checkpoint_id=path)
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))


def load_sharded_optimizer(module: nn.Module, optimizer: Optimizer, path: Path, index: int) -> None:
    """Load the state of the ``index``-th optimizer from a sharded checkpoint, at any world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    key = f"optimizer_{index}"
    metadata = check_sharded_files(path)
    if not any(k.startswith(f"{key}.") for k in metadata.state_dict_metadata):
        raise CheckpointError(
            f"The checkpoint {path} holds no state for optimizer {index} (saved with `weights_only`?). Resume from a"
            " checkpoint with optimizer state, or load only the weights."
        )
    state = get_optimizer_state_dict(module, optimizer)  # creates the (sharded) state tensors to load into
    loaded = {key: state}
    dcp.load(loaded, checkpoint_id=path)
    set_optimizer_state_dict(module, optimizer, loaded[key])


def _raise_if_misfit(
    module: nn.Module, origin: str, mismatched: list[str], missing: list[str], unexpected: list[str]
) -> None:
    problems = []
    if mismatched:
        problems.append("shapes differ: " + "; ".join(mismatched))
    if missing:
        problems.append(f"{len(missing)} tensor(s) of the model are not in it: {listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} key(s) in it fit nothing in the model: {listing(unexpected)}")
    if problems:
        raise CheckpointError(
            f"The checkpoint {origin} does not fit {type(module).__name__}: " + ". ".join(problems)
            + ". Was it saved from a different model or configuration?"
        )
