"""Sharded checkpoints written in the background (``FSDP2Strategy(async_save=True)``): the writer that hands this
rank's staged shards to ``torch.distributed.checkpoint.async_save`` and swaps the finished directory into place, and
the CPU staging buffers it reuses from one save to the next."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.staging import AsyncStager

from lightning_fsdp2.checkpoint.files import (
    CheckpointFileError,
    check_replaceable,
    delete,
    raise_together,
    replace,
    write_error,
)


def swap_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path`` (replacing only a previous checkpoint there); ``tmp`` is gone after."""
    try:
        check_replaceable(path)  # again: something may have appeared there while the shards were written
        replace(tmp, path)
    finally:
        delete(tmp)


class BackgroundWriter:
    """Writes sharded checkpoints in the background (``FSDP2Strategy(async_save=True)``), one at a time.

    ``start`` copies this rank's shards into CPU staging buffers (the only part that holds up training) and hands
    them to ``torch.distributed.checkpoint.async_save``, whose thread writes them. Rank 0 swaps the directory into
    place as soon as DCP reports every rank's shards written (DCP's final step runs on rank 0 after all ranks
    finished), without waiting for the training loop. :meth:`wait` is where every rank learns the outcome.

    The staging buffers are kept and reused by the next save (allocating and first touching that much memory costs
    more than the copy): one CPU copy of this rank's shards for the rest of the run. The background thread's
    collectives need their own process group (training's run on the default one meanwhile), and a CPU one (DCP's
    planning exchanges Python objects): made here, so construct this on every rank, in the same order.
    """

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.stager = _ReusedStaging()
        self.path: Path | None = None  # of the save in flight
        self._tmp: Path | None = None
        self._done: Future | None = None  # this rank's part done (on rank 0: written and swapped into place)
        self._forgotten: Future | None = None

    def start(self, tensors: dict[str, Any], writer: Any, tmp: Path, path: Path, *, owner: bool | None = None) -> None:
        """Stage ``tensors`` and start writing them into ``tmp``, to be swapped to ``path``; call on every rank.
        ``owner``: this rank made ``tmp`` and swaps it in (rank 0, or each rank where each writes its own path)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        self._settle_forgotten()
        # Staging runs here, in the training thread, on every rank; all ranks agree it worked before any starts the
        # background write (whose collectives would otherwise wait for a rank that never joins).
        error: BaseException | None = None
        try:
            staged = self.stager.stage(tensors)
        except BaseException as err:  # noqa: BLE001 - e.g. out of memory for the staging buffers on one rank
            error = write_error(err, tmp, what=str(path))
        owner = is_rank0() if owner is None else owner
        try:
            raise_together(_agree(error, self.group), f"stage the sharded checkpoint {path}")
        except BaseException:
            if owner:
                delete(tmp)
            raise
        written = dcp.async_save(staged, storage_writer=writer, process_group=self.group, async_stager=_Staged())
        self.path, self._tmp = path, tmp
        if not owner:
            self._done = written
            return
        done: Future = Future()

        def finish(result: Future) -> None:  # in DCP's writer thread, once the shards (and the index) are written
            error: BaseException | None = None
            try:
                result.result()
                swap_into_place(tmp, path)
            except BaseException as err:  # noqa: BLE001 - handed to wait()
                error = err
            finally:
                try:
                    delete(tmp)
                finally:
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)

        self._done = done
        written.add_done_callback(finish)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete and in place; raise on every rank if it failed. Call
        on every rank."""
        if self._done is None:
            return
        done, tmp, path = self._done, self._tmp, self.path
        self._done = self.path = self._tmp = None
        error: BaseException | None = None
        try:
            done.result()
        except BaseException as err:  # noqa: BLE001
            error = write_error(err, tmp, what=str(path))
        raise_together(error, f"write the sharded checkpoint {path}")

    def wait_here(self) -> None:
        """Block until this rank's part of the save in flight is done (on rank 0: the directory is in place), without
        talking to the other ranks; the outcome is still reported by the next :meth:`wait`. Safe on one rank."""
        if self._done is not None:
            try:
                self._done.result()
            except BaseException:  # noqa: BLE001 - reported by wait()
                pass

    def forget(self) -> None:
        """Stop waiting for the save in flight (after an error elsewhere: the other ranks may never finish it). Its
        temporary directory is removed by the next save of that path."""
        if self._done is not None:
            self._forgotten = self._done
        self._done = self.path = self._tmp = None

    def _settle_forgotten(self) -> None:
        # A forgotten save may still be writing from the staging buffers, on this group: a new one must not start
        # before it ends (it may never end if another rank died; then nothing more can be saved anyway).
        if self._forgotten is not None:
            try:
                self._forgotten.result()
            except BaseException:  # noqa: BLE001 - its error was the end of that run
                pass
            self._forgotten = None


def _agree(error: BaseException | None, group: Any) -> BaseException | None:
    """This rank's ``error``, or, if only other ranks failed, an error saying so: every rank then has one."""
    failed = torch.tensor([0 if error is None else 1])
    dist.all_reduce(failed, group=group)
    if error is None and int(failed) > 0:
        return CheckpointFileError(f"{int(failed)} other rank(s) could not stage the checkpoint; see their error.")
    return error


class _Staged(AsyncStager):
    """Hands DCP a state dict that :class:`BackgroundWriter` has already staged."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for."""

    def close(self) -> None:
        """Nothing to release."""


class _ReusedStaging(AsyncStager):
    """DCP stager that copies the state into CPU buffers kept from the previous save when the layout is the same.

    DCP's own ``BlockingAsyncStager(cache_staged_state_dict=True)`` does this with pinned memory, which needs CUDA.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._layout: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        if self._cache is None or layout != self._layout:
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._layout = layout
        return _copy_state_dict(state_dict, self._cache)

    def synchronize_staging(self) -> None:
        """Staging is done when :meth:`stage` returns."""

    def close(self) -> None:
        """The buffers stay for the next save."""


def _layout(value: Any) -> Any:
    """The structure, shapes and dtypes of a state dict: equal layouts can share staging buffers."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return ("dtensor", tuple(value.shape), value.dtype, tuple(value.to_local().shape), tuple(value.placements))
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, Mapping):
        return tuple((k, _layout(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_layout(v) for v in value)
    return type(value).__name__


def is_rank0() -> bool:
    """This process is rank 0 (or there is no process group)."""
    return not dist.is_initialized() or dist.get_rank() == 0
