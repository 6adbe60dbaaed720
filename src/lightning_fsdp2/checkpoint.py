"""Values from checkpoints into the sharded model, and the model's state out to disk.

Two jobs, one primitive. *Loading pretrained weights* (:func:`load_pretrained`) and *resuming from a full
checkpoint* (:func:`load_full_state_dict`) both copy tensors from a file into parameters that are already sharded.
Both do it the same way: for each parameter, work out which slice of the whole tensor this rank's shard holds, read
only that slice from the file (safetensors ``get_slice`` or an ``mmap``-ed ``torch.load``), copy it into the local
shard. No rank ever holds the whole checkpoint, and no rank waits on another: there is no broadcast from rank 0.

*Saving* has two formats (``FSDP2Strategy(state_dict_type=...)``):

- ``"full"``: one Lightning checkpoint file written by rank 0, exactly what a single-device run writes (clean
  parameter names, optimizer state in ``torch.optim``'s index-keyed form). Tensors are gathered one at a time.
- ``"sharded"``: a directory written by ``torch.distributed.checkpoint`` (each rank its own shards) plus
  ``meta.pt`` with everything else Lightning saves. Resharding to another world size happens on load.

Every write goes to a temporary name beside the target and is renamed into place only when complete, so a process
killed mid-save leaves the previous checkpoint as it was. Every read is ``weights_only=True`` or safetensors.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "CheckpointError",
    "PretrainedSource",
    "atomic_save",
    "load_full_state_dict",
    "load_pretrained",
    "optimizer_state_by_index",
    "optimizer_state_by_name",
]

PretrainedSource = Union[str, os.PathLike, Mapping[str, Tensor]]
"""A Hugging Face model directory, a ``.safetensors``/``.bin``/``.pt``/``.ckpt`` file, or a state dict."""

META_FILENAME = "meta.pt"  # the same name Lightning's ModelParallelStrategy gives the non-tensor part
FORMAT_KEY = "lightning_fsdp2"  # what we add to a Lightning checkpoint: how it was written


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, or does not fit the model. The message names the file or the tensors."""


# =============================================================================================== reading tensors
class TensorSource(Protocol):
    """Named tensors that can be read a slice at a time."""

    def keys(self) -> list[str]: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def read(self, key: str, index: tuple[slice, ...]) -> Tensor: ...
    def where(self, key: str) -> str: ...
    def close(self) -> None: ...


class _StateDictSource:
    """Tensors already in memory, or ``mmap``-ed by ``torch.load(mmap=True)`` (slicing touches only those pages)."""

    def __init__(self, tensors: Mapping[str, Any], origin: str) -> None:
        self._tensors = {k: v for k, v in tensors.items() if isinstance(v, Tensor)}
        self._origin = origin

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        return self._tensors[key][index]

    def where(self, key: str) -> str:
        return self._origin

    def close(self) -> None:
        self._tensors = {}


class _SafetensorsSource:
    """One or more safetensors files, read a slice at a time.

    Each read maps the file, copies out only the requested slice and unmaps it again. Mapped pages count towards a
    process's resident memory for as long as the mapping lives; keeping one file mapped for the whole load would
    add up to this rank's share of that file on top of its shards. Re-opening costs one header parse per tensor.
    """

    def __init__(self, files: dict[str, Path]) -> None:
        from safetensors import safe_open

        self._files = files  # key -> file
        self._shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(set(files.values())):
            with _reading(path), safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                for key, where in files.items():
                    if where == path:
                        if key not in names:
                            raise CheckpointError(f"{path} does not hold {key!r}, which its index says it does.")
                        self._shapes[key] = tuple(f.get_slice(key).get_shape())

    def keys(self) -> list[str]:
        return list(self._files)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        from safetensors import safe_open

        path = self._files[key]
        with _reading(path), safe_open(str(path), framework="pt") as f:
            if not index:  # a 0-d tensor: nothing to slice
                return f.get_tensor(key)
            return f.get_slice(key)[index]

    def where(self, key: str) -> str:
        return str(self._files[key])

    def close(self) -> None:
        pass


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turn a failure to parse a file into an error that names it."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"Could not read {path}: {type(err).__name__}: {err}. The file may be truncated or corrupt (for"
            " example by an interrupted download or copy); replace it."
        ) from err


def open_source(source: PretrainedSource) -> TensorSource:
    """Open a state dict, a checkpoint file or a Hugging Face model directory for slice-wise reading."""
    if isinstance(source, Mapping):
        tensors = source.get("state_dict", source) if _is_lightning_checkpoint(source) else source
        return _StateDictSource(tensors, "the given state dict")
    path = Path(source)
    if path.is_dir():
        return _open_directory(path)
    if not path.exists():
        raise FileNotFoundError(f"No checkpoint at {path}.")
    if path.suffix == ".safetensors":
        return _SafetensorsSource(dict.fromkeys(_safetensors_keys(path), path))
    if path.name.endswith(".index.json"):
        return _open_index(path)
    loaded = load_torch_file(path)
    return _StateDictSource(loaded.get("state_dict", loaded) if _is_lightning_checkpoint(loaded) else loaded, str(path))


def _open_directory(path: Path) -> TensorSource:
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / name).is_file():
            return _open_index(path / name)
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (path / name).is_file():
            return open_source(path / name)
    for name in ("pytorch_model.bin", "adapter_model.bin"):
        if (path / name).is_file():
            return open_source(path / name)
    present = sorted(p.name for p in path.iterdir())[:10]
    raise FileNotFoundError(
        f"{path} holds no model weights: expected model.safetensors, model.safetensors.index.json,"
        f" pytorch_model.bin or pytorch_model.bin.index.json (found {present})."
    )


def _open_index(index: Path) -> TensorSource:
    with _reading(index):
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    files = {key: index.parent / name for key, name in weight_map.items()}
    missing = sorted({str(f) for f in files.values() if not f.is_file()})
    if missing:
        raise FileNotFoundError(f"{index} lists files that do not exist: {missing}.")
    if all(f.suffix == ".safetensors" for f in files.values()):
        return _SafetensorsSource(files)
    tensors: dict[str, Tensor] = {}
    for file in sorted(set(files.values())):
        tensors.update(load_torch_file(file))
    return _StateDictSource(tensors, str(index))


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with _reading(path), safe_open(str(path), framework="pt") as f:
        return [k for k in f.keys()]


def load_torch_file(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """``torch.load`` a file memory-mapped, with ``weights_only`` (no arbitrary unpickling), naming it on failure.

    ``mmap=True`` leaves tensors on disk until something reads them, so a rank that copies out only its shard's
    slices only ever reads those bytes.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No checkpoint file at {path}.")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception as err:
        if isinstance(err, __import__("pickle").UnpicklingError) and "weights_only" in str(err):
            raise CheckpointError(
                f"{path} contains objects that `torch.load(weights_only=True)` refuses to unpickle: {err}. If you"
                " trust the file, allow the named classes with `torch.serialization.add_safe_globals([...])`."
            ) from err
        raise CheckpointError(
            f"Could not read {path}: {type(err).__name__}: {err}. The file may be truncated or corrupt (for example"
            " by a save that was interrupted outside lightning-fsdp2, or a partial copy)."
        ) from err


def _is_lightning_checkpoint(obj: Mapping[str, Any]) -> bool:
    return isinstance(obj.get("state_dict"), Mapping) and "pytorch-lightning_version" in obj


# =============================================================================================== names
# peft renames a wrapped layer's weight (`q_proj.weight` -> `q_proj.base_layer.weight`), prefixes the model
# (`base_model.model.`) and keys adapters by adapter name (`lora_A.default.weight`; saved adapters drop the name).
# Comparing canonical names lets one checkpoint fit the model before and after `get_peft_model`.
_ADAPTER_CONTAINERS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "modules_to_save"}
)


def canonical_name(name: str, adapter_names: frozenset[str] = frozenset({"default"})) -> str:
    """``name`` without peft's wrapping: no ``base_model.model.`` prefix, ``base_layer``/``original_module``
    segments or adapter-name segments. A plain Hugging Face name is returned as it is."""
    parts = name.split(".")
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    out: list[str] = []
    for part in parts:
        if part in ("base_layer", "original_module"):
            continue
        if out and out[-1] in _ADAPTER_CONTAINERS and part in adapter_names:
            continue
        out.append(part)
    return ".".join(out)


def _is_adapter(canonical: str) -> bool:
    return any(part in _ADAPTER_CONTAINERS for part in canonical.split("."))


def _adapter_names(module: nn.Module) -> frozenset[str]:
    names = {"default"}
    for sub in module.modules():
        config = sub.__dict__.get("peft_config")
        if isinstance(config, Mapping):
            names.update(config)
    return frozenset(names)


# =============================================================================================== planning a load
@dataclass
class LoadPlan:
    """Which source tensor goes into which of the model's tensors (names relative to the module loaded into)."""

    copies: dict[str, str] = field(default_factory=dict)  # model name -> source key
    missing: list[str] = field(default_factory=list)  # model tensors the source does not cover
    unexpected: list[str] = field(default_factory=list)  # source keys that fit nothing in the model
    mismatched: list[str] = field(default_factory=list)  # descriptions of shape mismatches


def _loadable_tensors(module: nn.Module) -> dict[str, list[str]]:
    """Parameters and persistent buffers: first name -> all names it goes by (tied weights have several)."""
    aliases: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    non_persistent = {
        f"{prefix}.{b}" if prefix else b
        for prefix, sub in module.named_modules()
        for b in getattr(sub, "_non_persistent_buffers_set", ())
    }
    tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        if name in non_persistent:
            continue
        first.setdefault(id(tensor), name)
        aliases.setdefault(id(tensor), []).append(name)
    return {first[i]: names for i, names in aliases.items()}


def plan_load(module: nn.Module, source: TensorSource, *, rename: Callable[[str], str] | None = None) -> LoadPlan:
    """Match the source's keys to ``module``'s parameters and persistent buffers, checking shapes.

    ``rename`` maps both sides to the names compared (default: exact names). Non-persistent buffers are never
    loaded (no single-device checkpoint holds them), but a source that has them is not faulted for it.
    """
    rename = rename or (lambda name: name)
    index: dict[str, str] = {}
    for key in source.keys():
        index.setdefault(rename(key), key)
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    plan = LoadPlan()
    used: set[str] = set()
    for name, aliases in _loadable_tensors(module).items():
        wanted = [rename(a) for a in aliases]
        # A peft `modules_to_save` copy starts as the base module's weights when the source has no copy of its own.
        wanted += [".".join(p for p in w.split(".") if p != "modules_to_save") for w in wanted if "modules_to_save" in w]
        key = next((index[w] for w in wanted if w in index), None)
        if key is None:
            plan.missing.append(name)
            continue
        used.add(key)
        expected, found = tuple(tensors[name].shape), source.shape(key)
        if expected != found:
            plan.mismatched.append(
                f"{key!r} has shape {found} in {source.where(key)} but {name!r} has shape {expected} in the model"
            )
            continue
        plan.copies[name] = key
    ignorable = {rename(n) for n, _ in module.named_buffers(remove_duplicate=False)}  # non-persistent ones
    plan.unexpected = [k for k in source.keys() if k not in used and rename(k) not in ignorable]
    return plan


# =============================================================================================== copying into shards
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


def run_plan(module: nn.Module, source: TensorSource, plan: LoadPlan) -> None:
    """Copy every planned tensor into ``module``, in file order."""
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    try:
        for name, key in sorted(plan.copies.items(), key=lambda item: source.where(item[1])):
            copy_into(tensors[name], source, key)
    finally:
        source.close()


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# =============================================================================================== load_pretrained
_PENDING = "_fsdp2_pretrained"  # attribute on a meta-built module: the loads to run once it is sharded


@dataclass
class _PendingLoad:
    source: PretrainedSource
    strict: bool


def load_pretrained(module: nn.Module, source: PretrainedSource, *, strict: bool = True) -> None:
    """Declare that ``module``'s initial weights come from ``source``; call it in ``configure_model``.

    Under ``FSDP2Strategy`` the module is on the ``meta`` device here, so the load is deferred: after the model is
    sharded and its shards materialized, each rank reads only the slices its shards hold (safetensors
    ``get_slice``, or an ``mmap``-ed ``torch.load``). Parameters it covers skip random initialization. When the
    module is real (one device, DDP, ``FSDP2Strategy(meta_init=False)``) the load happens at once, so the same
    ``LightningModule`` runs under every strategy.

    Names match whether ``module`` is wrapped by ``peft.get_peft_model`` before or after this call, and ``source``
    may hold a whole peft model's weights under peft's names. Values are cast to each parameter's dtype; tied
    weights stay tied; LoRA adapter parameters that ``source`` does not hold keep their fresh initialization.

    Args:
        module: the model (or a submodule of it) to load into.
        source: a Hugging Face model directory (``model.safetensors``, or shards with
            ``model.safetensors.index.json``; ``pytorch_model*.bin``), a single ``.safetensors``, ``.bin``, ``.pt`` or
            Lightning ``.ckpt`` file, or a state dict.
        strict: raise on keys in ``source`` that fit nothing in the model (``False``: warn). Parameters that the
            source lacks (other than adapters) and shape mismatches always raise.

    Raises:
        CheckpointError: listing missing or unexpected keys, or naming a key whose shapes differ.
    """
    # Check now, while the user is still in configure_model, so a wrong path or model fails before any sharding.
    opened = open_source(source)
    plan = check_pretrained(module, opened, strict=strict)
    if any(p.is_meta for p in module.parameters()):
        opened.close()
        module.__dict__.setdefault(_PENDING, []).append(_PendingLoad(source, strict))
        return
    run_plan(module, opened, plan)


def check_pretrained(module: nn.Module, source: TensorSource, *, strict: bool, warn: bool = True) -> LoadPlan:
    """Plan loading ``source`` into ``module`` by canonical (peft-agnostic) names; raise or warn on misfits."""
    adapters = _adapter_names(module)
    plan = plan_load(module, source, rename=lambda name: canonical_name(name, adapters))
    missing = [n for n in plan.missing if not _is_adapter(canonical_name(n, adapters))]
    problems = []
    if plan.mismatched:
        problems.append("shapes differ: " + "; ".join(plan.mismatched))
    if missing:
        problems.append(f"{len(missing)} parameter(s) of the model are not in the source: {_listing(missing)}")
    if plan.unexpected and strict:
        problems.append(
            f"{len(plan.unexpected)} key(s) in the source fit nothing in the model: {_listing(plan.unexpected)}"
            " (pass strict=False to ignore them)"
        )
    if problems:
        raise CheckpointError(f"Cannot load pretrained weights into {type(module).__name__}: " + ". ".join(problems))
    if plan.unexpected and warn:
        warnings.warn(f"Ignoring {len(plan.unexpected)} key(s) that fit nothing in the model: {_listing(plan.unexpected)}")
    return plan


@dataclass
class PendingPretrained:
    """The deferred :func:`load_pretrained` calls found in a model, planned against its final (sharded) names."""

    loads: list[tuple[str, TensorSource, LoadPlan]]

    @property
    def covered(self) -> set[str]:
        """Names (relative to the model) of the tensors these loads will give values."""
        return {f"{prefix}.{n}" if prefix else n for prefix, _, plan in self.loads for n in plan.copies}

    def run(self, root: nn.Module) -> None:
        """Read each rank's slices into its materialized shards."""
        for prefix, source, plan in self.loads:
            run_plan(root.get_submodule(prefix), source, plan)
        for _, sub in root.named_modules():
            sub.__dict__.pop(_PENDING, None)


def pending_pretrained(root: nn.Module) -> PendingPretrained:
    """Collect and plan the loads that :func:`load_pretrained` deferred on ``root`` and its submodules.

    Planned again here, not when declared: ``get_peft_model`` may have renamed and added parameters since.
    """
    loads = []
    for prefix, sub in root.named_modules():
        # `__dict__`, not getattr: a PeftModel forwards unknown attributes to the model it wraps.
        for pending in sub.__dict__.get(_PENDING, []):
            source = open_source(pending.source)
            # Unexpected keys were warned about when load_pretrained was called; once is enough.
            loads.append((prefix, source, check_pretrained(sub, source, strict=pending.strict, warn=False)))
    return PendingPretrained(loads)


# =============================================================================================== full state dicts
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

    Used to resume from a ``"full"`` checkpoint at any world size: with the file ``mmap``-ed, every rank reads just
    the bytes its shards hold. ``may_be_missing(name)`` exempts parameters that the checkpoint is known to leave
    out (a trainable-only checkpoint leaves out the frozen base).
    """
    source = _StateDictSource(state_dict, origin)
    plan = plan_load(module, source)
    missing = [n for n in plan.missing if not (may_be_missing and may_be_missing(n))]
    problems = []
    if plan.mismatched:
        problems.append("shapes differ: " + "; ".join(plan.mismatched))
    if strict and missing:
        problems.append(f"{len(missing)} tensor(s) of the model are not in it: {_listing(missing)}")
    if strict and plan.unexpected:
        problems.append(f"{len(plan.unexpected)} key(s) in it fit nothing in the model: {_listing(plan.unexpected)}")
    if problems:
        raise CheckpointError(
            f"The checkpoint {origin} does not fit {type(module).__name__}: " + ". ".join(problems)
            + ". Was it saved from a different model or configuration?"
        )
    run_plan(module, source, plan)


# =============================================================================================== optimizer state
def optimizer_state_by_index(state: Mapping[str, Any]) -> dict[str, Any]:
    """Turn a name-keyed optimizer state dict (``torch.distributed.checkpoint``'s form) into ``torch.optim``'s
    index-keyed form, which single-device Lightning checkpoints hold. Indices follow the order of the parameters
    in the param groups, as ``Optimizer.state_dict()`` numbers them."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    groups = [{**group, "params": [index[n] for n in group["params"]]} for group in state["param_groups"]]
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(
    state: Mapping[str, Any], optimizer: torch.optim.Optimizer, module: nn.Module
) -> dict[str, Any]:
    """The inverse of :func:`optimizer_state_by_index` for ``optimizer``, whose parameters belong to ``module``."""
    names = {id(p): n for n, p in module.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = sum(len(group["params"]) for group in state["param_groups"])
    if saved != len(order) or len(state["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(
            f"The checkpoint's optimizer state covers {saved} parameters in {len(state['param_groups'])} group(s),"
            f" but the optimizer has {len(order)} in {len(optimizer.param_groups)}. Were different parameters"
            " trainable (or a different `configure_optimizers`) when it was saved?"
        )
    groups = [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": {order[int(i)]: value for i, value in state["state"].items()}, "param_groups": groups}


# =============================================================================================== saving and resuming
def model_state(module: nn.Module, *, sharded: bool, trainable_only: bool) -> dict[str, Any]:
    """The model's state dict with clean names, as a checkpoint holds it.

    ``sharded=True``: each rank's ``DTensor`` shards, for ``torch.distributed.checkpoint``. ``sharded=False``: whole
    tensors on CPU on rank 0 (empty elsewhere), gathered by :func:`gather_to_rank0`. ``trainable_only`` leaves out
    parameters with ``requires_grad=False``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=trainable_only))
    return state if sharded else gather_to_rank0(state)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool) -> dict[str, Any]:
    """The optimizer's state as a checkpoint holds it.

    ``sharded=True``: name-keyed ``DTensor`` shards. ``sharded=False``: whole tensors on CPU on rank 0 (empty
    elsewhere) in ``torch.optim``'s index-keyed form, the form a single-device run writes.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(module, optimizer)
    if sharded:
        return state
    full = gather_to_rank0(state)
    return optimizer_state_by_index(full) if full else {}


def gather_to_rank0(state: Any) -> Any:
    """Replace every ``DTensor`` in a (nested) state dict by its whole tensor on CPU, on rank 0 only.

    One tensor at a time: each rank sends its shard straight into rank 0's buffer for that tensor (point-to-point,
    not ``all_gather``), and rank 0 moves it to CPU memory before the next. So rank 0 holds what it will write plus one
    tensor in flight, and the other ranks hold nothing beyond their shards. (``get_model_state_dict(...,
    full_state_dict=True)`` all-gathers instead: every rank briefly holds each whole tensor, several times over.)
    Call on every rank, with the same structure; other ranks get an empty dict back.
    """
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    done: dict[int, Tensor | None] = {}  # tied weights: gathered once, and still one tensor in the file

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            if id(value) not in done:
                done[id(value)] = _gather_tensor(value, rank0)
            return done[id(value)]
        if isinstance(value, Mapping):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    gathered = walk(state)
    return gathered if rank0 else {}


def _gather_tensor(tensor: Tensor, rank0: bool) -> Tensor | None:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor.detach().cpu() if rank0 else None
    mesh = tensor.device_mesh
    if mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),) or tensor.ndim == 0 or tensor.shape[0] == 0:
        full = tensor.full_tensor()  # a layout FSDP2 does not make by default: the general (all-gather) path
        return full.cpu() if rank0 else None
    group, world = mesh.get_group(), mesh.size()
    rows = tensor.shape[0]
    chunk = math.ceil(rows / world)
    local = tensor.to_local().detach()
    if local.shape[0] != chunk:  # torch.chunk pieces: the last ranks may hold fewer rows; gather needs equal sizes
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        local = padded
    # Point-to-point into the pieces of rank 0's buffer: a `gather` would (on gloo) receive into a temporary of
    # the whole tensor first and copy from there.
    if not rank0:
        dist.send(local.contiguous(), dst=dist.get_global_rank(group, 0), group=group)
        return None
    buffer = torch.empty((world * chunk, *local.shape[1:]), dtype=local.dtype, device=local.device)
    pieces = buffer.chunk(world)
    pending = [dist.irecv(pieces[r], src=dist.get_global_rank(group, r), group=group) for r in range(1, world)]
    pieces[0].copy_(local)
    for request in pending:
        request.wait()
    full = buffer[:rows]
    if full.device.type != "cpu":
        return full.cpu()
    return full.clone() if world * chunk != rows else full  # a view would save the padding rows too


def save_sharded(checkpoint: Mapping[str, Any], path: Path) -> None:
    """Write a sharded checkpoint directory; call on every rank.

    Tensors (``state_dict``, ``optimizer_<i>``, the layout Lightning's ``ModelParallelStrategy`` uses) go through
    ``torch.distributed.checkpoint``, each rank writing its own shards; everything else goes to ``meta.pt``
    from rank 0. All of it is written into a temporary directory that replaces ``path`` only once complete.
    """
    import torch.distributed.checkpoint as dcp

    tensors = {"state_dict": checkpoint["state_dict"]}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.get("optimizer_states", []))})
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    rank0 = dist.get_rank() == 0
    token = [uuid.uuid4().hex[:8] if rank0 else None]
    dist.broadcast_object_list(token, src=0)  # every rank must write into the same temporary directory
    tmp = path.with_name(f".{path.name}.tmp-{token[0]}")
    try:
        dcp.save(tensors, checkpoint_id=tmp)
        if rank0:
            with open(tmp / META_FILENAME, "wb") as f:
                torch.save(meta, f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier()  # every rank's shards are on disk before the directory is moved into place
        if rank0:
            replace(tmp, path)
    finally:
        if rank0 and tmp.exists():
            shutil.rmtree(tmp)
    dist.barrier()


def read_sharded_meta(path: Path, weights_only: bool = True) -> dict[str, Any]:
    """Check a sharded checkpoint's files and return its non-tensor part (``meta.pt``).

    ``optimizer_states`` holds placeholders (``"optimizer_0"``...), one per optimizer whose state is in the
    directory: Lightning checks the key exists before it asks the strategy to load the states.
    """
    metadata = check_sharded_files(path)
    meta = load_torch_file(path / META_FILENAME, weights_only=weights_only)
    saved = {k.split(".", 1)[0] for k in metadata.state_dict_metadata if k.startswith("optimizer_")}
    if saved:
        meta["optimizer_states"] = sorted(saved, key=lambda k: int(k.split("_")[1]))
    return meta


def load_sharded_model(
    module: nn.Module, path: Path, *, strict: bool = True, may_be_missing: Callable[[str], bool] | None = None
) -> None:
    """Load the model part of a sharded checkpoint into ``module``, at any world size (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    metadata = check_sharded_files(path)
    saved = {
        k[len("state_dict.") :]: m
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("state_dict.") and isinstance(m, TensorStorageMetadata)
    }
    state = get_model_state_dict(module)
    missing = [k for k in state if k not in saved]
    unexpected = [k for k in saved if k not in state]
    mismatched = [
        f"{k!r} has shape {tuple(saved[k].size)} in the checkpoint but {tuple(state[k].shape)} in the model"
        for k in state
        if k in saved and tuple(saved[k].size) != tuple(state[k].shape)
    ]
    problems = []
    if mismatched:
        problems.append("shapes differ: " + "; ".join(mismatched))
    required = [k for k in missing if not (may_be_missing and may_be_missing(k))]
    if strict and required:
        problems.append(f"{len(required)} tensor(s) of the model are not in it: {_listing(required)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} key(s) in it fit nothing in the model: {_listing(unexpected)}")
    if problems:
        raise CheckpointError(
            f"The checkpoint {path} does not fit {type(module).__name__}: " + ". ".join(problems)
            + ". Was it saved from a different model or configuration?"
        )
    state = {k: v for k, v in state.items() if k in saved}
    dcp.load({"state_dict": state}, checkpoint_id=path)
    set_model_state_dict(module, state, options=StateDictOptions(strict=False))


def load_sharded_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, path: Path, index: int) -> None:
    """Load the state of the ``index``-th optimizer from a sharded checkpoint, at any world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    key = f"optimizer_{index}"
    metadata = check_sharded_files(path)
    if not any(k.startswith(f"{key}.") for k in metadata.state_dict_metadata):
        raise CheckpointError(f"The checkpoint {path} holds no state for optimizer {index}.")
    state = get_optimizer_state_dict(module, optimizer)  # creates the (sharded) state tensors to load into
    loaded = {key: state}
    dcp.load(loaded, checkpoint_id=path)
    set_optimizer_state_dict(module, optimizer, loaded[key])


# =============================================================================================== atomic writes
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
    one is first renamed aside (``.<name>.old-*``) and deleted only once the new one is in place.
    """
    if path.is_dir() or (new.is_dir() and path.exists()):
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        os.replace(new, path)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
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


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory written with ``state_dict_type="sharded"``."""
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / ".metadata").is_file()


def check_sharded_files(path: Path) -> Any:
    """Read a sharded checkpoint's index and check every file it points to is there and long enough.

    ``torch.distributed.checkpoint`` reports a short file deep inside a collective; checking sizes first names
    the file, on every rank, before any rank starts to load.
    """
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint: it has no '.metadata' file.")
    with _reading(path / ".metadata"):
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


def world_barrier() -> None:
    """Wait for all processes, if there is a process group."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
