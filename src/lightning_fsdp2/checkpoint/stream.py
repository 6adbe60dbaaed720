"""A full checkpoint written as its tensors arrive: rank 0 never holds more than one whole tensor.

``torch.save`` needs the whole object in memory before it writes a byte: for a full checkpoint that is every
parameter and every optimizer state of the model in rank 0's CPU memory (the classic FSDP "rank 0 runs out of memory
on save"). The file format does not need that. A ``torch.save`` file is a zip archive with one record per storage
(``data/<key>``) and the pickled object (``data.pkl``) that refers to storages only by key; records may come in any
order. So :func:`save_streamed` gathers one sharded tensor to rank 0 (``shards.gather_tensor_into``), writes it as its
record with torch's own zip writer (``torch._C.PyTorchFileWriter``, what ``torch.save`` uses), frees it, and goes on
to the next; ``data.pkl`` comes last, pickled with the same conventions as ``torch.save`` (``_rebuild_tensor_v2`` over
typed storages, protocol 2). The result is a file of the same format as ``torch.save``'s (records in another order):
``torch.load`` (``weights_only=True``, ``mmap=True``) and a single-device ``Trainer`` read it.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fsdp2.checkpoint.files import (
    check_replaceable,
    on_rank0,
    raise_together,
    replace,
    temporary_path,
    write_error,
)
from lightning_fsdp2.checkpoint.shards import drain_tensor, gather_tensor_into, receive_bytes

GATHERED_KEYS = ("state_dict", "optimizer_states")
"""The parts of a Lightning checkpoint that hold sharded tensors (the same structure on every rank)."""


def sharded_entries(checkpoint: Mapping[str, Any]) -> list[str]:
    """Keys of ``checkpoint`` besides ``state_dict`` and ``optimizer_states`` whose values hold ``DTensor`` shards
    (callbacks' state dicts of sharded tensors, such as weight averaging's ``current_model_state``): saved like the
    model's state, gathered or sharded, never pickled as they are."""
    from torch.distributed.tensor import DTensor

    def holds(value: Any) -> bool:
        if isinstance(value, DTensor):
            return True
        if isinstance(value, Mapping):
            return any(holds(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(holds(v) for v in value)
        return False

    return [k for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states") and holds(v)]


def save_streamed(
    checkpoint: Mapping[str, Any], path: str | os.PathLike, tied: Mapping[str, Mapping[str, str]] | None = None
) -> None:
    """Write ``checkpoint`` to ``path`` as one ``torch.save`` file; call on every rank.

    ``checkpoint["state_dict"]``, ``checkpoint["optimizer_states"]`` and any other entry holding ``DTensor`` shards
    (the same structure on every rank; a Fabric checkpoint's modules and optimizers) are gathered whole to rank 0 one
    tensor at a time, each written at once. Everything else is written from rank 0's dict. ``tied`` maps an entry (a
    model's state dict: ``"state_dict"``, or Fabric's ``"model"``) to its keys of tied weights and the key each shares a
    tensor with: sent and written once, one storage in the file, as a single-device save has it.

    The file is written under a temporary name and renamed into place when complete. Refuses (on every rank, before
    any work) to replace anything at ``path`` that is not a previous checkpoint. A failure on rank 0 (a full disk)
    does not stop the other ranks halfway: the gather runs to the end, then every rank raises.
    """
    path = Path(path)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0

    def prepare() -> None:
        check_replaceable(path)
        path.parent.mkdir(parents=True, exist_ok=True)

    on_rank0(prepare, f"save to {path}")
    # From here on every rank walks the same structure to the end, whatever happens on rank 0: a rank that stopped
    # sending or receiving halfway would leave the others waiting forever. Rank 0's writer records its first error.
    entries = sharded_entries(checkpoint)  # other parts holding shards (a callback's state dict)
    writer = _Writer(path, list(_tensors(checkpoint))) if rank0 else None
    error: BaseException | None = None
    try:
        parts = {}
        for key, value in checkpoint.items():
            if tied and key in tied and isinstance(value, Mapping):
                parts[key] = _stream_state_dict(value, writer, tied[key])
            elif key in GATHERED_KEYS or key in entries:
                parts[key] = _stream(value, writer)
            else:
                parts[key] = value
        if writer is not None:
            writer.finish(parts)
    except BaseException as err:  # noqa: BLE001 - every rank hears about it below
        error = err
    finally:
        if writer is not None:
            writer.discard()
    raise_together(error, f"write the checkpoint {path}")


def _stream_state_dict(state: Mapping[str, Any], writer: _Writer | None, same_as: Mapping[str, str]) -> dict:
    written = {k: _stream(v, writer) for k, v in state.items() if k not in same_as}
    return {k: written[same_as[k]] if k in same_as else written[k] for k in state}


def _stream(value: Any, writer: _Writer | None) -> Any:
    """Walk a nested structure in order: every ``DTensor`` is gathered (a collective) and, on rank 0, written."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if writer is None or writer.error is not None:
            # Not rank 0 (it sends), or rank 0 failed earlier: keep receiving (and dropping) what the others send.
            drain_tensor(value)
            return None
        try:
            return writer.add(gather_tensor_into(value, writer.scratch_for(value)))
        except Exception as err:  # noqa: BLE001 - e.g. out of memory for this tensor; raised after the walk
            writer.error = err
            return None
    if isinstance(value, Tensor) and writer is not None:
        return value.detach().cpu()  # a plain tensor (a buffer, Adam's step): the file holds CPU tensors only
    if isinstance(value, Mapping):
        return {k: _stream(v, writer) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_stream(v, writer) for v in value)
    return value


def _tensors(value: Any) -> Any:
    """Every tensor in a nested structure."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class _StorageRef:
    """A storage already written to the archive: pickled as the persistent id ``torch.save`` gives a storage."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int, nbytes: int) -> None:
        self.key, self.dtype, self.numel, self.nbytes = key, dtype, numel, nbytes


class _Written:
    """Stands in for a tensor whose data is already in the archive; unpickles as that (plain, CPU) tensor."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: Any) -> tuple:
        stride, step = [], 1
        for size in reversed(self.shape):
            stride.insert(0, step)
            step *= max(size, 1)
        # What Tensor.__reduce_ex__ gives a contiguous CPU tensor (no grad, no hooks): v3, which names the dtype, for
        # the dtypes that have no legacy typed storage (float8, uint16...), v2 over a typed storage for the others.
        args = (self.storage, 0, self.shape, tuple(stride), False, OrderedDict())
        if self.storage.dtype in torch.storage._new_dtypes():
            return torch._utils._rebuild_tensor_v3, (*args, self.storage.dtype)
        return torch._utils._rebuild_tensor_v2, args


class _Writer:
    """Rank 0's side: torch's zip writer on a temporary file, one record per storage, ``data.pkl`` at the end.

    The first failed write is kept in ``error`` and later writes are skipped, so that rank 0 keeps receiving the
    tensors the other ranks send; :meth:`finish` raises it.
    """

    def __init__(self, path: Path, tensors: list[Tensor]) -> None:
        from torch.serialization import get_crc32_options

        self.path, self.tmp = path, temporary_path(path)
        self.needed = sum(t.numel() * t.element_size() for t in tensors)  # whole sizes of shards: for a disk-full error
        self.largest = max((receive_bytes(t) for t in tensors), default=0)  # the one receive buffer's size
        self.keys: dict[int, str] = {}  # storage._cdata -> record key: each storage once, as torch.save does
        self.count = 0
        self.error: BaseException | None = None
        self.scratch: Tensor | None = None
        self.file: Any = None
        try:
            self.file = _File(open(self.tmp, "wb"))  # noqa: SIM115 - closed in finish/discard
            self.zip = torch._C.PyTorchFileWriter(self.file, get_crc32_options(), _storage_alignment())
        except Exception as err:  # noqa: BLE001
            self.error = self._describe(err)

    def scratch_for(self, tensor: Tensor) -> Tensor | None:
        """One receive buffer for every tensor, as large as the largest: each is written out before the next arrives,
        and a single block keeps rank 0's memory at one tensor exactly (allocating and freeing a buffer per tensor
        lets the allocator's heap grow)."""
        needed = receive_bytes(tensor)
        if needed and (self.scratch is None or self.scratch.numel() < needed):
            device = tensor.device_mesh.device_type  # type: ignore[attr-defined]
            self.scratch = None  # the old block goes first
            self.scratch = torch.empty(max(needed, self.largest), dtype=torch.uint8, device=device)
        return self.scratch

    def add(self, whole: Tensor) -> _Written:
        """Write a whole CPU tensor as the next record; keep only its description."""
        if not whole.is_contiguous() or whole.storage_offset() != 0:
            whole = whole.contiguous().clone()  # the record is the storage's first bytes, in row-major order
        key = self._next_key()
        nbytes = whole.numel() * whole.element_size()
        self._write(f"data/{key}", whole.untyped_storage(), nbytes)
        return _Written(_StorageRef(key, whole.dtype, whole.numel(), nbytes), tuple(whole.shape))

    def finish(self, parts: Mapping[str, Any]) -> None:
        """Pickle the checkpoint (rank 0's own tensors are written as records now), close the archive, rename."""
        buffer = io.BytesIO()
        _Pickler(buffer, self).dump(dict(parts))
        data = buffer.getvalue()
        self._write("data.pkl", data, len(data))
        alignment = str(_storage_alignment())
        self._write(".storage_alignment", alignment, len(alignment))
        self._write("byteorder", sys.byteorder, len(sys.byteorder))
        # No ".format_version" record, deliberately: with it, torch.load may compute record offsets assuming
        # torch.save's order (data.pkl first, then the storages in key order), which this file does not have. Without
        # it, torch.load looks each record up in the archive's directory.
        if self.error is None:
            try:
                self.zip.write_end_of_file()
                self.file.flush()
                if self.file.error is None:
                    os.fsync(self.file.fileno())
            except Exception as err:  # noqa: BLE001
                self.error = self._describe(err)
            if self.file.error is not None:
                self.error = self._describe(self.file.error)
        if self.error is not None:
            raise self.error
        self.zip = None
        self.file.close()
        replace(self.tmp, self.path)

    def discard(self) -> None:
        """Close and delete the temporary file if it is still there (after a failure, or after the rename)."""
        if self.file is not None and not self.file.closed:
            if self.file.error is None:
                self.file.error = OSError("discarded")  # the zip writer's destructor finishes the archive: into nothing
            self.zip = None
            self.file.close()
        self.tmp.unlink(missing_ok=True)

    def _describe(self, err: BaseException) -> BaseException:
        return write_error(err, self.tmp, what=str(self.path), needed=self.needed)

    def _next_key(self) -> str:
        key, self.count = str(self.count), self.count + 1
        return key

    def _write(self, name: str, data: Any, nbytes: int) -> None:
        if self.error is not None:
            return
        try:
            self.zip.write_record(name, data, nbytes)
        except Exception as err:  # noqa: BLE001
            self.error = self._describe(err)
        if self.file.error is not None:
            self.error = self._describe(self.file.error)

    def persistent_id(self, obj: Any) -> tuple | None:
        """``torch.save``'s persistent ids: storages become ``("storage", type, key, location, numel)``."""
        if isinstance(obj, _StorageRef):
            if obj.dtype in torch.storage._new_dtypes():
                return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.nbytes)
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        if isinstance(obj, torch.storage.TypedStorage):
            storage, storage_type, numel = obj._untyped_storage, _storage_type(obj.dtype), obj._size()
        elif isinstance(obj, torch.UntypedStorage):
            storage, storage_type, numel = obj, torch.UntypedStorage, obj.nbytes()
        else:
            return None
        key = self.keys.get(storage._cdata)
        if key is None:
            key = self.keys[storage._cdata] = self._next_key()
            data = storage if storage.device.type == "cpu" else storage.cpu()
            self._write(f"data/{key}", data, storage.nbytes())
        # Always "cpu": the bytes were written from CPU memory, and a CPU-only machine must be able to read the file
        # (the gathered tensors are CPU tensors too).
        return ("storage", storage_type, key, "cpu", numel)


class _File:
    """The file the zip writer writes to. A failed write is kept in ``error`` and reported as done, and later writes
    are dropped: torch's zip writer cannot recover from a short write (and finishing the archive in its destructor
    would then abort the process), so it is never told; the caller raises ``error`` instead."""

    def __init__(self, file: io.BufferedWriter) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.error is None:
            try:
                self._file.write(data)
            except OSError as err:
                self.error = err
        return size

    def flush(self) -> None:
        if self.error is None:
            try:
                self._file.flush()
            except OSError as err:
                self.error = err

    def fileno(self) -> int:
        return self._file.fileno()

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # flushing what is buffered fails as the write did (a full disk), which is already reported


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, writer: _Writer) -> None:
        super().__init__(file, protocol=2)  # torch.save's default protocol
        self._writer = writer

    def persistent_id(self, obj: Any) -> Any:
        return self._writer.persistent_id(obj)


def _storage_type(dtype: torch.dtype) -> Any:
    """The legacy typed-storage class (``torch.FloatStorage``...) that ``torch.load`` reads a dtype from."""
    return getattr(torch, torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)._pickle_storage_type())


def _storage_alignment() -> int:
    try:
        from torch.utils.serialization import config

        return int(config.save.storage_alignment)
    except (ImportError, AttributeError):
        return 64
