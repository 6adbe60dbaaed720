"""The two checkpoint formats, saved and resumed at any world size: ``"full"`` (one file) and ``"sharded"`` (DCP).

These are the functions ``FSDP2Strategy``'s checkpoint hooks call: :func:`save`, :func:`load`, :func:`load_model`,
:func:`load_optimizers`.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_fsdp2.checkpoint.background import BackgroundWriter, is_rank0, swap_into_place
from lightning_fsdp2.checkpoint import integrity, safe_dcp
from lightning_fsdp2.checkpoint.safe_dcp import check_sharded_files
from lightning_fsdp2.checkpoint.files import (
    FORMAT_KEY,
    META_FILENAME,
    CheckpointFileError,
    check_replaceable,
    delete,
    is_local,
    load_torch_file,
    on_every_rank,
    on_rank0,
    raise_together,
    temporary_path,
    write_error,
    writing,
)
from lightning_fsdp2.checkpoint.optimizer_keys import optimizer_state_by_index, optimizer_state_by_name
from lightning_fsdp2.checkpoint.plan import listing, plan_load, run_plan
from lightning_fsdp2.checkpoint.shards import gather_to_rank0, local_slice
from lightning_fsdp2.checkpoint.sources import StateDictSource
from lightning_fsdp2.checkpoint.stream import save_streamed, sharded_entries

class LoadedCheckpoint(dict):
    """A checkpoint as :func:`load` returns it: the dict Lightning restores from, and where it was read from
    (``path``; ``sharded``: its tensors are still in that directory, read into the shards by :func:`load_model`,
    :func:`load_optimizers` and :func:`load_entry`). The origin travels with the dict, not inside it."""

    def __init__(self, checkpoint: Mapping[str, Any], path: str, sharded: bool) -> None:
        super().__init__(checkpoint)
        self.path, self.sharded = path, sharded


def _sharded_dir(checkpoint: Mapping[str, Any]) -> Path | None:
    return Path(checkpoint.path) if isinstance(checkpoint, LoadedCheckpoint) and checkpoint.sharded else None


def _origin(checkpoint: Mapping[str, Any]) -> str:
    return checkpoint.path if isinstance(checkpoint, LoadedCheckpoint) else "the checkpoint"


# =============================================================================================== what is saved
def model_state(module: nn.Module, *, trainable_only: bool) -> dict[str, Any]:
    """The model's state dict with clean names, as each rank's ``DTensor`` shards (plain tensors for what is not
    sharded). ``trainable_only`` leaves out parameters with ``requires_grad=False``.

    Both formats start from this: a sharded save writes the shards as they are, a full save gathers them to rank 0
    one tensor at a time while it writes (:func:`save`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=trainable_only))


def optimizer_state(module: nn.Module, optimizer: Optimizer, *, sharded: bool) -> dict[str, Any]:
    """The optimizer's state as ``DTensor`` shards: name-keyed for a sharded save (``torch.distributed.checkpoint``'s
    form), or in ``torch.optim``'s index-keyed form for a full save, the form a single-device run writes (the shards
    are gathered while the file is written)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer)
    return state if sharded else optimizer_state_by_index(state)


# =============================================================================================== saving
def save(
    checkpoint: dict[str, Any],
    path: str,
    *,
    sharded: bool,
    trainable_only: bool,
    world_size: int,
    checkpoint_io: Any,
    storage_options: Any = None,
    tied: Mapping[str, Mapping[str, str]] | None = None,
    background: BackgroundWriter | None = None,
) -> None:
    """Write a checkpoint atomically; call on every rank, with the same ``path``.

    ``checkpoint`` is a Lightning checkpoint (``state_dict``, ``optimizer_states``...) or any dict whose entries may
    hold ``DTensor`` shards (a Fabric checkpoint: one entry per module and optimizer): entries holding shards are
    gathered (full) or written by each rank (sharded), the rest is written by rank 0.

    ``sharded=False``: one file, streamed by rank 0 as the tensors arrive (:func:`stream.save_streamed`), or through
    the user's own ``CheckpointIO`` (or for a remote path) after gathering everything to rank 0. ``sharded=True``: a
    directory (:func:`save_sharded`), written by ``background`` when given. ``tied``: for a model's entry, the keys of
    tied weights (saved once). A plain full checkpoint gets no extra key, so it is exactly what a
    single-device run writes; the others record how they were written.
    """
    from lightning.fabric.plugins import TorchCheckpointIO

    if sharded or trainable_only:
        checkpoint[FORMAT_KEY] = {
            "state_dict_type": "sharded" if sharded else "full",
            "trainable_only": trainable_only,
            "world_size": world_size,
        }
    if sharded:
        if storage_options is not None or not is_local(path):
            raise CheckpointFileError(
                f"Sharded checkpoints are written to a local or mounted directory; got {path!r}"
                + (" with storage_options" if storage_options is not None else "")
                + ". Save to a local path, or use state_dict_type='full' with a CheckpointIO plugin."
            )
        save_sharded(checkpoint, Path(path), background=background)
        return
    if type(checkpoint_io) is TorchCheckpointIO and is_local(path):
        save_streamed(checkpoint, path, tied=tied)
        return
    # The user's own CheckpointIO plugin, or a remote path: Lightning's writer needs the whole dict in memory.
    if is_local(path):
        on_rank0(lambda: check_replaceable(path), f"save to {path}")  # before any work, as for our own writer
    if "state_dict" in checkpoint:
        checkpoint["state_dict"] = gather_to_rank0(checkpoint["state_dict"], same_as=(tied or {}).get("state_dict"))
    if "optimizer_states" in checkpoint:
        checkpoint["optimizer_states"] = [gather_to_rank0(s) for s in checkpoint["optimizer_states"]]
    for key in sharded_entries(checkpoint):
        checkpoint[key] = gather_to_rank0(checkpoint[key], same_as=(tied or {}).get(key))
    on_rank0(lambda: checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options), "save")


def save_sharded(checkpoint: Mapping[str, Any], path: Path, *, background: BackgroundWriter | None = None) -> None:
    """Write a sharded checkpoint directory; call on every rank.

    Tensors (``state_dict``, ``optimizer_<i>``, the layout Lightning's ``ModelParallelStrategy`` uses) go through
    ``torch.distributed.checkpoint``, each rank writing its own shards; everything else goes to ``meta.pt`` from
    rank 0. All of it is written into a temporary directory that replaces ``path`` only once complete; a failure on
    any rank removes it and raises on every rank.

    Each rank writes to the ``path`` it is given: the same on every rank is one directory. A path of its own on each
    rank (the strategies pass them under Ray Train, whose ``RayTrainReportCallback`` gives every worker a temporary
    directory and merges what the workers report into one checkpoint) holds that rank's shards, rank 0's also the
    index and ``meta.pt``: together they are the checkpoint, and a load of one alone names the shards it lacks.

    With ``background`` (a :class:`BackgroundWriter`), the shards are copied to CPU memory now and written by a
    background thread; this returns at once, and ``background.wait()`` (on every rank) completes the save.
    """
    import torch.distributed.checkpoint as dcp

    entries = sharded_entries(checkpoint)
    tensors = {"state_dict": checkpoint["state_dict"]} if "state_dict" in checkpoint else {}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.get("optimizer_states", []))})
    tensors.update({key: checkpoint[key] for key in entries})
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", *entries)}
    if entries:  # where they went: read back with `load_entry`
        meta[FORMAT_KEY] = {**meta.get(FORMAT_KEY, {}), "entries": entries}
    # One exchange: every rank's path (the lowest rank on a path checks, makes and swaps it in) and rank 0's token
    # (the same temporary name everywhere).
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (str(path), uuid.uuid4().hex[:8]))
    owner = [p for p, _ in gathered].index(str(path)) == dist.get_rank()
    tmp = temporary_path(path, gathered[0][1])

    def prepare() -> None:  # before any rank writes a byte: refuse a target that is not ours
        if not owner:
            return
        check_replaceable(path)
        tmp.mkdir(parents=True)
        if is_rank0():
            with writing(tmp / META_FILENAME, what=str(path)), open(tmp / META_FILENAME, "wb") as f:
                torch.save(meta, f)
                f.flush()
                os.fsync(f.fileno())

    try:
        on_every_rank(prepare, f"start the sharded checkpoint {path}")
    except BaseException:
        if owner:
            delete(tmp)
        raise
    # Each shard a torch.save archive, torch's CRC-32s in it; the index (a raw pickle) gets one appended.
    writer = integrity.IndexChecksumWriter(tmp, overwrite=True)
    if background is not None:
        background.start(tensors, writer, tmp, path, owner=owner)
        return
    error: BaseException | None = None
    try:
        dcp.save(tensors, storage_writer=writer)  # collective; DCP raises on every rank if any rank fails
    except BaseException as err:  # noqa: BLE001 - raised below on every rank, with rank 0's message
        error = write_error(err, tmp, what=str(path))
        if owner:
            delete(tmp)  # our partial output
    raise_together(error, f"write the sharded checkpoint {path}")
    on_every_rank(lambda: swap_into_place(tmp, path) if owner else None, f"finish the sharded checkpoint {path}")


def has_entry(checkpoint: Mapping[str, Any], key: str) -> bool:
    """Whether ``checkpoint`` (as :func:`load` returns it) holds the state dict ``key``, in either format."""
    if _sharded_dir(checkpoint) is not None:
        return key in checkpoint.get(FORMAT_KEY, {}).get("entries", [])
    return key in checkpoint


def load_entry(
    module: nn.Module,
    checkpoint: Mapping[str, Any],
    key: str,
    *,
    strict: bool = True,
    initialized: Set[str] = frozenset(),
) -> None:
    """Load the state dict saved under ``key`` (a full one, or shards in a sharded directory) into ``module``'s
    (sharded) tensors, each rank its slices, at any world size. A trainable-only checkpoint may leave out the
    frozen parameters, as for the model's own state (see :func:`load_model` for ``initialized``)."""
    may_be_missing = _trainable_only_exemption(module, checkpoint, initialized)
    directory = _sharded_dir(checkpoint)
    if directory is not None:
        load_sharded_model(module, directory, key=key, strict=strict, may_be_missing=may_be_missing)
    else:
        load_full_state_dict(module, checkpoint[key], strict=strict, may_be_missing=may_be_missing,
                             origin=f"{_origin(checkpoint)} ({key!r})")


def load_optimizer_entry(module: nn.Module, optimizer: Optimizer, checkpoint: Mapping[str, Any], key: str) -> None:
    """Load the optimizer state saved under ``key`` (index-keyed in a full checkpoint, shards in a sharded
    directory) into ``optimizer``, whose parameters belong to ``module``, at any world size."""
    directory = _sharded_dir(checkpoint)
    if directory is not None:
        load_sharded_optimizer(module, optimizer, directory, key)
    else:
        load_full_optimizer(module, optimizer, checkpoint[key])


def _trainable_only_exemption(
    module: nn.Module, checkpoint: Mapping[str, Any], initialized: Set[str]
) -> Callable[[str], bool] | None:
    """For a trainable-only checkpoint, which it leaves out (the frozen parameters, which ``load_pretrained`` must
    have loaded already); a warning when some of those got random values instead."""
    if not checkpoint.get(FORMAT_KEY, {}).get("trainable_only"):
        return None
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    at_random = sorted(frozen & set(initialized))
    if at_random:
        warnings.warn(
            "This checkpoint holds only trainable parameters; the frozen ones keep the values they have now, and"
            f" no load_pretrained call gave {len(at_random)} of them any ({listing(at_random)}): they are at"
            " random. Call load_pretrained(...) where the model is built (configure_model, fabric.init_module)."
        )
    return frozen.__contains__


# =============================================================================================== resuming
def load(path: str, *, weights_only: bool | None, checkpoint_io: Any, verify: bool = True) -> LoadedCheckpoint:
    """Read a checkpoint of either format; tensors stay on disk (``mmap``) until loaded into the shards. Call on
    every rank.

    ``weights_only`` defaults to ``True``: nothing but tensors and plain containers is unpickled. A sharded
    checkpoint returns its ``meta.pt`` with placeholders: its tensors are read by :func:`load_model` and
    :func:`load_optimizers`, straight into the shards. ``verify``: first check the checksums written with it
    (:mod:`.integrity`; the ranks share the reading), raising on every rank if any data differs.
    """
    from lightning.fabric.plugins import TorchCheckpointIO

    weights_only = True if weights_only is None else weights_only
    if not is_local(path) or type(checkpoint_io) is not TorchCheckpointIO:
        return LoadedCheckpoint(checkpoint_io.load_checkpoint(path, weights_only=weights_only), str(path), False)
    if verify:
        if Path(path).is_dir():
            integrity.verify_index(path, together=True)  # before anything reads the index
            check_sharded_files(Path(path))  # a short or missing file is named as such first
        integrity.verify(path, together=True, index=False)
    if Path(path).is_dir():
        return LoadedCheckpoint(read_sharded_meta(Path(path), weights_only=weights_only), str(path), True)
    return LoadedCheckpoint(load_torch_file(path, weights_only=weights_only), str(path), False)


def read_sharded_meta(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """Check a sharded checkpoint's files and return its non-tensor part (``meta.pt``).

    ``optimizer_states`` holds placeholders (``"optimizer_0"``...), one per optimizer whose state is in the
    directory: Lightning checks the key exists before it asks the strategy to load the states.
    """
    metadata = check_sharded_files(path)
    if not (path / META_FILENAME).is_file():
        raise CheckpointFileError(
            f"The sharded checkpoint {path} is incomplete: it has the tensors' index but no {META_FILENAME} (the"
            " loops, callbacks and hyper-parameters). It was not written by a completed save; resume from another."
        )
    checkpoint = load_torch_file(path / META_FILENAME, weights_only=weights_only)
    saved = {k.split(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith("optimizer_")}
    if saved:
        checkpoint["optimizer_states"] = sorted(saved, key=lambda k: int(k.split("_")[1]))
    return checkpoint


def load_model(
    module: nn.Module, checkpoint: Mapping[str, Any], *, strict: bool = True, initialized: Set[str] = frozenset()
) -> None:
    """Load the model's weights from a checkpoint of either format into its shards, at any world size.

    ``initialized``: names of the tensors that got random values when the model was built (not loaded): a
    trainable-only checkpoint that leaves frozen ones among them out gets a warning."""
    may_be_missing = _trainable_only_exemption(module, checkpoint, initialized)
    directory = _sharded_dir(checkpoint)
    if directory is not None:
        load_sharded_model(module, directory, strict=strict, may_be_missing=may_be_missing)
    else:
        load_full_state_dict(module, checkpoint["state_dict"], strict=strict, may_be_missing=may_be_missing,
                             origin=_origin(checkpoint))


def load_optimizers(module: nn.Module, optimizers: Sequence[Optimizer], checkpoint: Mapping[str, Any]) -> None:
    """Load each optimizer's state into its sharded state, from either format, at any world size."""
    states = checkpoint.get("optimizer_states", [])
    if len(states) != len(optimizers):
        raise CheckpointFileError(
            f"The checkpoint holds state for {len(states)} optimizer(s), but `configure_optimizers` returned"
            f" {len(optimizers)}. Resume with the same optimizers."
        )
    directory = _sharded_dir(checkpoint)
    for i, (optimizer, state) in enumerate(zip(optimizers, states)):
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        if directory is not None:
            load_sharded_optimizer(module, optimizer, directory, f"optimizer_{i}")
        else:
            load_full_optimizer(module, optimizer, state)


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    may_be_missing: Callable[[str], bool] | None = None,
    origin: str = "the checkpoint",
) -> None:
    """Load a full (unsharded) state dict into a sharded or plain ``module``: each rank copies only its slices.

    With the file ``mmap``-ed, every rank reads just the bytes its shards hold. ``may_be_missing(name)`` exempts
    parameters the checkpoint is known to leave out (a trainable-only checkpoint leaves out the frozen base).
    """
    source = StateDictSource(state_dict, origin)
    plan = plan_load(module, source)
    missing = [n for n in plan.missing if not (may_be_missing and may_be_missing(n))]
    _raise_if_misfit(module, origin, plan.mismatched + plan.mistyped, missing if strict else [],
                     plan.unexpected if strict else [])
    run_plan(module, source, plan)


@contextmanager
def _gradients_aside(optimizer: Optimizer) -> Iterator[None]:
    """Parameters without gradients while the block runs, theirs back afterwards. DCP's `get_optimizer_state_dict`
    creates the state tensors of an optimizer that has not stepped by a step of zero gradients, and silently skips
    that when any parameter holds a gradient: a model a previous `fit` trained (Lightning zeroes gradients before each
    backward, not after the step) given to a new optimizer would then load no state at all."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for param in params:
        param.grad = None
    try:
        yield
    finally:
        for param, grad in zip(params, grads):
            param.grad = grad


@torch.no_grad()
def load_full_optimizer(module: nn.Module, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
    """Load a full (index-keyed) optimizer state into the optimizer's sharded state: each rank copies its slices."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    saved = optimizer_state_by_name(state, optimizer, module)
    with _gradients_aside(optimizer):
        target = get_optimizer_state_dict(module, optimizer)  # sharded; creates the state tensors to load into
    for name, slots in target["state"].items():
        if name not in saved["state"]:
            continue  # never stepped when saved: the optimizer creates its state at the first step, as it would
        for slot, tensor in slots.items():
            value = saved["state"][name].get(slot)
            if not isinstance(value, Tensor) or tuple(value.shape) != tuple(tensor.shape):
                found = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise CheckpointFileError(
                    f"The optimizer state {slot!r} of {name!r} is {found} in the checkpoint but"
                    f" {tuple(tensor.shape)} in the optimizer. Resume with the optimizer that saved it."
                )
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if local.numel():
                local.copy_(value[local_slice(tensor)])
    target["param_groups"] = saved["param_groups"]
    target["state"] = {n: s for n, s in target["state"].items() if n in saved["state"]}
    set_optimizer_state_dict(module, optimizer, target)


def load_sharded_model(
    module: nn.Module,
    path: Path,
    *,
    strict: bool = True,
    may_be_missing: Callable[[str], bool] | None = None,
    key: str = "state_dict",
) -> None:
    """Load the model part (or the state dict saved under ``key``) of a sharded checkpoint into ``module``, at any
    world size (DCP reshards)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    metadata = check_sharded_files(path)
    saved = {
        k[len(key) + 1 :]: m
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(f"{key}.") and isinstance(m, TensorStorageMetadata)
    }
    state = get_model_state_dict(module)
    missing = [k for k in state if k not in saved and not (may_be_missing and may_be_missing(k))]
    unexpected = [k for k in saved if k not in state]
    mismatched = [
        f"{k!r} has shape {tuple(saved[k].size)} in the checkpoint but {tuple(state[k].shape)} in the model"
        for k in state
        if k in saved and tuple(saved[k].size) != tuple(state[k].shape)
    ]
    _raise_if_misfit(module, str(path), mismatched, missing if strict else [], unexpected if strict else [])
    state = {k: v for k, v in state.items() if k in saved}
    safe_dcp.load({key: state}, path)  # dcp.load with a reader and planner that unpickle no code
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))


def load_sharded_optimizer(module: nn.Module, optimizer: Optimizer, path: Path, key: str) -> None:
    """Load the optimizer state saved under ``key`` (``optimizer_<i>`` in a Lightning checkpoint) from a sharded
    checkpoint, at any world size."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    metadata = check_sharded_files(path)
    if not any(k.startswith(f"{key}.") for k in metadata.state_dict_metadata):
        raise CheckpointFileError(
            f"The checkpoint {path} holds no optimizer state {key!r} (saved with `weights_only`?). Resume from a"
            " checkpoint with optimizer state, or load only the weights."
        )
    with _gradients_aside(optimizer):
        state = get_optimizer_state_dict(module, optimizer)  # creates the (sharded) state tensors to load into
    loaded = {key: state}
    safe_dcp.load(loaded, path)  # dcp.load with a reader and planner that unpickle no code
    set_optimizer_state_dict(module, optimizer, loaded[key])


def _raise_if_misfit(
    module: nn.Module, origin: str, mismatched: list[str], missing: list[str], unexpected: list[str]
) -> None:
    problems = []
    if mismatched:
        problems.append("shapes or types differ: " + "; ".join(mismatched))
    if missing:
        problems.append(f"{len(missing)} tensor(s) of the model are not in it: {listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} key(s) in it fit nothing in the model: {listing(unexpected)}")
    if problems:
        raise CheckpointFileError(
            f"The checkpoint {origin} does not fit {type(module).__name__}: " + ". ".join(problems)
            + ". Was it saved from a different model or configuration?"
        )
