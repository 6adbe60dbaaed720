"""Checksums: written with every checkpoint (by torch, as it writes the bytes), verified before anything of it is
loaded.

Storage and network file systems do flip bits, and neither ``torch.load``, DCP nor safetensors notice: a resume would
train on from the corrupted value. Yet both of our formats already carry a CRC-32 of every tensor's bytes, computed
by torch while it writes them: a ``torch.save`` archive is a zip file whose directory holds each record's CRC-32
(``torch.utils.serialization.config.save.compute_crc32``, on by default), and

- ``"full"``: the file is such an archive (``torch.save``'s, or ours, :mod:`.stream`, written with torch's zip writer);
- ``"sharded"`` (and ``async_save``): DCP writes each tensor shard as a ``torch.save`` archive inside its ``.distcp``
  file (its default ``TORCH_SAVE`` format), at the offset its index (``.metadata``) gives; and ``meta.pt`` is one.

Nothing reads these CRC-32s back (``torch.load(mmap=True)`` maps the bytes straight into tensors). Here every record
is read once and compared, before the load: the records are split over the ranks, each reading its share (the
CRC-32 of a chunk computed on a helper thread while the next is read), so a resume reads the checkpoint's bytes one
more time in all, in parallel; then every rank learns every mismatch and all raise together, naming the file, the
tensor and the rank that found it. Writing costs nothing more than torch already does.

safetensors has no checksum of its own. The safetensors files we write (the converter's Hugging Face directory,
``lora.save_adapter``'s adapter) record each tensor's CRC-32 in their header's metadata (:data:`CRC_KEY`; a converter
export split into several files, in its index's metadata), computed from memory before the write;
``load_pretrained`` and ``lora.load_adapter`` verify them the same way before reading. Not covered: a sharded
checkpoint's non-tensor items (DCP pickles them raw: an optimizer's ``param_groups``), checkpoints written with
``compute_crc32`` off, ``lora.save_merged``'s files (transformers writes them), and files written by others: they
load as before. CRC-32 (zlib's) detects every burst of up to 32 flipped bits and other damage with
probability 1 - 2^-32; it is no defence against deliberate tampering (that takes a signature).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fsdp2.checkpoint.files import META_FILENAME, CheckpointFileError
from lightning_fsdp2.checkpoint.safe_dcp import read_dcp_metadata

CHUNK = 16 << 20  # bytes read at a time while verifying

Check = Callable[[], list[str]]

_executor: ThreadPoolExecutor | None = None
_opened: list[Any] = []  # files opened by this rank's checks, closed when its verification ends


def _open(path: Path, opener: Callable[[Path], Any] = lambda p: open(p, "rb")) -> Any:  # noqa: SIM115
    """Open ``path`` for a check; :func:`_verify_pieces` closes it once this rank's share is done."""
    f = opener(path)
    _opened.append(f)
    return f


def _helper() -> ThreadPoolExecutor:
    """One thread that computes CRC-32s beside the thread reading the bytes (made on first use)."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_fsdp2-crc32")
    return _executor


def _crc_of(f: Any, offset: int, length: int) -> int | None:
    """The CRC-32 of ``length`` bytes of ``f`` from ``offset`` (``None`` if the file ends first): each chunk's
    CRC-32 computed on the helper thread while the next chunk is read."""
    f.seek(offset)
    value, left, pending = 0, length, None
    while left:
        data = f.read(min(CHUNK, left))
        if pending is not None:
            value = pending.result()
        if not data:
            return None
        left -= len(data)
        pending = _helper().submit(zlib.crc32, data, value)
    return pending.result() if pending is not None else value


# ------------------------------------------------------------------------------------------------ verifying
TURN_OFF = ("FSDP2Strategy(verify_checkpoints=False); lightning-fsdp2-convert --no-verify;"
            " read_full_checkpoint(..., verify=False)")


def verify(path: str | os.PathLike, *, together: bool) -> None:
    """Verify the checksums of the checkpoint at ``path`` (a full checkpoint file or a sharded directory); raise a
    :class:`CheckpointFileError` naming each damaged file, tensor and the rank that found it. ``together``: every
    rank calls this, each verifying a share; all raise alike. A checkpoint without checksums passes."""
    path = Path(path)
    if path.is_dir():
        pieces = _sharded_pieces(path) + _archive_pieces(path / META_FILENAME)  # meta.pt: a torch.save archive
    elif path.is_file() and zipfile.is_zipfile(path):
        pieces = _archive_pieces(path)
    else:
        return
    _verify_pieces(pieces, f"The checkpoint {path}", TURN_OFF, together=together)


def verify_safetensors(files: list[Path], *, together: bool, turn_off: str) -> None:
    """Verify the CRC-32s that our exports record in their safetensors headers (:func:`checksum_metadata`) for
    ``files``; as :func:`verify`. Files without them (written by others) pass. ``turn_off``: how to skip it."""
    if not files:
        return
    indexed = {d: _index_checksums(d) for d in {Path(file).parent for file in files}}
    pieces = [piece for file in files for piece in _safetensors_pieces(Path(file), indexed[Path(file).parent])]
    what = f"The weights file {files[0]}" if len(files) == 1 else f"The weights in {Path(files[0]).parent}"
    _verify_pieces(pieces, what, turn_off, together=together)


def _verify_pieces(pieces: list[tuple[int, Check]], what: str, turn_off: str, *, together: bool) -> None:
    """Run this rank's share of ``pieces`` (all of them without ``together``); raise on every rank what any found."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if together and dist.is_initialized() else (0, 1)
    found = []
    try:
        for check in _shares(pieces, world)[rank][1]:
            try:  # whatever this rank meets, the others hear of it in the gather below (none waits for it)
                found += check()
            except Exception as err:  # noqa: BLE001
                found.append(f"{type(err).__name__}: {err}")
    finally:
        while _opened:
            _opened.pop().close()
    everyone = [found]
    if world > 1:
        everyone = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(everyone, found)
    problems = [f"{p} (found by rank {r})" for r, found in enumerate(everyone) for p in found]
    if problems:
        raise CheckpointFileError(
            f"{what} is damaged: its data does not match the checksums written with it: "
            + "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
            + ". Nothing was loaded. Restore it from a copy, or load another checkpoint (the storage may be"
            f" failing); to load it anyway, turn verification off ({turn_off})."
        )


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
            if info.compress_type == zipfile.ZIP_STORED:  # torch stores records as they are: read them straight
                if "file" not in opened:
                    opened["file"] = _open(path)  # one per rank, for all its records
                if _stored_crc(opened["file"], 0, info) != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")
            else:
                if "archive" not in opened:
                    opened["archive"] = _open(path, zipfile.ZipFile)
                with opened["archive"].open(info) as record:
                    while record.read(CHUNK):
                        pass
        except Exception as err:  # noqa: BLE001 - a bad CRC-32, or damage met first (EOF, I/O error)
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
    """A sharded checkpoint's tensor items, each a ``torch.save`` archive inside a ``.distcp`` file, each record
    checked against the CRC-32 in that archive's directory."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        metadata = read_dcp_metadata(path)
    except Exception:  # noqa: BLE001 - the load names a bad index itself
        return []
    opened: dict[str, Any] = {}  # this rank's open files, one each

    def check(fqn: str, name: str, offset: int, length: int) -> list[str]:
        if name not in opened:
            opened[name] = _open(path / name)  # kept for the rank's other items in it
        f = opened[name]
        try:
            with zipfile.ZipFile(_Window(f, offset, length)) as archive:
                records = archive.infolist()
            for info in records:
                if info.CRC and _stored_crc(f, offset, info) != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for record {info.filename!r}")
        except Exception as err:  # noqa: BLE001 - a bad CRC-32, or damage met first (a broken archive, EOF, I/O)
            said = "" if isinstance(err, zipfile.BadZipFile) and "CRC" in str(err) else f"; {type(err).__name__}: {err}"
            return [f"file {name!r}, tensor {fqn!r}{said}"]
        return []

    items = metadata.storage_data or {}
    return [(info.length, lambda i=index, info=info: check(i.fqn, info.relative_path, info.offset, info.length))
            for index, info in items.items()
            if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
            and not getattr(info, "transform_descriptors", None)]  # compressed by a DCP extension: not torch's bytes


def _stored_crc(f: Any, base: int, info: zipfile.ZipInfo) -> int | None:
    """The CRC-32 of a stored (uncompressed: torch's) record of the archive that starts at ``base`` in ``f``."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise zipfile.BadZipFile(f"record {info.filename!r} is compressed: not a torch archive")
    f.seek(base + info.header_offset + 26)  # the local header's name and extra-field lengths
    name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return _crc_of(f, base + info.header_offset + 30 + name_length + extra_length, info.file_size)


class _Window(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of an open file, as a file of their own (a DCP item, for zipfile)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: pos, 1: self._pos + pos, 2: self._length + pos}[whence])
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._length - self._pos if n is None or n < 0 else min(n, self._length - self._pos)
        if n <= 0:
            return b""
        self._f.seek(self._offset + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data


# ------------------------------------------------------------------------------------------------ safetensors
CRC_KEY = "lightning_fsdp2.crc32"
"""The key, in a safetensors file's header metadata (``__metadata__``, strings only), under which our exports record
the CRC-32 of each tensor's bytes: ``{name: crc}`` as JSON. safetensors itself has no checksum; transformers, peft
and safetensors read such files as any other (they look only at ``"format"``)."""


def checksum_metadata(tensors: Mapping[str, Tensor]) -> dict[str, str]:
    """``{CRC_KEY: ...}`` for ``tensors``: the CRC-32 of each one's bytes as safetensors writes them (contiguous, in
    order; little-endian, as this machine stores them), computed from memory before the write, a few tensors at a time
    on helper threads (zlib releases the GIL). Pass it (with ``"format": "pt"``) as the file's ``metadata``."""
    def crc(t: Tensor) -> int:
        t = t.detach()
        if t.numel() == 0:
            return 0
        return zlib.crc32(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="lightning_fsdp2-crc32") as pool:
        values = dict(zip(tensors, pool.map(crc, tensors.values())))
    return {CRC_KEY: json.dumps(values, separators=(",", ":"))}


def add_checksums(path: Path) -> None:
    """Rewrite the safetensors file ``path`` (one another library just wrote for us: peft's adapter file) with
    :func:`checksum_metadata` in its header. For small files: it is read back and written again."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    tensors = load_file(str(path))
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata={"format": "pt", **metadata, **checksum_metadata(tensors)})
    os.replace(partial, path)


def _index_checksums(directory: Path) -> dict[str, int]:
    """The CRC-32s recorded in the metadata of ``directory``'s safetensors index: given metadata, huggingface_hub's
    ``save_torch_state_dict`` writes it in each file's header when it writes one file, in the index when it splits."""
    found: dict[str, int] = {}
    for index in directory.glob("*.safetensors.index.json"):
        try:
            recorded = (json.loads(index.read_text()).get("metadata") or {}).get(CRC_KEY)
            found.update(json.loads(recorded) if recorded else {})
        except (OSError, ValueError, AttributeError, TypeError):
            continue  # not ours, or unreadable: the load names a bad index itself
    return found


def _safetensors_pieces(path: Path, indexed: dict[str, int]) -> list[tuple[int, Check]]:
    """A safetensors file's tensors that its header (else ``indexed``, its index's) records a CRC-32 for, each
    checked against it (none without)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size > 100 << 20:  # safetensors' own limit: not a header; the load names it
                return []
            header = json.loads(f.read(size))
        recorded = (header.get("__metadata__") or {}).get(CRC_KEY)
    except (OSError, ValueError, AttributeError):
        return []  # not a readable safetensors header: safetensors names it at the load
    if recorded is None and not indexed:
        return []  # written by others, or by us before checksums
    try:
        expected = json.loads(recorded) if recorded is not None else indexed
    except ValueError:  # the header itself was damaged
        return [(0, lambda: [f"{path.name}: the header's checksums ({CRC_KEY}) are unreadable"])]
    base, opened = 8 + size, {}

    def check(name: str, begin: int, end: int) -> list[str]:
        if "file" not in opened:
            opened["file"] = _open(path)  # one per rank, for all its tensors in this file
        try:
            actual = _crc_of(opened["file"], base + begin, end - begin)
        except OSError as err:
            return [f"{path.name}: tensor {name!r} ({type(err).__name__}: {err})"]
        return [] if actual == expected[name] else [f"{path.name}: tensor {name!r}"]

    return [(end - begin, lambda n=name, b=begin, e=end: check(n, b, e))
            for name, info in header.items() if name in expected and isinstance(info, dict)
            for begin, end in [info.get("data_offsets", (0, 0))]]
