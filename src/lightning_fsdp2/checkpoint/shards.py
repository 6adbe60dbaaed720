"""Moving values between whole tensors and FSDP2 shards: a rank's slice in, whole tensors out to rank 0.

Which ranks hold which piece comes from each tensor's own placements (:mod:`lightning_fsdp2.layout`), not from the
position of a mesh dimension."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fsdp2.checkpoint.sources import TensorSource
from lightning_fsdp2.layout import local_slice, split_dims

__all__ = ["copy_into", "drain_tensor", "gather_tensor", "gather_tensor_into", "gather_to_rank0", "local_slice",
           "receive_bytes"]


@torch.no_grad()
def copy_into(tensor: Tensor, source: TensorSource, key: str) -> Tensor | None:
    """Copy this rank's slice of ``source[key]`` into ``tensor``'s local storage, cast to its dtype; return that
    local storage (``None`` where this rank holds none of it)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel() == 0 and tensor.numel() != 0:
        return None  # this rank's shard of a small tensor is empty
    local.copy_(source.read(key, local_slice(tensor)))
    return local


def gather_to_rank0(state: Any, same_as: Mapping[str, str] | None = None) -> Any:
    """Replace every ``DTensor`` in a (nested) state dict by its whole tensor on CPU, on rank 0 only.

    One tensor at a time: each rank sends its shard point-to-point straight into rank 0's buffer for that tensor,
    and rank 0 moves it to CPU memory before the next. So rank 0 holds what it will write plus one tensor in
    flight, and the other ranks hold nothing beyond their shards. (``get_model_state_dict(...,
    full_state_dict=True)`` all-gathers instead: every rank briefly holds each whole tensor, several times over.)

    ``same_as`` maps top-level keys of tied weights to the key they share a tensor with: those are sent once and
    stay one tensor (one storage in the file), as in a single-device state dict. Call on every rank, with the
    same structure; other ranks get an empty dict back.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    same_as = same_as or {}

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            return gather_tensor(value)
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    if isinstance(state, Mapping) and same_as:
        gathered = {k: walk(v) for k, v in state.items() if k not in same_as}
        gathered = {k: gathered[same_as[k]] if k in same_as else gathered[k] for k in state}
    else:
        gathered = walk(state)
    return gathered if rank0 else {}


def gather_tensor(tensor: Tensor) -> Tensor | None:
    """The whole of ``tensor`` (a ``DTensor`` or a plain tensor) in fresh CPU memory on rank 0, ``None`` elsewhere;
    call on every rank. Never a view of the live model (``save_merged`` merges into the result)."""
    return _gather(tensor, "copy")


def gather_tensor_into(tensor: Tensor, scratch: Tensor | None) -> Tensor | None:
    """As :func:`gather_tensor`, but on rank 0 the result may be a view of the first rows of a padded receive buffer
    (contiguous, at offset 0 of its storage), which saves a copy when only its bytes are needed; ``scratch`` (a flat
    ``uint8`` tensor on the mesh's device, at least :func:`receive_bytes` long, or ``None``) is that buffer, so that
    gathering many tensors in turn reuses one block of memory (the result is valid until the next call)."""
    return _gather(tensor, "view", scratch)


def drain_tensor(tensor: Tensor) -> None:
    """The collective of :func:`gather_tensor` with nothing kept: rank 0 (after a failure) receives what the other
    ranks send, one shard's worth of memory at a time, so that they are not left waiting."""
    _gather(tensor, "discard")


def _gather(tensor: Tensor, mode: Literal["copy", "view", "discard"], scratch: Tensor | None = None) -> Tensor | None:
    from torch.distributed.tensor import DTensor

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    keep = rank0 and mode != "discard"
    if not isinstance(tensor, DTensor):
        return tensor.detach().to("cpu", copy=True) if keep else None
    mesh = tensor.device_mesh
    shard_dim = _rows_split_on(tensor)
    if shard_dim is None:
        # Split by more than one mesh dimension (tensor parallelism's split, sharded again by FSDP2), or otherwise:
        # the general path, an all-gather (every rank briefly holds this one whole tensor).
        full = tensor.full_tensor()
        return full.to("cpu", copy=True).contiguous() if keep else None
    group, world = mesh.get_group(shard_dim), mesh.size(shard_dim)
    if 0 not in dist.get_process_group_ranks(group):
        # Replicated over the other mesh dimensions (HSDP's replicas; a tensor group's ranks, for a parameter tensor
        # parallelism leaves whole, which lives on the data-parallel mesh alone): every group of the split dimension
        # holds the same pieces, so only the one that holds rank 0 sends them; the others have nothing to do.
        return None
    rows = tensor.shape[0]
    chunk = math.ceil(rows / world)
    # With CPU offload the shards live in CPU memory, but NCCL only moves device memory.
    local = tensor.to_local().detach().to(mesh.device_type)
    if local.shape[0] != chunk:  # torch.chunk pieces: the last ranks may hold fewer rows; messages need equal sizes
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        local = padded
    # Point-to-point into the pieces of rank 0's buffer: a `gather` would (on gloo) receive into a temporary of
    # the whole tensor first and copy from there.
    if not rank0:
        dist.send(local.contiguous(), dst=dist.get_global_rank(group, 0), group=group)
        return None
    if mode == "discard":
        _drain(local, group, world)
        return None
    shape = (world * chunk, *local.shape[1:])
    try:
        if scratch is not None and scratch.device.type == local.device.type:
            nbytes = math.prod(shape) * local.element_size()
            buffer = scratch[:nbytes].view(local.dtype).view(shape)
        else:
            buffer = torch.empty(shape, dtype=local.dtype, device=local.device)
    except BaseException:  # out of memory: still take what the others send, then fail
        _drain(local, group, world)
        raise
    pieces = buffer.chunk(world)
    pending = [dist.irecv(pieces[r], src=dist.get_global_rank(group, r), group=group) for r in range(1, world)]
    pieces[0].copy_(local)
    for request in pending:
        request.wait()
    full = buffer[:rows]
    if full.device.type != "cpu":
        return full.cpu()
    # torch.save of a view saves the padding too
    return full.clone() if mode == "copy" and world * chunk != rows else full


def receive_bytes(tensor: Tensor) -> int:
    """Bytes of the padded buffer :func:`gather_tensor_into` receives ``tensor`` into on rank 0 (0 if it takes the
    general path, or is not a ``DTensor``)."""
    shard_dim = _rows_split_on(tensor)
    if shard_dim is None:
        return 0
    parts = tensor.device_mesh.size(shard_dim)  # type: ignore[attr-defined]
    rows = math.ceil(tensor.shape[0] / parts) * parts
    return rows * math.prod(tensor.shape[1:]) * tensor.element_size()


def _rows_split_on(tensor: Any) -> int | None:
    """The mesh dimension that splits ``tensor`` in ``torch.chunk`` pieces of its rows, when that is the only one
    that splits it (FSDP2's layout, with or without replicas: FSDP and HSDP); ``None`` for any other layout (or an
    empty tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor) or tensor.ndim == 0 or tensor.shape[0] == 0:
        return None
    split = split_dims(tensor)
    if len(split) != 1 or next(iter(split.values())) != 0:
        return None
    (mesh_dim,) = split
    placements = tensor.placements
    # Exactly Shard(0) (not a strided shard) and plain replicas elsewhere (not Partial).
    if type(placements[mesh_dim]) is not Shard or any(
        not isinstance(p, Replicate) for d, p in enumerate(placements) if d != mesh_dim
    ):
        return None
    return mesh_dim


def _drain(local: Tensor, group: Any, world: int) -> None:
    """Receive every other rank's piece (shaped like ``local``) into one scratch piece, one after another."""
    scratch = torch.empty_like(local)  # never `local` itself: it may be the live parameter's storage
    for r in range(1, world):
        dist.recv(scratch, src=dist.get_global_rank(group, r), group=group)
