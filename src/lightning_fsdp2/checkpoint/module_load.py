"""``module.load_state_dict`` and ``optimizer.load_state_dict`` of whole tensors on a sharded model, as in one process.

Code written for one device loads weights after set-up with ``model.load_state_dict(torch.load(path))``: a warm
start, a resume of its own, a library such as LitGPT. On FSDP2's parameters (``DTensor`` shards) torch's copy fails
("got mixed torch.Tensor and DTensor"). Rather than a load of our own beside torch's, every module that holds shards
gets a load-state-dict pre-hook that turns the whole tensors meant for it into this rank's shard, just before torch
copies (or, with ``assign=True``, assigns) them. So torch's own load runs unchanged: the model's own
``_load_from_state_dict`` overrides and load hooks (which rename old keys, as LitGPT's LoRA layers do) run first, in
the order they do in one process, and ``strict``, the missing and unexpected keys and the size-mismatch messages are
torch's.

The same hooks let :func:`load_through_model` read a checkpoint through the model's own key mapping: the state dict
handed to ``load_state_dict`` holds ``meta`` placeholders, and the hook reads only this rank's slice of each from the
file when it reaches the parameter it is meant for.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fsdp2.checkpoint.plan import tied_aliases
from lightning_fsdp2.checkpoint.shards import gather_to_rank0, local_slice
from lightning_fsdp2.checkpoint.sources import TensorSource
from lightning_fsdp2.quantize import is_nf4

# The placeholders of the load_through_model call in progress (id of the meta tensor -> its key in the source). Set
# only for that call's duration, in that thread: the hooks below are registered once for the model's lifetime and
# must know, while torch's load runs, which meta tensors stand for tensors of the file.
_placeholders: ContextVar[tuple[TensorSource, dict[int, str]] | None] = ContextVar(
    "lightning_fsdp2_load_placeholders", default=None
)


def _owns_tensors(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters or buffers of its own (not only in its children)."""
    return any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])


def install_load_hooks(root: nn.Module) -> None:
    """Let ``load_state_dict`` take whole tensors (CPU, ``mmap``-ed, on the device) or ``DTensor``s on the sharded
    model ``root``: a pre-hook on each module that holds tensors of its own turns those meant for its shards into the
    shard this rank holds (and reads :func:`load_through_model`'s placeholders for its plain tensors too)."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            # A root stays unsharded after a forward without backward (an evaluation): its parameters are then the
            # gathered tensors. FSDP2 puts them back in its own load pre-hook, but registers that at the first
            # forward, after ours, on the same modules: reshard first, from the group's module, which torch loads
            # before any module inside it.
            module.register_load_state_dict_pre_hook(lambda m, *_: m.reshard())
        if _owns_tensors(module):
            module.register_load_state_dict_pre_hook(_to_local_shards)


@torch.no_grad()
def _to_local_shards(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
    missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
) -> None:
    """Replace the entries of ``state_dict`` meant for ``module``'s own tensors by this rank's shards of them.

    ``state_dict`` is torch's own shallow copy of the user's, so nothing the caller holds changes. Entries whose shape
    does not fit are left as they are: torch then reports its "size mismatch" message for them."""
    from torch.distributed.tensor import DTensor

    pending = _placeholders.get()
    for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
        key = prefix + name
        if tensor is None or key not in state_dict:
            continue
        value = state_dict[key] = _loaded(state_dict[key])
        if is_nf4(tensor) and _same_layout(value, tensor) and is_nf4(value):
            # NF4 codes into NF4 codes (torchao's copy takes them as they are): above all the model's own tensors,
            # which DCP's `set_model_state_dict(..., full_state_dict=True)` hands back for every key the caller
            # left out (an adapters-only state dict leaves out the whole base).
            continue
        if is_nf4(tensor):
            state_dict.pop(key)
            error_msgs.append(
                f"'{key}' is stored in NF4 (load_pretrained(..., quantize='nf4')), and load_state_dict cannot quantize"
                " into it. Load base weights with `lightning_fsdp2.load_pretrained(model, path, quantize='nf4')` at"
                " model build time, and only the adapters (or other unquantized tensors) with load_state_dict."
            )
            continue
        if pending is not None and isinstance(value, Tensor) and value.is_meta:
            source, keys = pending
            if id(value) not in keys:
                state_dict.pop(key)
                error_msgs.append(
                    f"{type(module).__name__}'s load hook made a new tensor for '{key}' instead of renaming one of the"
                    " file's: it cannot be read a slice at a time. Load the whole state dict instead:"
                    " `model.load_state_dict(torch.load(path, mmap=True, weights_only=True), strict=...)`."
                )
                continue
            if tuple(source.shape(keys[id(value)])) != tuple(tensor.shape):
                continue  # torch's size-mismatch message (the placeholder has the file's shape)
            state_dict[key] = _shard_of(tensor, lambda index, k=keys[id(value)]: source.read(k, index))
            continue
        if not isinstance(tensor, DTensor) or not isinstance(value, Tensor) or tuple(value.shape) != tuple(tensor.shape):
            continue  # torch's own copy (a plain tensor), or its own messages (not a tensor, size mismatch)
        if _same_layout(value, tensor) and value.dtype == tensor.dtype and (
            value.to_local().device == tensor.to_local().device
        ):
            continue  # a shard of the same layout (a sharded model's own state_dict()): copied shard to shard
        state_dict[key] = _shard_of(tensor, lambda index, v=value: _whole(v)[index])


def _same_layout(value: Any, tensor: Tensor) -> bool:
    """Whether ``value`` is laid out as ``tensor``: both plain tensors of one shape, or ``DTensor``s of one shape,
    mesh and placements (so their local pieces correspond)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, Tensor) or tuple(value.shape) != tuple(tensor.shape):
        return False
    if isinstance(tensor, DTensor) or isinstance(value, DTensor):
        return isinstance(value, DTensor) and isinstance(tensor, DTensor) and (
            value.device_mesh, value.placements) == (tensor.device_mesh, tensor.placements)
    return True


def _loaded(value: Any) -> Any:
    """``value`` as a tensor, where it is one of Lightning's lazily loaded tensors (``lazy_load``, behind LitGPT's
    ``load_checkpoint``, ``fabric.load_raw`` and the Trainer's checkpoint loads): those are not ``Tensor``s, and
    torch's copy would load them whole and then fail on "mixed torch.Tensor and DTensor". Lightning's loader reads
    a tensor's whole record from the file (its archive reader reads no part of one), so each rank reads one whole
    tensor at a time here and keeps only its slice of it (the rest is freed before the next tensor)."""
    if isinstance(value, Tensor):
        return value
    from lightning.fabric.utilities.load import _NotYetLoadedTensor

    return value._load_tensor() if isinstance(value, _NotYetLoadedTensor) else value


def _whole(value: Tensor) -> Tensor:
    """``value`` as a plain tensor holding all its elements (a ``DTensor`` of another layout is gathered)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _shard_of(target: Tensor, read: Any) -> Tensor:
    """This rank's piece of a whole tensor shaped like ``target``, as ``target`` holds it (same layout, dtype and
    device: FSDP2 gathers each group in one dtype, so ``assign=True`` keeps the model's), read by ``read(index)``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return read(tuple(slice(0, n) for n in target.shape)).to(device=target.device, dtype=target.dtype)
    local = target.to_local()
    if local.numel() == 0:  # this rank's shard of a small tensor is empty: nothing to read (a safetensors slice
        piece = torch.empty_like(local)  # that starts at the end is refused)
    else:
        piece = read(local_slice(target)).to(device=local.device, dtype=local.dtype).contiguous()
    return _like(target, piece)


def _like(target: Tensor, piece: Tensor) -> Tensor:
    """A ``DTensor`` of ``target``'s layout whose local tensor is ``piece`` itself: ``DTensor.from_local`` would move
    it to the mesh's device, but under CPU offload the shards live in CPU memory on a CUDA mesh."""
    from torch.distributed.tensor import DTensor

    return DTensor(piece, target._spec, requires_grad=False)  # as FSDP2 builds its own sharded parameters


@contextmanager
def _reading(source: TensorSource, keys: dict[int, str]) -> Generator[None, None, None]:
    token = _placeholders.set((source, keys))
    try:
        yield
    finally:
        _placeholders.reset(token)


def uses_own_load_hooks(module: nn.Module) -> bool:
    """Whether a module of ``module`` maps checkpoint keys itself (it overrides ``_load_from_state_dict``)."""
    # torch's own overrides (BatchNorm's `num_batches_tracked`, InstanceNorm's) map nothing.
    return any(not type(m)._load_from_state_dict.__module__.startswith("torch.") for m in module.modules()
               if type(m)._load_from_state_dict is not nn.Module._load_from_state_dict)


def load_through_model(module: nn.Module, source: TensorSource, *, strict: bool) -> Any:
    """``module.load_state_dict`` of ``source``'s tensors, each rank reading only its slices: the model's own load
    hooks see every key of the source (on ``meta`` placeholders of the file's shapes) and may rename them, and torch
    decides, as in one process, what is missing or unexpected. Returns torch's ``_IncompatibleKeys``."""
    placeholders = {key: torch.empty(source.shape(key), device="meta") for key in source.keys()}
    keys = {id(t): key for key, t in placeholders.items()}
    # The hooks for this call alone, so that an unsharded model (one device, DDP) reads its placeholders too; on a
    # sharded one the hooks installed at set-up then find nothing left to do.
    handles = [m.register_load_state_dict_pre_hook(_to_local_shards) for m in module.modules() if _owns_tensors(m)]
    try:
        with _reading(source, keys):
            return module.load_state_dict(placeholders, strict=strict)
    finally:
        for handle in handles:
            handle.remove()


def install_optimizer_load_hook(optimizer: Optimizer) -> None:
    """Let ``optimizer.load_state_dict`` take a state saved by a one-device run: before torch loads it, each state
    tensor of a sharded parameter with the parameter's shape (Adam's moments) becomes this rank's shard of it, so
    that torch then moves only shards to the device (never the whole optimizer state on every rank). Without this
    the next ``step`` fails on "mixed torch.Tensor and DTensor". States of other shapes are left to torch."""
    optimizer.register_load_state_dict_pre_hook(_shard_saved_state)


@torch.no_grad()
def _shard_saved_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    saved_groups = state_dict.get("param_groups", [])
    ids = [i for group in saved_groups for i in group.get("params", [])]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(ids) != len(params) or not isinstance(state_dict.get("state"), Mapping):
        return state_dict  # torch's own error for groups that do not match
    state = dict(state_dict["state"])
    for saved_id, param in zip(ids, params):  # torch matches saved ids to parameters in this order too
        entry = state.get(saved_id)
        if not isinstance(param, DTensor) or not isinstance(entry, Mapping):
            continue
        state[saved_id] = {
            # In the parameter's dtype: torch's load casts floating-point state to it anyway.
            name: _shard_of(param, lambda index, v=value: v[index])
            if isinstance(value, Tensor) and not isinstance(value, DTensor) and tuple(value.shape) == tuple(param.shape)
            else value
            for name, value in entry.items()
        }
    return {**state_dict, "state": state}


def full_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every shard gathered into its whole tensor in CPU memory, on rank 0; an empty
    dict on the other ranks. Call it on every rank (each sends its shards), where one-device code calls
    ``module.state_dict()`` to ``torch.save`` it: ``state = full_state_dict(model)``, then
    ``if rank == 0: torch.save(state, path)``. Names are the clean ones, tied weights stay one tensor, and
    tensors reach rank 0 one at a time (it holds the result and one tensor in flight; the others nothing more).

    (A sharded module's own ``state_dict()`` returns each rank's ``DTensor`` shards: what
    ``torch.distributed.checkpoint`` saves, and what ``load_state_dict`` takes back.)"""
    state = module.state_dict()
    return gather_to_rank0(state, same_as=tied_aliases(module, state))
