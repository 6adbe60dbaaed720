"""Reading ``torch.distributed.checkpoint`` (DCP) directories without unpickling code.

DCP keeps a sharded checkpoint's index (``.metadata``) as a plain pickle, which torch's ``FileSystemReader`` reads
with ``pickle.load``, and it stores non-tensor items (an optimizer's ``param_groups`` values, for example) as
``torch.save`` blobs that its load planners read with ``torch.load(weights_only=False)``. Either way a crafted
checkpoint would run code as soon as it is loaded. Here the index is read through an unpickler that allows only
the classes DCP itself writes into it, non-tensor items with ``weights_only=True``, and every file the index points
to must lie inside the checkpoint directory.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from lightning_fsdp2.checkpoint.files import CheckpointFileError, reading

# Every global a DCP index refers to, found by logging `find_class` while reading the indexes DCP writes for a
# model and an AdamW state (plain and FSDP2-sharded, several dtypes). Torch dtypes are allowed by type below.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorStorageMetadata,
            BytesStorageMetadata,
            ChunkStorageMetadata,
            TensorProperties,
            _MEM_FORMAT_ENCODING,
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # how a torch.layout pickles
    # `StorageMeta.checkpoint_id` is the path DCP saved to; Python 3.13+ pickles paths from `pathlib._local`.
    **{
        (module, cls.__name__): cls
        for module in ("pathlib", "pathlib._local")
        for cls in (pathlib.PosixPath, pathlib.WindowsPath)
    },
}


class _IndexUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild a DCP index and nothing else: any other global is refused."""

    def __init__(self, file: Any, origin: Path) -> None:
        super().__init__(file)
        self.origin = origin

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        # torch.__dict__, not getattr: torch's module __getattr__ would import lazy submodules for unknown names.
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):
            return torch.__dict__[name]
        raise CheckpointFileError(
            f"{self.origin} refers to `{module}.{name}`, which is not part of a checkpoint index torch writes: the"
            " file is not a DCP index written by torch and may be malicious. Refusing to unpickle it."
        )


def read_dcp_metadata(path: Path, name: str = ".metadata") -> Metadata:
    """Read the index (``path / name``) of the DCP checkpoint ``path`` without running code from it.

    Raises :class:`CheckpointFileError` naming the file if it refers to anything but DCP's own index classes, cannot be
    parsed, or points at a file outside ``path``.
    """
    path = Path(path)
    file = path / name
    with reading(file), open(file, "rb") as f:
        metadata = _IndexUnpickler(f, file).load()
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointFileError(f"{file} is not a checkpoint index: it holds a {type(metadata).__name__}.")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    storage = metadata.storage_data
    if storage is not None and not isinstance(storage, dict):
        raise CheckpointFileError(f"{file} is not a checkpoint index: its storage data is a {type(storage).__name__}.")
    root = Path(os.path.realpath(path))
    for index, info in (storage or {}).items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _is_inside(root, relative):
            raise CheckpointFileError(
                f"{file} points {getattr(index, 'fqn', index)!r} at {relative!r}, which is not a file inside {path}:"
                " the index may be malicious. Refusing to read it."
            )
    return metadata


def _is_inside(root: Path, relative: Any) -> bool:
    """Whether ``relative`` is a plain relative path (no ``..``) naming something strictly below ``root``. Checked
    lexically: a file that is a symbolic link, as in the Hugging Face cache, may point elsewhere."""
    if not isinstance(relative, str) or not relative or os.path.isabs(relative) or ".." in Path(relative).parts:
        return False
    target = Path(os.path.normpath(root / relative))
    return target != root and target.is_relative_to(root)


class SafeFileSystemReader(FileSystemReader):
    """A DCP ``FileSystemReader`` that reads the index with :func:`read_dcp_metadata` instead of ``pickle.load``."""

    refused: CheckpointFileError | None = None  # set when the index was refused: DCP hides the error in its own

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        try:
            metadata = read_dcp_metadata(Path(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        except CheckpointFileError as err:
            self.refused = self.refused or err
            raise
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyBytes:
    """``load_bytes`` as in torch's ``DefaultLoadPlanner``, but with ``torch.load(weights_only=True)``."""

    flatten_state_dict: bool
    original_state_dict: dict[str, Any]
    state_dict: dict[str, Any]
    mappings: dict[str, Any]

    def __init__(self, *args: Any, origin: str = "the checkpoint", **kwargs: Any) -> None:
        self.origin = origin
        super().__init__(*args, **kwargs)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            if "weights_only" not in str(err) and "Weights only" not in str(err):
                raise CheckpointFileError(f"Could not read {fqn!r} from {self.origin}: {err}. It may be corrupt.") from err
            # torch's message ends by suggesting weights_only=False, which does not apply here: say so last.
            raise CheckpointFileError(
                f"{fqn!r} in {self.origin} holds objects that `torch.load(weights_only=True)` refuses to unpickle:"
                f" {err}\nThe checkpoint may be malicious. Items of a sharded checkpoint are always read with"
                " weights_only=True, whatever `trainer.fit(..., weights_only=...)` says: only a checkpoint whose"
                " non-tensor items are plain data (numbers, strings, lists, dicts) can be loaded."
            ) from err
        except Exception as err:
            raise CheckpointFileError(
                f"Could not read {fqn!r} from {self.origin}: {type(err).__name__}: {err}. It may be corrupt."
            ) from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` with non-tensor items read with ``weights_only=True``."""


class SafeEmptyStateDictLoadPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """torch's ``_EmptyStateDictLoadPlanner`` (which loads everything) with non-tensor items read ``weights_only``."""


@contextmanager
def checkpoint_errors(reader: SafeFileSystemReader) -> Iterator[None]:
    """Re-raise, as itself, a :class:`CheckpointFileError` that a DCP load wrapped in its own exceptions."""
    try:
        yield
    except (Exception, CheckpointException) as err:
        found = reader.refused
        if found is None and isinstance(err, CheckpointException):
            found = next((e for e, _ in err.failures.values() if isinstance(e, CheckpointFileError)), None)
        if found is None or found is err:
            raise
        raise CheckpointFileError(str(found)) from err


def load(state_dict: dict[str, Any], path: Path) -> None:
    """``dcp.load`` of ``state_dict`` from the DCP checkpoint ``path`` through the safe reader and planner."""
    import torch.distributed.checkpoint as dcp

    reader = SafeFileSystemReader(path)
    with checkpoint_errors(reader):
        dcp.load(state_dict, checkpoint_id=path, storage_reader=reader, planner=SafeLoadPlanner(origin=str(path)))


def check_sharded_files(path: Path) -> Any:
    """Read a sharded checkpoint's index and check every file it points to is there and long enough.

    ``torch.distributed.checkpoint`` reports a short file deep inside a collective; checking sizes first names
    the file, on every rank, before any rank starts to load. Returns the index (DCP ``Metadata``).
    """
    # Not torch's reader, which `pickle.load`s the index: this one unpickles DCP's own index classes and nothing else.
    if not (path / ".metadata").is_file():
        raise CheckpointFileError(f"{path} is not a sharded checkpoint: it has no '.metadata' file.")
    metadata = read_dcp_metadata(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        file = path / name
        have = file.stat().st_size if file.is_file() else -1
        if have < size:
            state = "is missing" if have < 0 else f"has {have} bytes but its index needs {size}"
            raise CheckpointFileError(f"The sharded checkpoint file {file} {state}: it is truncated or incomplete.")
    return metadata
