"""Checksums: computed while a checkpoint is written, verified before anything of it is loaded.

Storage and network file systems do flip bits, and neither ``torch.load``, DCP nor safetensors notice: a resume would
train on from the corrupted value. Both of our formats carry a CRC-32 of every piece of data, computed from the bytes
as they are written (no second read):

- ``"full"``: a ``torch.save`` file is a zip archive, and torch's writer (``torch.save``'s and ours,
  :mod:`.stream`) stores each record's CRC-32 in the archive's directory, as the zip format has it. Nothing reads it
  back: ``torch.load`` does not (``mmap=True`` maps the bytes straight into tensors). Verifying reads each record
  once and compares.
- ``"sharded"``: DCP writes no checksums, so :class:`ChecksummedWriter` (DCP's own ``FileSystemWriter``, its files
  seen through :class:`_Digesting`) computes one CRC-32 per item (a tensor shard, or a pickled object) as DCP writes
  it, and each rank writes those of its own files beside them (``__<rank>_crc32.json``).

Verification splits the files (or archive records) over the ranks, each reading its share once, so a resume reads
the checkpoint's bytes one more time in all, in parallel; then every rank learns every mismatch and all raise
together, naming the file, the tensor and the rank that found it, before anything is loaded into the model. A
checkpoint without checksums (written by someone else: Lightning's ``ModelParallelStrategy``, a DCP directory of your
own, a ``torch.save`` file written with ``compute_crc32`` off) loads as before. CRC-32 (zlib's, 2-3 GB/s per core
here) detects every burst of up to 32 flipped bits and other damage with probability 1 - 2^-32; it is not a
defence against deliberate tampering (that takes a signature).
"""

from __future__ import annotations

import json
import os
import threading
import zipfile
import zlib
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_fsdp2.checkpoint.files import META_FILENAME, CheckpointFileError
from lightning_fsdp2.checkpoint.safe_dcp import read_dcp_metadata

SIDECAR = "crc32.json"
"""A rank's checksums, beside its DCP files: ``__<rank>_crc32.json`` (DCP names its files ``__<rank>_<n>.distcp``)."""

CHUNK = 16 << 20  # bytes read at a time while verifying


# ------------------------------------------------------------------------------------------------- writing
class _Digesting:
    """A file being written by DCP, passed through; every ``tell()`` (DCP asks before and after each item) starts a
    new block, whose CRC-32 the writes that follow update."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.blocks: list[list[int]] = []  # [offset, length, crc32]

    def tell(self) -> int:
        offset = self._stream.tell()
        if self.blocks is None:
            return offset
        if not self.blocks or self.blocks[-1][1]:  # a new block, unless the last one is still empty
            self.blocks.append([offset, 0, 0])
        else:
            self.blocks[-1][0] = offset
        return offset

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.blocks is None:
            return self._stream.write(view)
        if not self.blocks:
            self.blocks.append([self._stream.tell(), 0, 0])
        block = self.blocks[-1]
        block[1] += len(view)
        block[2] = zlib.crc32(view, block[2])
        return self._stream.write(view)

    def seek(self, *args: Any) -> int:
        self.blocks = None  # type: ignore[assignment] # a writer that goes back: no checksums for this file
        return self._stream.seek(*args)

    def truncate(self, *args: Any) -> int:
        self.blocks = None  # type: ignore[assignment]
        return self._stream.truncate(*args)

    def __getattr__(self, name: str) -> Any:  # fileno, flush, close, writable...: the file's own
        return getattr(self._stream, name)


class _DigestingFileSystem(FileSystem):
    """DCP's local file system, whose files opened for writing are :class:`_Digesting` ones."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, list[list[int]]] = {}  # file name -> its blocks
        self._lock = threading.Lock()  # DCP writes several files at once from its threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            digesting = _Digesting(stream)
            yield digesting
        if digesting.blocks is not None:
            with self._lock:
                self.digests[Path(path).name] = [b for b in digesting.blocks if b[1]]


class ChecksummedWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that also writes this rank's checksums, computed as its files are written."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _DigestingFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        written.wait()  # DCP's local writer has finished its files when it returns (a torch Future, already set)
        files = {name: blocks for name, blocks in self.fs.digests.items() if name.startswith(plan.storage_data.prefix)}
        sidecar = Path(self.path) / f"{plan.storage_data.prefix}{SIDECAR}"
        with open(sidecar, "w") as f:
            json.dump({"algorithm": "crc32", "save_id": self.save_id, "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
        return written


# ------------------------------------------------------------------------------------------------ verifying
def verify(path: str | os.PathLike, *, together: bool) -> None:
    """Verify the checksums of the checkpoint at ``path`` (a full checkpoint file or a sharded directory); raise a
    :class:`CheckpointFileError` naming each damaged file, tensor and the rank that found it. ``together``: every
    rank calls this, each verifying a share; all raise alike. A checkpoint without checksums passes."""
    path = Path(path)
    rank, world = (dist.get_rank(), dist.get_world_size()) if together and dist.is_initialized() else (0, 1)
    if path.is_dir():
        pieces = _sharded_pieces(path) + _archive_pieces(path / META_FILENAME)  # meta.pt: a torch.save archive
    elif path.is_file() and zipfile.is_zipfile(path):
        pieces = _archive_pieces(path)
    else:
        return
    found = []
    for check in _shares(pieces, world)[rank][1]:
        try:  # whatever this rank meets, the others hear of it in the gather below (none waits for it)
            found += check()
        except Exception as err:  # noqa: BLE001
            found.append(f"{type(err).__name__}: {err}")
    everyone = [found]
    if world > 1:
        everyone = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(everyone, found)
    problems = [f"{p} (found by rank {r})" for r, found in enumerate(everyone) for p in found]
    if problems:
        raise CheckpointFileError(
            f"The checkpoint {path} is damaged: its data does not match the checksums written with it: "
            + "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
            + ". Nothing was loaded. Restore it from a copy, or resume from another checkpoint (the storage may be"
            " failing); to load it anyway, turn verification off (FSDP2Strategy(verify_checkpoints=False);"
            " lightning-fsdp2-convert --no-verify; read_full_checkpoint(..., verify=False))."
        )


Check = Callable[[], list[str]]


def _shares(pieces: list[tuple[int, Check]], world: int) -> list[tuple[int, list[Check]]]:
    """The pieces split over ``world`` ranks, largest first to the least loaded (the same split on every rank)."""
    loads, shares = [0] * world, [[] for _ in range(world)]  # type: ignore[var-annotated]
    for size, check in sorted(pieces, key=lambda p: -p[0]):
        i = min(range(world), key=loads.__getitem__)
        loads[i] += size
        shares[i].append(check)
    return list(zip(loads, shares))


def _archive_pieces(path: Path) -> list[tuple[int, Check]]:
    """A ``torch.save`` archive's records, each checked against the CRC-32 in the archive's directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError):
        return []  # not readable as an archive: torch.load names the damage
    if not any(info.CRC for info in infos):
        return []  # written without CRC-32s (torch's compute_crc32 off)
    opened: dict[str, Any] = {}  # this rank's one open archive, and the records' names once one is damaged

    def check(info: zipfile.ZipInfo) -> list[str]:
        try:
            if "archive" not in opened:
                opened["archive"] = zipfile.ZipFile(path)
            with opened["archive"].open(info) as record:
                while record.read(CHUNK):
                    pass
        except Exception as err:  # noqa: BLE001 - a bad CRC-32, or damage zipfile meets first (EOF, I/O error)
            if "names" not in opened:
                opened["names"] = _record_names(path)
            what = opened["names"].get(info.filename, "not a tensor")
            said = "" if isinstance(err, zipfile.BadZipFile) and "CRC" in str(err) else f"; {type(err).__name__}: {err}"
            return [f"{path.name}: record {info.filename!r} ({what}{said})"]
        return []

    return [(info.file_size, lambda info=info: check(info)) for info in infos]


def _record_names(path: Path) -> dict[str, str]:
    """Archive record name -> the checkpoint entries whose tensors it holds (``state_dict.layer.weight``), read from
    the pickle without rebuilding any tensor (only on a mismatch, for the message)."""
    import torch
    from torch import _weights_only_unpickler

    try:
        with zipfile.ZipFile(path) as archive:
            pickled = next(n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            prefix = pickled[: -len("data.pkl")]
            storages: dict[int, str] = {}

            def persistent_load(saved_id: Any) -> Any:
                _, storage_type, key, _, numel = saved_id
                dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
                untyped = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
                storages[untyped._cdata] = f"{prefix}data/{key}"
                return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

            with archive.open(pickled) as f:
                unpickler = _weights_only_unpickler.Unpickler(f, encoding="utf-8")
                unpickler.persistent_load = persistent_load  # type: ignore[assignment]
                obj = unpickler.load()
    except Exception:  # noqa: BLE001 - the names are a courtesy: a damaged pickle is named by its record
        return {}
    names: dict[str, list[str]] = {}

    def walk(value: Any, name: str) -> None:
        if isinstance(value, torch.Tensor):
            names.setdefault(storages.get(value.untyped_storage()._cdata, "?"), []).append(name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}.{i}" if name else str(i))

    walk(obj, "")
    return {record: "tensor " + ", ".join(repr(n) for n in entries[:3]) for record, entries in names.items()}


def _sharded_pieces(path: Path) -> list[tuple[int, Check]]:
    """A sharded checkpoint's files, each block checked against the CRC-32 its rank wrote beside it."""
    digests: dict[str, list[list[int]]] = {}
    unreadable: list[tuple[int, Check]] = []
    try:
        save_id = getattr(read_dcp_metadata(path).storage_meta, "save_id", None)
    except Exception:  # noqa: BLE001 - the index is checked (and named) by the load itself
        save_id = None
    for sidecar in sorted(path.glob(f"__*_{SIDECAR}")):
        try:
            written = json.loads(sidecar.read_text())
            if save_id is not None and written.get("save_id") not in (None, save_id):
                continue  # left by an earlier save into this directory (another writer overwrote it in place)
            digests.update(written["files"])
        except Exception as err:  # noqa: BLE001 - reported by one rank, like a mismatch
            unreadable.append((0, lambda s=sidecar, e=err: [f"the checksum file {s.name!r} is unreadable ({e})"]))

    def check(name: str, blocks: list[list[int]]) -> list[str]:
        bad = []
        try:
            with open(path / name, "rb") as f:
                for offset, length, crc in blocks:
                    f.seek(offset)
                    value, left = 0, length
                    while left:
                        data = f.read(min(CHUNK, left))
                        if not data:
                            break
                        value, left = zlib.crc32(data, value), left - len(data)
                    if left or value != crc:
                        bad.append(offset)
        except OSError as err:
            return [f"file {name!r} could not be read ({err})"]
        if not bad:
            return []
        tensors = _items_at(path, name, bad)
        return [f"file {name!r}, {tensors}"]

    return unreadable + [(sum(b[1] for b in blocks), lambda n=name, b=blocks: check(n, b))
                         for name, blocks in digests.items()]


def _items_at(path: Path, name: str, offsets: list[int]) -> str:
    """The entries (``state_dict.layer.weight``) DCP wrote at ``offsets`` of file ``name``, from its index."""
    try:
        metadata = read_dcp_metadata(path)
        found = [index.fqn for index, info in (metadata.storage_data or {}).items()
                 if info.relative_path == name and info.offset in offsets]
    except Exception:  # noqa: BLE001 - the names are a courtesy
        found = []
    if not found:
        return f"at byte(s) {offsets[:5]}"
    return "tensor " + ", ".join(repr(n) for n in sorted(set(found))[:5])
