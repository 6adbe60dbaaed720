"""Checksums: written with every checkpoint (by torch, as it writes the bytes), verified before anything of it is
loaded.

Storage and network file systems do flip bits, and neither ``torch.load``, DCP nor safetensors notice: a resume would
train on from the corrupted value. Yet both of our formats already carry a CRC-32 of every tensor's bytes, computed
by torch while it writes them: a ``torch.save`` archive is a zip file whose directory holds each record's CRC-32
(``torch.utils.serialization.config.save.compute_crc32``, on by default), and

- ``"full"``: the file is such an archive (``torch.save``'s, or ours, :mod:`.stream`, written with torch's zip writer);
- ``"sharded"`` (and ``async_save``): DCP writes each tensor shard, and each non-tensor item, as a ``torch.save``
  archive inside its ``.distcp`` file (its default ``TORCH_SAVE`` format), back to back, at the offsets its index
  (``.metadata``) gives; and ``meta.pt`` is one. The index is a raw pickle without a checksum: our writer
  (:class:`IndexChecksumWriter`) appends its CRC-32 after the pickle, where ``pickle.load`` stops reading.

An archive's records are also checked by name: torch's reader finds them by the names in the zip directory, zipfile
by their local headers'; both copies must agree and follow torch's layout (:func:`_data_offset`,
:func:`_name_problems`), read with the header that locates each record's data anyway.

Nothing reads these CRC-32s back (``torch.load(mmap=True)`` maps the bytes straight into tensors). Here every record
is read once and compared, before the load: the records are split over the ranks, each reading its share in file
order (sequential reads: storage serves them fastest) while threads compute the CRC-32s of the chunks already read
(zlib releases the GIL; a record's chunks are combined as zlib's ``crc32_combine`` does), so a resume reads the
checkpoint's bytes one more time in all, in parallel, at about the speed of reading them; then every rank learns
every mismatch and all raise together, naming the file, the tensor and the rank that found it. Writing costs nothing
more than torch already does, but for the index's checksum (its small file read back once, 32 bytes appended).

safetensors has no checksum of its own. The safetensors files we write (the converter's Hugging Face directory,
``lora.save_adapter``'s adapter) record each tensor's CRC-32 in their header's metadata (:data:`CRC_KEY`; a converter
export split into several files, in its index's metadata), computed from memory before the write;
``load_pretrained`` and ``lora.load_adapter`` verify them the same way before reading. Not covered: checkpoints
written with ``compute_crc32`` off, a sharded index written without our checksum (by DCP itself, or before it:
only read safely and checked against the shard files), the zip fields no reader uses (dates, attributes, padding),
``lora.save_merged``'s files (transformers writes them), and files written by others: they load as before. CRC-32
(zlib's) detects every burst of up to 32 flipped bits and other damage with probability 1 - 2^-32; it is no defence
against deliberate tampering (that takes a signature).
"""

from __future__ import annotations

import functools
import io
import json
import os
import queue
import re
import threading
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter

from lightning_fsdp2.checkpoint.files import META_FILENAME, CheckpointFileError
from lightning_fsdp2.checkpoint.safe_dcp import read_dcp_metadata

CHUNK = 4 << 20  # the largest piece of a record whose CRC-32 one thread computes while verifying (a power of
# two: _combine then applies one operator per piece)
SPAN = 16 << 20  # bytes read at a time while verifying
GAP = 1 << 20  # bytes between two records read through rather than skipped
SMALL = 64 << 10  # pieces up to this size: their CRC-32 computed by the reading thread itself
HEADER = 8 << 10  # bytes around an archive's headers, or at its end (its directory), asked for before they are read


@dataclass(frozen=True)
class _Record:
    """Bytes of a file whose CRC-32 was written with them; ``named(note)`` says which, for a mismatch."""

    path: Path
    offset: int
    length: int
    crc: int
    named: Callable[[str], str]


Check = Callable[["_Files"], list["_Record | str"]]  # one piece: the records to compare, or what is already wrong


class _Piece(NamedTuple):
    """One check of a verification: its bytes (to share the work out), where they lie (to read in file order), and
    the few bytes its check reads before the records' data (zip directories and headers: asked for all at once)."""

    size: int
    where: tuple[str, int]
    check: Check
    reads: tuple[tuple[Path, int, int], ...] = ()


class _Files:
    """The files of one verification, each opened once (unbuffered: reads go straight into the caller's buffer) and
    closed when it ends. Used by one thread: the one reading."""

    def __init__(self) -> None:
        self._files: dict[Path, Any] = {}

    def _file(self, path: Path) -> Any:
        if path not in self._files:
            self._files[path] = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        return self._files[path]

    def prefetch(self, path: Path, offset: int, length: int) -> None:
        """Ask the kernel to start reading these bytes (``posix_fadvise``; elsewhere nothing). The zip directories and
        headers read before the data lie scattered through a file: read one by one, each waited for its own I/O
        (1.8 s instead of 0.7 for a cold 1.1 GB sharded checkpoint here); asked for together, the storage serves them
        in one batch."""
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self._file(path).fileno(), max(0, offset), length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # a hint: the read itself names what is wrong

    def size(self, path: Path) -> int:
        return os.fstat(self._file(path).fileno()).st_size

    def read_into(self, path: Path, offset: int, view: memoryview) -> int:
        """Fill ``view`` from ``offset``; the bytes read (fewer where the file ends first)."""
        f, done = self._file(path), 0
        f.seek(offset)
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                break
            done += got
        return done

    def read(self, path: Path, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        with memoryview(buffer) as view:
            return bytes(buffer[:self.read_into(path, offset, view)])

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _threads() -> int:
    """Threads computing this rank's CRC-32s: zlib's releases the GIL, so they run on as many cores (at most 4: 16
    GB/s, more than a rank reads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


def _crcs(records: list[_Record], files: _Files) -> list[int | str]:
    """Each record's CRC-32, or why there is none (a note for its message: the file ends before it, a read failed).

    This thread reads the records' bytes as a plain read of the files would: in file order, :data:`SPAN` bytes at a
    time (the small gaps between records, zip headers, read through), into a few reused buffers; :func:`_threads`
    threads compute the CRC-32s of the pieces in each span meanwhile (zlib releases the GIL). A record is cut into
    pieces of at most :data:`CHUNK` bytes, whose values are combined in order (:func:`_combine`). Reading the bytes
    any other way cost this VM's disk up to twice a plain read: many threads reading at scattered offsets, the files
    mapped into memory (page faults), reads of 4 MB."""
    notes: dict[int, str] = {}  # record -> why it has no CRC-32, known before reading
    sizes: dict[Path, int | str] = {}
    for path in {r.path for r in records}:
        try:
            sizes[path] = files.size(path)
        except OSError as err:
            sizes[path] = f"; {type(err).__name__}: {err}"
    pieces = []
    for i, r in enumerate(records):
        size = sizes[r.path]
        if isinstance(size, str) or r.offset + r.length > size:  # before cutting it: a damaged length may be huge
            notes[i] = size if isinstance(size, str) else "; the file ends before it"
            continue
        pieces += [(r.path, start, min(CHUNK, r.offset + r.length - start), i)
                   for start in range(r.offset, r.offset + r.length, CHUNK)]
    pieces.sort(key=lambda piece: (str(piece[0]), piece[1]))
    spans: list[tuple[Path, int, int, list[tuple[Path, int, int, int]]]] = []  # (path, start, end, pieces)
    for piece in pieces:
        path, start, length, _ = piece
        if spans and spans[-1][0] == path and start - spans[-1][2] <= GAP and start + length - spans[-1][1] <= SPAN:
            spans[-1][3].append(piece)
            spans[-1] = (path, spans[-1][1], max(spans[-1][2], start + length), spans[-1][3])
        else:
            spans.append((path, start, start + length, [piece]))
    values = _read_spans(spans, files) if spans else {}
    out: list[int | str] = []
    for i, r in enumerate(records):
        value: int | str = notes.get(i, 0)
        for start in range(r.offset, r.offset + r.length, CHUNK) if i not in notes else ():
            try:
                part = values[i, start]
                part = part if isinstance(part, (int, str)) else part.result()
            except Exception as err:  # noqa: BLE001 - named with its record, the others still compared
                part = f"; {type(err).__name__}: {err}"
            if isinstance(part, str):
                value = part
                break
            value = _combine(value, part, min(CHUNK, r.offset + r.length - start))
        out.append(value)
    return out


def _read_spans(spans: list[tuple[Path, int, int, list[tuple[Path, int, int, int]]]],
                files: _Files) -> dict[tuple[int, int], Future[int] | int | str]:
    """Read ``spans`` in order into a few reused buffers; their pieces' CRC-32s (or why none), by (record, piece's
    start): small pieces computed here, the others on :func:`_threads` threads; a buffer is read into again once its
    last piece is done."""
    values: dict[tuple[int, int], Future[int] | int | str] = {}
    threads = _threads()
    free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    size = max(end - start for _, start, end, _ in spans)
    for _ in range(min(len(spans), threads + 2)):  # one being read, one queued per thread, one spare
        free.put(bytearray(size))
    lock = threading.Lock()

    def crc(buffer: bytearray, offset: int, length: int, left: list[int]) -> int:
        try:
            with memoryview(buffer) as view:
                return zlib.crc32(view[offset:offset + length])
        finally:
            with lock:
                left[0] -= 1
                if not left[0]:  # the span's last piece: its buffer can be read into again
                    free.put(buffer)

    with ThreadPoolExecutor(threads, thread_name_prefix="lightning_fsdp2-crc32") as pool:
        for path, start, end, inside in spans:
            buffer = free.get()
            large = []
            with memoryview(buffer) as view:
                try:
                    with view[:end - start] as target:
                        got = files.read_into(path, start, target)
                except OSError as err:  # this span's records named with it; the others still read
                    got, failed = -1, f"; {type(err).__name__}: {err}"
                for _, begin, length, i in inside:
                    if begin + length - start > got:
                        values[i, begin] = failed if got < 0 else "; the file ends before it"
                    elif length <= SMALL:  # a pickle, a version record: a thread's turn would cost more (the GIL)
                        values[i, begin] = zlib.crc32(view[begin - start:begin - start + length])
                    else:
                        large.append((begin, length, i))
            left = [len(large)]
            for begin, length, i in large:
                values[i, begin] = pool.submit(crc, buffer, begin - start, length, left)
            if not large:
                free.put(buffer)
    return values


def _combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1`` of ``a``, ``crc2`` of ``b`` and ``length2 == len(b)`` (zlib's
    ``crc32_combine``, which Python's ``zlib`` does not offer). The CRC-32 is affine in its input: appending ``b``
    maps ``a``'s value through the register's update over ``len(b)`` zero bytes (a linear map; zlib's pre- and
    post-inversion cancel), then adds ``b``'s own value (XOR). That update is applied as the updates over ``2**k``
    zero bytes for the bits ``k`` of ``length2`` (one for a power of two such as :data:`CHUNK`)."""
    k = 0
    while crc1 and length2 >> k:
        if length2 >> k & 1:
            crc1 = _apply(_power_of_two_bytes(k), crc1)
        k += 1
    return crc1 ^ crc2


def _apply(operator: tuple[int, ...], vector: int) -> int:
    """A 32 x 32 matrix over GF(2) (its columns: the images of the 32 unit vectors) applied to ``vector``."""
    out, bit = 0, 0
    while vector:
        if vector & 1:
            out ^= operator[bit]
        vector, bit = vector >> 1, bit + 1
    return out


@functools.cache
def _power_of_two_bytes(k: int) -> tuple[int, ...]:
    """The register's update over ``2**k`` zero bytes: one byte's (eight reflected shifts by the polynomial
    0xEDB88320), squared ``k`` times."""
    if k == 0:
        bit = tuple(0xEDB88320 if i == 0 else 1 << (i - 1) for i in range(32))  # one zero bit
        operator = bit
        for _ in range(7):
            operator = tuple(_apply(bit, column) for column in operator)
        return operator
    half = _power_of_two_bytes(k - 1)
    return tuple(_apply(half, column) for column in half)


# ------------------------------------------------------------------------------------------------ verifying
TURN_OFF = ("FSDP2Strategy(verify_checkpoints=False); lightning-fsdp2-convert --no-verify;"
            " read_full_checkpoint(..., verify=False)")


def verify(path: str | os.PathLike, *, together: bool, index: bool = True) -> None:
    """Verify the checksums of the checkpoint at ``path`` (a full checkpoint file or a sharded directory); raise a
    :class:`CheckpointFileError` naming each damaged file, tensor and the rank that found it. ``together``: every
    rank calls this, each verifying a share; all raise alike. A checkpoint without checksums passes. A sharded
    one's index first (:func:`verify_index`; ``index=False``: the caller did)."""
    path = Path(path)
    if path.is_dir():
        if index:
            verify_index(path, together=together)
        pieces = _sharded_pieces(path) + _archive_pieces(path / META_FILENAME)  # meta.pt: a torch.save archive
    elif path.is_file() and zipfile.is_zipfile(path):
        pieces = _archive_pieces(path)
    else:
        return
    _verify_pieces(pieces, f"The checkpoint {path}", TURN_OFF, together=together)


def verify_index(path: str | os.PathLike, *, together: bool) -> None:
    """Verify the CRC-32 that :class:`IndexChecksumWriter` appended to the sharded checkpoint ``path``'s index
    (``.metadata``), before anything reads the index; raise as :func:`verify`. One rank reads it (a small file)."""
    path = Path(path)
    _verify_pieces([_Piece(0, (str(path / INDEX_FILENAME), 0), lambda files: _index_problems(path / INDEX_FILENAME))],
                   f"The checkpoint {path}", TURN_OFF, together=together)


def verify_safetensors(files: list[Path], *, together: bool, turn_off: str) -> None:
    """Verify the CRC-32s that our exports record in their safetensors headers (:func:`checksum_metadata`) for
    ``files``; as :func:`verify`. Files without them (written by others) pass. ``turn_off``: how to skip it."""
    if not files:
        return
    indexed = {d: _index_checksums(d) for d in {Path(file).parent for file in files}}
    pieces = [piece for file in files for piece in _safetensors_pieces(Path(file), indexed[Path(file).parent])]
    what = f"The weights file {files[0]}" if len(files) == 1 else f"The weights in {Path(files[0]).parent}"
    _verify_pieces(pieces, what, turn_off, together=together)


def _verify_pieces(pieces: list[_Piece], what: str, turn_off: str, *, together: bool) -> None:
    """Run this rank's share of ``pieces`` (all of them without ``together``); raise on every rank what any found."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if together and dist.is_initialized() else (0, 1)
    found: list[str] = []
    files = _Files()
    try:  # whatever this rank meets, the others hear of it in the gather below (none waits for it)
        records, share = [], _shares(pieces, world)[rank]
        for path, offset, length in (read for piece in share for read in piece.reads):
            files.prefetch(path, offset, length)
        for check in (piece.check for piece in share):
            try:
                for item in check(files):
                    (records if isinstance(item, _Record) else found).append(item)
            except Exception as err:  # noqa: BLE001
                found.append(f"{type(err).__name__}: {err}")
        for record, value in zip(records, _crcs(records, files)):
            if isinstance(value, str) or value != record.crc:
                found.append(record.named(value if isinstance(value, str) else ""))
        found = list(dict.fromkeys(found))  # a DCP item's records share its name: said once
    except Exception as err:  # noqa: BLE001
        found.append(f"{type(err).__name__}: {err}")
    finally:
        files.close()
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


def _shares(pieces: list[_Piece], world: int) -> list[list[_Piece]]:
    """The pieces split over ``world`` ranks, largest first to the least loaded (the same split on every rank); each
    rank's in file order (its archives' directories read in one pass)."""
    loads, shares = [0] * world, [[] for _ in range(world)]  # type: ignore[var-annotated]
    for piece in sorted(pieces, key=lambda p: -p.size):
        i = min(range(world), key=loads.__getitem__)
        loads[i] += piece.size
        shares[i].append(piece)
    return [sorted(share, key=lambda p: p.where) for share in shares]


# ------------------------------------------------------------------------------------------------ DCP's index
INDEX_FILENAME = ".metadata"
INDEX_CHECKSUM = b"\nlightning_fsdp2.crc32="
"""What :class:`IndexChecksumWriter` appends to a sharded checkpoint's index (DCP's ``.metadata``, a raw pickle with
no checksum of its own), followed by the CRC-32 of every byte before it (8 hex digits) and a newline. ``pickle.load``
stops at the pickle's end (its ``STOP``), so torch (``FileSystemReader``) and everyone else read the file as before."""
_INDEX_TRAILER = len(INDEX_CHECKSUM) + 9


class IndexChecksumWriter(FileSystemWriter):
    """torch's ``FileSystemWriter``, which then appends :data:`INDEX_CHECKSUM` and the CRC-32 of the index it has
    just written (on the coordinating rank, in ``finish``; read back from the page cache: a few KB to MB). Each
    tensor and non-tensor item is a ``torch.save`` archive with CRC-32s of its own."""

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        rank = getattr(self, "rank", None)
        name = f"__{rank}{INDEX_FILENAME}" if not getattr(self, "use_collectives", True) and rank is not None else (
            INDEX_FILENAME)
        with open(Path(self.path) / name, "r+b") as f:
            data = f.read()
            f.write(INDEX_CHECKSUM + b"%08x\n" % zlib.crc32(data))
            f.flush()
            if getattr(self, "sync_files", True):
                os.fsync(f.fileno())


def _index_problems(file: Path) -> list[str]:
    """What is wrong with a sharded checkpoint's index: its bytes against the CRC-32 appended to them, or bytes after
    the pickle that are no such checksum (one damaged). An index without one (written by torch, by others, or before
    this check) passes: the safe reader (:func:`~.safe_dcp.read_dcp_metadata`) and the shard files' checks are all
    it gets."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return []  # not a sharded checkpoint of DCP's: the load names what is missing
    except OSError as err:
        return [f"{file.name}: {type(err).__name__}: {err}"]
    trailer = data[-_INDEX_TRAILER:]
    if trailer.startswith(INDEX_CHECKSUM) and trailer.endswith(b"\n"):
        try:
            recorded = int(trailer[len(INDEX_CHECKSUM):-1], 16)
        except ValueError:
            recorded = None
        if recorded is not None and zlib.crc32(data[:-_INDEX_TRAILER]) == recorded:
            return []
        if recorded is not None:
            return [f"{file.name}: the checkpoint's index does not match the CRC-32 written with it"]
    if data.endswith(b"."):  # a pickle's last byte (STOP), which the checksum's never is: an index without one
        return []
    return [f"{file.name}: the checkpoint's index ends in bytes that are neither its pickle's end nor the CRC-32"
            " written with it (a damaged checksum, or a file cut short)"]


def _archive_pieces(path: Path) -> list[_Piece]:
    """A ``torch.save`` archive's records, each checked against the CRC-32 in the archive's directory."""
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError):
        return []  # not readable as an archive: torch.load names the damage
    if not any(info.CRC for info in infos):
        return []  # written without CRC-32s (torch's compute_crc32 off)

    @functools.cache
    def names() -> dict[str, str]:
        return _record_names(path)  # read once, only when a record is damaged

    def named(info: zipfile.ZipInfo, note: str) -> str:
        return f"{path.name}: record {info.filename!r} ({names().get(info.filename, 'not a tensor')}{note})"

    def check(info: zipfile.ZipInfo, files: _Files) -> list[_Record | str]:
        try:
            if info.compress_type == zipfile.ZIP_STORED:  # torch stores records as they are: read them in place
                return [_Record(path, _data_offset(files, path, 0, info), info.file_size, info.CRC,
                                functools.partial(named, info))]
            with zipfile.ZipFile(path) as archive, archive.open(info) as record:  # not torch's: zipfile checks it
                while record.read(CHUNK):
                    pass
        except _Damaged as err:
            return [f"{path.name}: {err}"]
        except Exception as err:  # noqa: BLE001 - a bad CRC-32, or damage met first (EOF, I/O error)
            return [named(info, "" if isinstance(err, zipfile.BadZipFile) and "CRC" in str(err)
                          else f"; {type(err).__name__}: {err}")]
        return []

    structure = [f"{path.name}: {problem}" for problem in _name_problems(infos)]
    return [_Piece(info.file_size, (str(path), info.header_offset), functools.partial(check, info),
                   ((path, info.header_offset, HEADER),)) for info in infos] + (
        [_Piece(0, (str(path), -1), lambda files: structure)] if structure else [])


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


def _sharded_pieces(path: Path) -> list[_Piece]:
    """A sharded checkpoint's tensor items, each a ``torch.save`` archive inside a ``.distcp`` file, each record
    checked against the CRC-32 in that archive's directory."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        metadata = read_dcp_metadata(path)
    except Exception:  # noqa: BLE001 - the load names a bad index itself
        return []

    def named(fqn: str, name: str, note: str, kind: str = "tensor") -> str:
        return f"file {name!r}, {kind} {fqn!r}" + (f" ({note[2:]})" if note else "")

    def check(fqn: str, name: str, offset: int, length: int, pickled: bool, files: _Files) -> list[_Record | str]:
        kind = "item" if pickled else "tensor"  # pickled: a non-tensor item (an optimizer's param_groups values)
        try:
            try:
                with zipfile.ZipFile(_Window(files, path / name, offset, length)) as archive:
                    infos = archive.infolist()
            except zipfile.BadZipFile:
                if pickled:  # a non-tensor item not written by torch.save (DCP's since 2.0 are): loaded as before
                    return []
                raise
            if not any(info.CRC for info in infos):
                return []  # written without CRC-32s (torch's compute_crc32 off)
            problems: list[_Record | str] = [named(fqn, name, f"; {p}", kind) for p in _name_problems(infos)]
            return problems + [_Record(path / name, _data_offset(files, path / name, offset, info), info.file_size,
                                       info.CRC, functools.partial(named, fqn, name, kind=kind)) for info in infos]
        except Exception as err:  # noqa: BLE001 - damage met first (a broken archive, a missing file, I/O)
            note = f"; {err}" if isinstance(err, _Damaged) else f"; {type(err).__name__}: {err}"
            return [named(fqn, name, note, kind)]

    items = metadata.storage_data or {}
    return [_Piece(info.length, (str(path / info.relative_path), info.offset),
                   functools.partial(check, index.fqn, info.relative_path, info.offset, info.length,
                                     isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)),
                   ((path / info.relative_path, info.offset, HEADER),  # its first records' headers
                    (path / info.relative_path, info.offset + info.length - HEADER, HEADER)))  # its directory
            for index, info in items.items()
            if not getattr(info, "transform_descriptors", None)]  # compressed by a DCP extension: not torch's bytes


class _Damaged(Exception):
    """Damage to an archive's structure (a record's name, a local header): its message says what, for the report."""


_LOCAL_HEADER = b"PK\x03\x04"


def _data_offset(files: _Files, path: Path, base: int, info: zipfile.ZipInfo) -> int:
    """Where the bytes of a stored (uncompressed: torch's) record start in ``path``, whose archive starts at
    ``base``: after the record's local header, whose name and extra field (torch pads it) have lengths of their own.
    The header must be one (its signature) and hold the name the directory gives (torch's reader looks records up by
    the directory's names, zipfile's by the header's: a byte flipped in either copy is named here)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise zipfile.BadZipFile(f"record {info.filename!r} is compressed: not a torch archive")
    expected = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
    header = files.read(path, base + info.header_offset, 30 + len(expected))  # one read: prefetched with the rest
    if len(header) < 30:
        raise EOFError(f"the file ends before record {info.filename!r}")
    name_length, extra_length = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
    if header[:4] != _LOCAL_HEADER:
        raise _Damaged(f"record {info.orig_filename!r}: no local header where the zip directory places it")
    if header[30:] != expected or name_length != len(expected):
        local = files.read(path, base + info.header_offset + 30, min(name_length, 1024))
        raise _Damaged(f"record name {info.orig_filename!r} in the zip directory, "
                       f"{local.decode('cp437')!r} in its local header")
    return base + info.header_offset + 30 + name_length + extra_length


_TORCH_DATA = re.compile(r"data/[0-9]+")  # torch.save's storage keys (and DCP's, and our streamed writer's)


def _name_problems(infos: list[zipfile.ZipInfo]) -> list[str]:
    """What is wrong with an archive's record names against torch's layout: every record under one top folder, one
    ``data.pkl``, each name once, storages as ``data/<number>``. Other names (``version``, ``byteorder``...) differ
    between torch versions: those are only compared with their local headers (:func:`_data_offset`)."""
    names = [info.orig_filename for info in infos]
    pickled = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickled) != 1:
        return [f"no single record 'data.pkl' in the zip directory (its names: {names[:8]!r})"]
    prefix = pickled[0][: -len("data.pkl")]
    problems = [f"record name {n!r} in the zip directory is not under {prefix!r}, as the others are"
                for n in names if not n.startswith(prefix)]
    problems += [f"record name {n!r} in the zip directory is not a storage's (data/<number>)" for n in names
                 if n.startswith(prefix + "data/") and not _TORCH_DATA.fullmatch(n[len(prefix):])]
    problems += [f"record name {n!r} appears {count} times in the zip directory"
                 for n, count in Counter(names).items() if count > 1]
    return problems


class _Window(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of a file, as a file of their own (a DCP item, for zipfile)."""

    def __init__(self, files: _Files, path: Path, offset: int, length: int) -> None:
        self._files, self._path, self._offset, self._pos = files, path, offset, 0
        self._length = max(0, min(length, files.size(path) - offset))  # a file cut short: zipfile names what is missing

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
        data = self._files.read(self._path, self._offset + self._pos, n)
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

    with ThreadPoolExecutor(_threads(), thread_name_prefix="lightning_fsdp2-crc32") as pool:
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


def _safetensors_pieces(path: Path, indexed: dict[str, int]) -> list[_Piece]:
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
        unreadable = f"{path.name}: the header's checksums ({CRC_KEY}) are unreadable"
        return [_Piece(0, (str(path), 0), lambda files: [unreadable])]

    def named(name: str, note: str) -> str:
        return f"{path.name}: tensor {name!r}" + (f" ({note[2:]})" if note else "")

    def check(name: str, begin: int, end: int, files: _Files) -> list[_Record | str]:
        return [_Record(path, 8 + size + begin, end - begin, expected[name], functools.partial(named, name))]

    return [_Piece(end - begin, (str(path), begin), functools.partial(check, name, begin, end))
            for name, info in header.items() if name in expected and isinstance(info, dict)
            for begin, end in [info.get("data_offsets", (0, 0))]]
