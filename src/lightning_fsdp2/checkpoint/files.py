"""Reading and writing checkpoint files safely: ``weights_only`` reads, atomic writes, errors that name the file."""

from __future__ import annotations

import errno
import glob
import os
import pickle
import re
import shutil
import uuid
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

META_FILENAME = "meta.pt"  # a sharded checkpoint's non-tensor part; the name Lightning's ModelParallelStrategy uses
FORMAT_KEY = "lightning_fsdp2"  # what we add to a checkpoint that is not a plain single-device one


class CheckpointFileError(RuntimeError):
    """A checkpoint (or pretrained weights) cannot be read, written or fitted to the model. The message names the file
    or the tensors. (Named apart from ``torch.utils.checkpoint.CheckpointError``, which is about activation
    checkpointing.)"""


def is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on the local file system (not ``s3://...`` and the like)."""
    return "://" not in str(path) or str(path).startswith("file://")


@contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """Turn a failure to parse a file into a :class:`CheckpointFileError` that names it."""
    try:
        yield
    except (CheckpointFileError, FileNotFoundError):
        raise
    except Exception as err:
        raise CheckpointFileError(
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
            raise CheckpointFileError(f"Could not read {path}: {err}. The file may be truncated or corrupt.") from err
        raise CheckpointFileError(
            f"{path} contains objects that `torch.load(weights_only=True)` refuses to unpickle: {err}. If you trust"
            " the file, allow the named classes with `torch.serialization.add_safe_globals([...])`, or pass"
            " `trainer.fit(..., weights_only=False)`."
        ) from err
    except Exception as err:
        raise CheckpointFileError(
            f"Could not read {path}: {type(err).__name__}: {err}. The file may be truncated or corrupt (for example"
            " a partial copy); replace it."
        ) from err


def missing_checkpoint(path: Path) -> FileNotFoundError:
    """The error for a checkpoint that is not there, pointing at a previous one a crashed save left aside."""
    aside = sorted(path.parent.glob(f".{path.name}.old-*")) if path.parent.is_dir() else []
    hint = f" A save was interrupted while swapping it in; the previous checkpoint is at {aside[-1]}." if aside else ""
    return FileNotFoundError(f"No checkpoint at {path}.{hint}")


def temporary_path(path: Path, token: str | None = None) -> Path:
    """The name a save of ``path`` writes to before it is complete: ``.<name>.tmp-<token>`` beside it."""
    return path.with_name(f".{path.name}.tmp-{token or uuid.uuid4().hex[:8]}")


def checkpoint_kind(path: str | os.PathLike) -> str | None:
    """What is at ``path``, as far as replacing it is concerned: ``"absent"``, ``"empty"`` (an empty directory),
    ``"full"`` (a file ``torch.save`` wrote, as every Lightning checkpoint is), ``"sharded"`` (a directory holding
    only what a sharded save writes, or only a rank's shard files where each rank wrote its own path), ``"link"`` (a symbolic link to one of those, or to nothing, as
    ``ModelCheckpoint(save_last="link")`` makes), or ``None``: something else, not ours."""
    path = Path(path)
    if path.is_symlink():
        # Replacing a link renames over the link itself; what it points to is never written or deleted.
        target = checkpoint_kind(path.resolve()) if path.exists() else "absent"
        return "link" if target in ("absent", "full", "sharded") else None
    if not path.exists():
        return "absent"
    if path.is_file():
        try:
            with zipfile.ZipFile(path) as archive:  # reads the central directory only, at the end of the file
                names = [n.split("/", 1)[-1] for n in archive.namelist()]
        except (zipfile.BadZipFile, OSError):
            return None
        # torch.save's records; a TorchScript archive (torch.jit.save) has code and constants besides.
        scripted = any(n.startswith("code/") or n == "constants.pkl" for n in names)
        return "full" if "data.pkl" in names and not scripted else None
    if path.is_dir():
        entries = [p.name for p in path.iterdir()]
        if not entries:
            return "empty"
        whole = {".metadata", META_FILENAME} <= set(entries)
        if all(_written_by_sharded_save(n) for n in entries) and (whole or all(n.endswith(".distcp") for n in entries)):
            return "sharded"  # a sharded checkpoint, or another rank's part of one written per rank (its shards)
    return None


def _written_by_sharded_save(name: str) -> bool:
    return name in (".metadata", META_FILENAME) or (name.startswith("__") and name.endswith(".distcp"))


def check_replaceable(path: str | os.PathLike) -> str:
    """Raise :class:`CheckpointFileError` unless a save may write ``path``: nothing is there, an empty directory, a
    checkpoint of ours (a torch/Lightning checkpoint file, or a sharded checkpoint directory), or a link to one.
    Returns the kind (see :func:`checkpoint_kind`).

    Never replace what we did not write: a directory with other files in it, a file that is not a checkpoint.
    """
    path = Path(path)
    kind = checkpoint_kind(path)
    if kind is not None:
        return kind
    if path.is_symlink():
        what = f"a symbolic link to {os.readlink(path)}, which is not a checkpoint"
    elif path.is_dir():
        entries = sorted(p.name for p in path.iterdir())
        count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
        what = f"a directory holding {count} other than a checkpoint's: {entries[:8]}"
    else:
        what = f"a file that is not a checkpoint ({path.stat().st_size} bytes)"
    raise CheckpointFileError(
        f"Refusing to save to {path}: it is {what}. A save replaces only a previous checkpoint at that path; choose a"
        " new path (e.g. a file inside that directory) or move what is there."
    )


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it into place.

    Refuses to replace anything but a previous checkpoint. A crash before the rename leaves the old file (if any)
    untouched; the rename itself is atomic on POSIX file systems. A sharded checkpoint that was at ``path`` is
    removed after the new file is in place.
    """
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    try:
        with writing(tmp, what=str(path)), open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def replace(new: Path, path: Path) -> None:
    """Move ``new`` (file or directory) to ``path``, replacing what was there with as small a window as possible,
    then remove what earlier saves of ``path`` left behind when they crashed (``.<name>.tmp-*``/``.old-*``).

    The caller has checked with :func:`check_replaceable` that ``path`` is ours to replace. A file over a file is one
    atomic ``os.replace``. A directory cannot be renamed over a non-empty one, so the old one is first renamed aside
    (``.<name>.old-*``) and deleted only once the new one is in place; a crash between the two renames leaves it
    there, and :func:`missing_checkpoint` points at it.
    """
    if new.is_dir():  # files written by other libraries (DCP, peft, transformers) are not fsynced by them
        for file in sorted(new.rglob("*")):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(new)
    if (path.is_dir() and not path.is_symlink()) or (new.is_dir() and (path.exists() or path.is_symlink())):
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        try:
            os.replace(new, path)
        except BaseException:
            os.replace(old, path)  # put the previous checkpoint back where it was
            raise
        delete(old)
    else:
        os.replace(new, path)
    _fsync_dir(path.parent)
    remove_leftovers(path)


def remove_leftovers(path: Path, keep: Path | None = None) -> None:
    """Delete the temporary (``.<name>.tmp-*``) and set-aside (``.<name>.old-*``) entries that interrupted saves of
    ``path`` left beside it; they are never read. ``keep``: the caller's own, still in use. (One save at a time per
    path: a strategy waits for its background save before the next.)"""
    if not path.parent.is_dir():
        return
    for kind in ("tmp", "old"):
        for leftover in path.parent.glob(glob.escape(f".{path.name}.{kind}-") + "*"):
            if leftover != keep:
                delete(leftover)


def delete(path: Path) -> None:
    """Delete a file or directory tree that we wrote (a temporary or set-aside one); no error if it is gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def check_export_directory(directory: Path) -> None:
    """Raise :class:`CheckpointFileError` if ``directory`` exists but is not a directory (a file, a link) we could write
    an export's files into."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise CheckpointFileError(
            f"Refusing to write into {directory}: it is a {'link' if directory.is_symlink() else 'file'}, not a"
            " directory. Choose a directory path (a new one, or one the files can be added to)."
        )


def write_files_into(
    new: Path, directory: Path, *, supersedes: Callable[[str, set[str]], bool] | None = None
) -> None:
    """Move every file of the freshly written directory ``new`` into ``directory``, one atomic rename per file,
    leaving the other files in ``directory`` alone (as peft's and transformers' ``save_pretrained`` do).

    ``supersedes(name, written)``: files already in ``directory`` that the new ones make stale (the shards of an earlier,
    differently split export of the same weights) and that are removed once the new files are in. Leftovers of
    killed exports to ``directory`` (``.<name>.tmp-*`` beside it) are removed too.
    """
    check_export_directory(directory)
    files = sorted(new.iterdir())
    for file in files:  # all checked before the first rename: no export is left half old, half new by a bad entry
        if not file.is_file():
            raise CheckpointFileError(f"Unexpected entry {file.name!r} in the export to {directory}; only files are written.")
        target = directory / file.name
        if target.is_dir() and not target.is_symlink():
            raise CheckpointFileError(f"Refusing to replace the directory {target} by a file of the export.")
    directory.mkdir(parents=True, exist_ok=True)
    for file in files:
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        os.replace(file, directory / file.name)
    written = {file.name for file in files}
    if supersedes is not None:
        for stale in directory.iterdir():
            if stale.is_file() and stale.name not in written and supersedes(stale.name, written):
                stale.unlink()
    _fsync_dir(directory)
    remove_leftovers(directory, keep=new)


def export_into(
    directory: Path, write: Callable[[Path], None], *, supersedes: Callable[[str, set[str]], bool] | None = None
) -> None:
    """Run ``write(tmp)`` into a new temporary directory beside ``directory``, then move its files into ``directory``
    (:func:`write_files_into`); the temporary directory is removed whatever happens. How every export (peft adapters,
    merged models, converted checkpoints) is written: call it on the one process that writes."""
    check_export_directory(directory)
    tmp = temporary_path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.mkdir()
        write(tmp)
        write_files_into(tmp, directory, supersedes=supersedes)
    finally:
        delete(tmp)


_SAFETENSORS_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def stale_safetensors_weights(name: str, written: set[str]) -> bool:
    """For an export that wrote the safetensors files ``written``: whether ``name``, already in the directory, holds
    weights that are now stale. As transformers' ``save_pretrained`` does, shards of an earlier export that this one
    did not rewrite; and, unlike it, the single ``model.safetensors`` when the new export is sharded (or the index
    when it is not), which ``from_pretrained`` would otherwise read instead of the new weights. Files of other formats
    (``pytorch_model.bin``) are left alone."""
    sharded = "model.safetensors.index.json" in written
    return (
        _SAFETENSORS_SHARD.fullmatch(name) is not None
        or (name == "model.safetensors" and sharded)
        or (name == "model.safetensors.index.json" and not sharded)
    )


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
    """Delete a checkpoint file or sharded directory; anything that is not recognizably a checkpoint is kept, with a
    warning (``ModelCheckpoint`` asks to remove the checkpoints it replaces)."""
    path = Path(path)
    kind = checkpoint_kind(path)
    if kind in ("full", "sharded", "link"):
        delete(path)  # a link itself, never what it points to
    elif kind is None:
        warnings.warn(f"Not removing {path}: it is not a checkpoint (file or sharded directory) that a save wrote.")


@contextmanager
def writing(path: str | os.PathLike, *, what: str | None = None, needed: int | None = None) -> Iterator[None]:
    """Turn a failed write into a :class:`CheckpointFileError` that names the file, and says "no space left on device"
    (with the bytes needed and free) when that is why. ``what``: the checkpoint the file belongs to."""
    try:
        yield
    except (CheckpointFileError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        raise write_error(err, Path(path), what=what, needed=needed) from err


def write_error(err: BaseException, path: Path, *, what: str | None = None, needed: int | None = None) -> Exception:
    """The error to raise for ``err`` while writing ``path``: a :class:`CheckpointFileError` naming the file, saying "no
    space left on device" when the disk is full. Other errors (``KeyboardInterrupt``) are returned unchanged."""
    if isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit, CheckpointFileError)):
        return err  # type: ignore[return-value]  # (DCP's CheckpointException is a BaseException too: handled)
    target = what or str(path)
    via = f" (its temporary file {path.name})" if what and what != str(path) else ""
    if is_disk_full(err, path, needed):
        free = _free_bytes(path)
        sizes = ", ".join(
            s for s in (f"{needed:,} bytes needed" if needed else "", f"{free:,} bytes free" if free is not None else "") if s
        )
        return CheckpointFileError(
            f"No space left on device while writing {target}" + (f" ({sizes})" if sizes else "") + ". Free some"
            " space (older checkpoints, `.tmp-`/`.old-` leftovers of interrupted saves) or save elsewhere; the"
            " previous checkpoint at that path is intact."
        )
    return CheckpointFileError(f"Could not write {target}{via}: {type(err).__name__}: {err}")


def is_disk_full(err: BaseException, path: Path, needed: int | None = None) -> bool:
    """Whether ``err`` (possibly re-raised by torch's writers, which lose the errno) came from a full disk."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if "No space left on device" in text or "[Errno 28]" in text or "Disk quota exceeded" in text:
        return True
    # torch's zip writer reports a short write as "unexpected pos" or "failed writing file", whatever the cause.
    if "unexpected pos" in text or "file write failed" in text or "failed writing" in text:
        free = _free_bytes(path)
        return free is not None and (free < 1 << 20 or (needed is not None and free < needed))
    return False


def _free_bytes(path: Path) -> int | None:
    for where in (path, *path.parents):
        if where.exists():
            try:
                return shutil.disk_usage(where).free
            except OSError:
                return None
    return None


def on_rank0(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 only; then every rank learns whether it worked, and all raise if it did not.

    Without this, an error on rank 0 (a full disk, an unpicklable hyper-parameter) would leave the other ranks
    waiting forever in the next collective. A :class:`CheckpointFileError` reaches the other ranks word for word.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    error: BaseException | None = None
    if rank0:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after telling the other ranks
            error = err
    broadcast_outcome(error, what)


def on_every_rank(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on every rank; if it failed on any, all raise (see :func:`raise_together`). Call on every rank."""
    error: BaseException | None = None
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - re-raised below, after telling the other ranks
        error = err
    raise_together(error, what)


def broadcast_outcome(error: BaseException | None, what: str) -> None:
    """Tell every rank rank 0's outcome (``error`` is rank 0's, ignored elsewhere); raise on all ranks if it failed."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    outcome: list[str | None] = [None]
    if rank0 and error is not None:
        exact = isinstance(error, CheckpointFileError)
        outcome = [str(error) if exact else f"Rank 0 failed to {what}: {type(error).__name__}: {error}"]
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if rank0 and error is not None:
        raise error
    if outcome[0] is not None:
        raise CheckpointFileError(outcome[0])


def raise_together(error: BaseException | None, what: str) -> None:
    """Every rank passes its own outcome of a step all ranks took part in; if any failed, all raise: rank 0's message
    where rank 0 failed (the same text everywhere), else the rank's own, or the lowest failing rank's (a
    :class:`CheckpointFileError` word for word). Call on every rank."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    rank = dist.get_rank()
    message = None if error is None else (
        str(error) if isinstance(error, CheckpointFileError)
        else f"Rank {rank} failed to {what}: {type(error).__name__}: {error}")
    outcomes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, message)
    if outcomes[0] is not None and rank != 0:
        raise CheckpointFileError(outcomes[0])
    if error is not None:
        raise error
    failed = [m for m in outcomes if m is not None]
    if failed:
        raise CheckpointFileError(failed[0])


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written with ``state_dict_type="sharded"``."""
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / ".metadata").is_file()
