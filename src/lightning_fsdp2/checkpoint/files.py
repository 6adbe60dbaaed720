"""Reading and writing checkpoint files safely: ``weights_only`` reads, atomic writes, errors that name the file."""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

META_FILENAME = "meta.pt"  # a sharded checkpoint's non-tensor part; the name Lightning's ModelParallelStrategy uses
FORMAT_KEY = "lightning_fsdp2"  # what we add to a checkpoint that is not a plain single-device one


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, or does not fit the model. The message names the file or the tensors."""


def is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on the local file system (not ``s3://...`` and the like)."""
    return "://" not in str(path) or str(path).startswith("file://")


@contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """Turn a failure to parse a file into a :class:`CheckpointError` that names it."""
    try:
        yield
    except (CheckpointError, FileNotFoundError):
        raise
    except Exception as err:
        raise CheckpointError(
            f"Could not read {path}: {type(err).__name__}: {err}. The file may be truncated or corrupt (for"
            " example by an interrupted download or copy); replace it."
        ) from err


def load_torch_file(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """``torch.load`` a file memory-mapped and with ``weights_only`` (no arbitrary unpickling), naming it on failure.

    ``mmap=True`` leaves tensors on disk until something reads them, so a rank that copies out only its shard's
    slices reads only those bytes. Files in the legacy (pre-zip) format cannot be mapped and are read whole.
    """
    path = Path(path)
    if not path.is_file():
        raise missing_checkpoint(path)
    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if "weights_only" not in str(err) and "Weights only" not in str(err):
            raise CheckpointError(f"Could not read {path}: {err}. The file may be truncated or corrupt.") from err
        raise CheckpointError(
            f"{path} contains objects that `torch.load(weights_only=True)` refuses to unpickle: {err}. If you trust"
            " the file, allow the named classes with `torch.serialization.add_safe_globals([...])`, or pass"
            " `trainer.fit(..., weights_only=False)`."
        ) from err
    except Exception as err:
        raise CheckpointError(
            f"Could not read {path}: {type(err).__name__}: {err}. The file may be truncated or corrupt (for example"
            " a partial copy); replace it."
        ) from err


def missing_checkpoint(path: Path) -> FileNotFoundError:
    """The error for a checkpoint that is not there, pointing at a previous one a crashed save left aside."""
    aside = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
    hint = f" A save was interrupted while swapping it in; the previous checkpoint is at {aside[-1]}." if aside else ""
    return FileNotFoundError(f"No checkpoint at {path}.{hint}")


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it into place.

    A crash before the rename leaves the old file (if any) untouched; the rename itself is atomic on POSIX file
    systems. A sharded checkpoint that was at ``path`` is removed after the new file is in place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def replace(new: Path, path: Path) -> None:
    """Move ``new`` (file or directory) to ``path``, replacing what was there with as small a window as possible.

    A file over a file is one atomic ``os.replace``. A directory cannot be renamed over a non-empty one, so the old
    one is first renamed aside (``.<name>.old-*``) and deleted only once the new one is in place; a crash between
    the two renames leaves it there, and :func:`missing_checkpoint` points at it.
    """
    if new.is_dir():  # files written by other libraries (DCP, peft, transformers) are not fsynced by them
        for file in sorted(new.rglob("*")):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(new)
    if path.is_dir() or (new.is_dir() and path.exists()):
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        os.replace(new, path)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(new, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint file or sharded directory."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def on_rank0(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 only; then every rank learns whether it worked, and all raise if it did not.

    Without this, an error on rank 0 (a full disk, an unpicklable hyper-parameter) would leave the other ranks
    waiting forever in the next collective.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    error: BaseException | None = None
    if rank0:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = err
    outcome = [None if error is None else f"{type(error).__name__}: {error}"]
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        raise CheckpointError(f"Rank 0 failed to {what}: {outcome[0]}")


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written with ``state_dict_type="sharded"``."""
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / ".metadata").is_file()


def check_sharded_files(path: Path) -> Any:
    """Read a sharded checkpoint's index and check every file it points to is there and long enough.

    ``torch.distributed.checkpoint`` reports a short file deep inside a collective; checking sizes first names
    the file, on every rank, before any rank starts to load. Returns the index (DCP ``Metadata``).
    """
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint: it has no '.metadata' file.")
    with reading(path / ".metadata"):
        metadata = FileSystemReader(str(path)).read_metadata()
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        file = path / name
        have = file.stat().st_size if file.is_file() else -1
        if have < size:
            state = "is missing" if have < 0 else f"has {have} bytes but its index needs {size}"
            raise CheckpointError(f"The sharded checkpoint file {file} {state}: it is truncated or incomplete.")
    return metadata
