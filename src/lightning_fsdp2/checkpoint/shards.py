"""Moving values between whole tensors and FSDP2 shards: a rank's slice in, whole tensors out to rank 0."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fsdp2.checkpoint.sources import TensorSource


def local_slice(tensor: Tensor) -> tuple[slice, ...]:
    """The slice of the whole tensor that this rank's local piece of ``tensor`` holds (all of it if not a DTensor).

    FSDP2 shards a parameter along one dimension in ``torch.chunk`` pieces: rank ``r`` holds rows
    ``[r * ceil(n / world), ...)``, and the last ranks may hold fewer rows or none.
    """
    from torch.distributed.tensor import DTensor

    index = [slice(0, n) for n in tensor.shape]
    if not isinstance(tensor, DTensor):
        return tuple(index)
    for mesh_dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard():
            raise NotImplementedError(f"Loading into a DTensor placed as {placement} is not supported.")
        dim = placement.dim  # type: ignore[attr-defined]
        size, parts = tensor.shape[dim], tensor.device_mesh.size(mesh_dim)
        chunk = math.ceil(size / parts)
        start = min(tensor.device_mesh.get_local_rank(mesh_dim) * chunk, size)
        index[dim] = slice(start, min(start + chunk, size))
    local_shape = tuple(s.stop - s.start for s in index)
    if local_shape != tuple(tensor.to_local().shape):
        raise NotImplementedError(
            f"Unexpected shard layout {tensor.placements} (local shape {tuple(tensor.to_local().shape)}, computed"
            f" {local_shape}); only FSDP2's even chunking along one dimension is supported."
        )
    return tuple(index)


@torch.no_grad()
def copy_into(tensor: Tensor, source: TensorSource, key: str) -> None:
    """Copy this rank's slice of ``source[key]`` into ``tensor``'s local storage, cast to its dtype."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel() == 0 and tensor.numel() != 0:
        return  # this rank's shard of a small tensor is empty
    local.copy_(source.read(key, local_slice(tensor)))


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
            return gather_tensor(value, rank0)
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


def gather_tensor(
    tensor: Tensor, rank0: bool, copy: bool = True, discard: bool = False, scratch: Tensor | None = None
) -> Tensor | None:
    """The whole of ``tensor`` (a ``DTensor`` or a plain tensor) in CPU memory on rank 0, ``None`` elsewhere; call on
    every rank. ``copy=False``: the result may be a view of the first rows of a padded receive buffer (contiguous, at
    offset 0 of its storage), which saves a copy when only its bytes are needed. ``scratch`` (rank 0, a flat
    ``uint8`` tensor on the mesh's device, at least :func:`receive_bytes` long): receive into it instead of a new
    buffer, so that gathering many tensors in turn reuses one block of memory (valid until the next call).
    ``discard=True`` (rank 0, after a failure): receive what the other ranks send, one shard's worth of memory at a
    time, and keep nothing, so that they are not left waiting."""
    from torch.distributed.tensor import DTensor

    # Always fresh memory: the result must never alias the live model (save_merged merges into it).
    if not isinstance(tensor, DTensor):
        return tensor.detach().to("cpu", copy=True) if rank0 and not discard else None
    mesh = tensor.device_mesh
    layout = _fsdp_layout(tensor)
    if layout is None:
        full = tensor.full_tensor()  # a layout FSDP2 does not make by default: the general (all-gather) path
        return full.to("cpu", copy=True).contiguous() if rank0 and not discard else None
    if layout == "hsdp" and mesh.get_local_rank(0) != 0:
        # Replicated over the first mesh dimension: every replica holds the same shards, so only the shard group of
        # replica 0 (which holds rank 0) sends them; the other replicas have nothing to do.
        return None
    group, world = mesh.get_group(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
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
    if discard:
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
    return full.clone() if copy and world * chunk != rows else full  # torch.save of a view saves the padding too


def receive_bytes(tensor: Tensor) -> int:
    """Bytes of the padded buffer :func:`gather_tensor` receives ``tensor`` into on rank 0 (0 if not a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor) or tensor.ndim == 0 or tensor.shape[0] == 0:
        return 0
    parts = tensor.device_mesh.size(tensor.device_mesh.ndim - 1)
    rows = math.ceil(tensor.shape[0] / parts) * parts
    return rows * math.prod(tensor.shape[1:]) * tensor.element_size()


def _fsdp_layout(tensor: Any) -> str | None:
    """``"fsdp"`` for a DTensor sharded along dim 0 over a 1-D mesh, ``"hsdp"`` for one replicated over the first
    dimension of a 2-D mesh and sharded along dim 0 over the second; ``None`` for any other layout (or an empty one)."""
    from torch.distributed.tensor import Replicate, Shard

    if tensor.ndim == 0 or tensor.shape[0] == 0:
        return None
    placements = tuple(tensor.placements)
    if placements == (Shard(0),):
        return "fsdp"
    if placements == (Replicate(), Shard(0)):
        return "hsdp"
    return None


def _drain(local: Tensor, group: Any, world: int) -> None:
    """Receive every other rank's piece (shaped like ``local``) into one scratch piece, one after another."""
    scratch = torch.empty_like(local)  # never `local` itself: it may be the live parameter's storage
    for r in range(1, world):
        dist.recv(scratch, src=dist.get_global_rank(group, r), group=group)
