"""``load_pretrained``: a fine-tune's initial weights, read slice by slice into the sharded model."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_fsdp2.checkpoint import integrity
from lightning_fsdp2.checkpoint.files import CheckpointFileError
from lightning_fsdp2.checkpoint.module_load import load_through_model, uses_own_load_hooks
from lightning_fsdp2.checkpoint.plan import LoadPlan, align_prefixes, listing, plan_load, run_plan
from lightning_fsdp2.checkpoint.sources import (
    ConvertedSource,
    PretrainedSource,
    TensorSource,
    open_source,
    safetensors_files,
)
from lightning_fsdp2.quantize import NF4Weight, check_nf4_targets, check_quantize, nf4_targets, quantize_weights
from lightning_fsdp2.peft_support import adapter_names, adapter_tensors, canonical_name, is_adapter_key, peft_saved


@dataclass
class _LoadCall:
    """One ``load_pretrained``/``load_adapter`` call declared on a ``meta``-built model, as it was made."""

    module: nn.Module
    source: PretrainedSource
    strict: bool
    adapters_only: bool = False
    quantize: str | None = None
    skip: Sequence[str] = ()
    allow_cast: bool = False
    allow_non_finite: bool = False
    verify: bool = True


class DeferredLoads:
    """The ``load_pretrained``/``load_adapter`` calls made on a ``meta``-built model, kept by the strategy that builds
    it until its shards exist.

    A strategy makes one and holds it; while the model is built (``configure_model``, ``fabric.init_module()``) it is
    the current one (:meth:`collecting`), and the loads declared there are recorded in it, in order. After sharding,
    :meth:`take` hands the strategy the loads into one model, planned against its names at that point.
    """

    def __init__(self) -> None:
        self._loads: list[_LoadCall] = []

    @contextmanager
    def collecting(self) -> Generator[None, None, None]:
        """Record the loads declared while the block runs in this object."""
        token = _current.set(self)
        try:
            yield
        finally:
            _current.reset(token)

    def take(self, root: nn.Module) -> PlannedLoads:
        """Remove and plan the loads declared on ``root`` or its submodules, in the order they were declared: a later
        one (saved adapters, after the base model's weights) may cover tensors an earlier one also wrote (peft's
        ``modules_to_save`` copies start as the base layer's weights)."""
        prefixes = {id(sub): prefix for prefix, sub in root.named_modules()}
        mine = [load for load in self._loads if id(load.module) in prefixes]
        self._loads = [load for load in self._loads if id(load.module) not in prefixes]
        loads: list[PlannedLoad] = []
        for call in mine:
            source = open_source(call.source)
            source = source if call.adapters_only else with_conversions(call.module, source)
            # Unexpected keys were warned about when load_pretrained was called; once is enough.
            plan = check_pretrained(
                call.module, source, strict=call.strict, warn=False, adapters_only=call.adapters_only,
                allow_cast=call.allow_cast,
            )
            nf4 = nf4_targets(call.module, list(plan.copies), call.skip) if call.quantize else []
            loads.append(PlannedLoad(prefixes[id(call.module)], source, plan, nf4, call.allow_non_finite,
                                     call.verify))
        return PlannedLoads(loads)


_current: ContextVar[DeferredLoads | None] = ContextVar("lightning_fsdp2_deferred_loads", default=None)


def load_pretrained(
    module: nn.Module,
    source: PretrainedSource,
    *,
    strict: bool = True,
    quantize: str | None = None,
    skip: Sequence[str] = (),
    allow_cast: bool = False,
    allow_non_finite: bool = False,
    verify: bool = True,
) -> None:
    """Declare that ``module``'s initial weights come from ``source``; call it in ``configure_model``.

    Under ``FSDP2Strategy`` the module is on the ``meta`` device here, so the load is deferred: after the model is
    sharded and its shards materialized, each rank reads only the slices its shards hold (safetensors
    ``get_slice``, or an ``mmap``-ed ``torch.load``), with no broadcast from rank 0. Parameters it covers skip
    random initialization. When the module is real (one device, DDP, ``FSDP2Strategy(meta_init=False)``) the load
    happens at once, so the same ``LightningModule`` runs under every strategy.

    Names match whether ``module`` is wrapped by ``peft.get_peft_model`` before or after this call, and ``source``
    may hold a whole peft model's weights under peft's names, a base model's weights for a model with a head
    (``LlamaModel`` into ``LlamaForCausalLM``), or a Lightning checkpoint's. Values are cast to each parameter's
    dtype (one floating-point type to another; an integer or bool tensor into a floating-point parameter, or the
    reverse, is an error unless ``allow_cast``), and a parameter loaded with a NaN or an infinity in it is an error
    unless ``allow_non_finite`` (a start no training recovers from; checked on each rank's slice as it is read, in
    memory); tied weights stay tied; adapter parameters that ``source`` does not hold keep their fresh
    initialization, and so do persistent buffers it does not hold.

    Args:
        module: the model (or a submodule of it) to load into.
        source: a Hugging Face model directory (``model.safetensors``, or shards with
            ``model.safetensors.index.json``; ``pytorch_model*.bin``), a single ``.safetensors``, ``.bin``, ``.pt`` or
            Lightning ``.ckpt`` file, or a state dict.
        strict: raise on keys in ``source`` that fit nothing in the model (``False``: warn). Parameters that the
            source lacks (other than adapters) and shape mismatches always raise.
        quantize: ``"nf4"`` stores the weights of the model's ``nn.Linear`` layers in 4-bit NF4 (torchao's
            ``NF4Tensor``; QLoRA's base), quantized as they are read, one whole tensor at a time; not the output
            head, not peft's adapters. Embeddings and norms keep the model's dtype. The quantized weights are
            frozen (train adapters on them with peft). Needs ``pip install lightning-fsdp2[qlora]``.
        skip: with ``quantize``, modules to leave unquantized: names, or endings of names (``"down_proj"``,
            ``"layers.0.mlp"``), as transformers' ``modules_to_not_convert``.
        allow_cast: load integer or bool tensors into floating-point parameters (and the reverse), cast as
            ``Tensor.copy_`` casts them, instead of raising.
        allow_non_finite: load parameters holding NaN or infinite values as they are, instead of raising.
        verify: check the CRC-32s that our exports (``lightning-fsdp2-convert --to hf``, ``lora.save_adapter``)
            record in their safetensors headers before reading (files without them load as before).

    Raises:
        CheckpointFileError: listing missing or unexpected keys, or naming a key whose shapes differ, whose
            integer/bool and floating-point types differ, or whose values are not finite, or a file whose data does
            not match its recorded checksums (on every rank).
    """
    check_quantize(quantize, skip)
    declare_load(module, source, strict=strict, adapters_only=False, quantize=quantize, skip=tuple(skip),
                 allow_cast=allow_cast, allow_non_finite=allow_non_finite, verify=verify)


def declare_load(
    module: nn.Module,
    source: PretrainedSource,
    *,
    strict: bool,
    adapters_only: bool,
    quantize: str | None = None,
    skip: Sequence[str] = (),
    allow_cast: bool = False,
    allow_non_finite: bool = False,
    verify: bool = True,
) -> None:
    """:func:`load_pretrained`, and with ``adapters_only`` the loading of saved peft adapters (``lora.load_adapter``):
    then the source must cover every adapter parameter and need not cover the base model."""
    # Checked now, while the user is still in configure_model, so that a wrong path or model fails before any
    # sharding; planned again after sharding, when get_peft_model may have renamed and added parameters.
    raw = open_source(source)
    opened = raw if adapters_only else with_conversions(module, raw)
    deferred = any(p.is_meta for p in module.parameters())
    try:
        plan = check_pretrained(module, opened, strict=strict, adapters_only=adapters_only, deferred=deferred,
                                allow_cast=allow_cast)
    except CheckpointFileError:
        if deferred or adapters_only or quantize or not uses_own_load_hooks(module):
            raise
        # Names that do not fit, on a model that maps checkpoint keys itself (LitGPT's LoRA layers rename
        # `qkv.weight` to `qkv.linear.weight` in their `_load_from_state_dict`): load through torch's own
        # load_state_dict, so that the model's mapping, and torch's `strict`, decide as in one process.
        result = load_through_model(module, raw, strict=strict)
        loaded = {n for n, _ in module.state_dict().items()} - set(result.missing_keys)
        if not loaded:
            raise CheckpointFileError(
                f"Nothing in {raw.where(raw.keys()[0]) if raw.keys() else 'the source'} fits {type(module).__name__}:"
                f" every one of its tensors is missing from it, even through the model's own key mapping (e.g."
                f" {sorted(result.missing_keys)[:3]}). Check the path, and the names the model expects."
            ) from None
        if result.unexpected_keys:
            warnings.warn(
                f"{len(result.unexpected_keys)} key(s) of the source fit nothing in {type(module).__name__} and were"
                f" not loaded: {sorted(result.unexpected_keys)[:5]}", stacklevel=2)
        return
    if deferred:
        collector = _current.get()
        if collector is None:
            raise CheckpointFileError(
                f"{type(module).__name__} is on the meta device, but nothing will materialize it and run the load"
                " later: load_pretrained defers loads only in `configure_model` under FSDP2Strategy (with"
                " meta_init=True), or under `fabric.init_module()` with lightning_fsdp2.fabric.FSDP2Strategy. Build"
                " the model for real to load at once."
            )
        collector._loads.append(
            _LoadCall(module, source, strict, adapters_only, quantize, skip, allow_cast, allow_non_finite, verify))
        return
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    if verify:  # into shards (Fabric's load after set-up) every rank takes part, as in the load's check below; into a
        # real model each rank verifies the whole files itself, with no collective (one-device code may load on one
        # rank alone)
        integrity.verify_safetensors(safetensors_files(opened), together=sharded, turn_off=_TURN_OFF)
    nf4 = nf4_targets(module, list(plan.copies), skip) if quantize else []
    if nf4:  # built for real: quantized at once (the weights freeze now; peft freezes the base anyway)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        planned = PlannedLoads([PlannedLoad("", opened, plan, nf4, allow_non_finite)])
        planned.check_quantize(module, world, require_frozen=False)
        quantize_weights(planned.take_nf4(module))
    non_finite = run_plan(module, opened, plan, check_finite=not allow_non_finite)
    # Into shards (Fabric's load after set-up) each rank checked its own slices: every rank learns of them all. Into
    # whole tensors (one device, DDP) every rank read the same values.
    by_rank = dict(enumerate(_every_rank([non_finite]) if sharded else [[non_finite]]))
    by_rank = {rank: names[0] for rank, names in by_rank.items() if names[0]}
    if by_rank:
        raise CheckpointFileError(_non_finite_message(type(module).__name__, opened, plan, by_rank))


def check_pretrained(
    module: nn.Module,
    source: TensorSource,
    *,
    strict: bool,
    warn: bool = True,
    adapters_only: bool = False,
    deferred: bool = False,
    allow_cast: bool = False,
) -> LoadPlan:
    """Plan loading ``source`` into ``module`` by canonical (peft-agnostic) names; raise or warn on misfits.

    Required: every parameter but peft's adapters (a base model's weights), or with ``adapters_only`` every adapter
    parameter and nothing else (saved adapters). A ``deferred`` load is planned again when it runs: the source's
    adapter tensors may fit then (``get_peft_model`` after ``load_pretrained``), so they are not held against it
    now."""
    names = adapter_names(module)
    # A saved adapter directory names some tensors as peft's save_pretrained does, not as the model does; a whole
    # checkpoint (a Hugging Face model, a full state dict) uses the model's own names, and there peft's saved names
    # would collide with base weights (modules_to_save is saved under the original layer's name).
    saved_as, saved = peft_saved(module, names) if adapters_only else ({}, set())

    def source_name(key: str) -> str:
        name = canonical_name(key, names)
        return saved_as.get(name, name)

    targets = [canonical_name(n, names) for n, _ in module.named_parameters(remove_duplicate=False)]
    strip_source, strip_target = align_prefixes((source_name(k) for k in source.keys()), targets)

    def renamer(prefix: str, canonical: Callable[[str], str]) -> Callable[[str], str]:
        def rename(name: str) -> str:
            name = canonical(name)
            return name[len(prefix) :] if prefix and name.startswith(prefix) else name

        return rename

    plan = plan_load(
        module,
        source,
        rename_source=renamer(strip_source, source_name),
        rename_target=renamer(strip_target, lambda n: canonical_name(n, names)),
    )
    adapter_params = adapter_tensors(module)
    if adapters_only:
        # Required: what peft's save_pretrained writes. Tensors it leaves out (AdaLoRA's rank counter) keep their
        # initialization.
        missing = [n for n in plan.missing if n in adapter_params and (not saved or n in saved)]
        if not adapter_params:
            raise CheckpointFileError(
                f"{type(module).__name__} has no peft adapters to load saved adapters into. Wrap it with"
                " `get_peft_model(model, PeftConfig.from_pretrained(adapter_dir))` first."
            )
    else:
        fresh = adapter_params | {name for name, _ in module.named_buffers()}  # keep their init when not in source
        missing = [n for n in plan.missing if n not in fresh]
    adapter_keys = [k for k in plan.unexpected if is_adapter_key(canonical_name(k, names))]
    if deferred and not adapter_params:
        plan.unexpected = [k for k in plan.unexpected if k not in adapter_keys]
    problems = []
    if plan.mismatched:
        problems.append("shapes differ: " + "; ".join(plan.mismatched))
    if plan.mistyped and not allow_cast:
        problems.append(
            "integer or bool values would be cast into floating-point tensors, or the reverse: "
            + "; ".join(plan.mistyped[:10]) + (f" and {len(plan.mistyped) - 10} more" if len(plan.mistyped) > 10 else "")
            + " (the source's values would not survive the cast: check that it holds weights; pass allow_cast=True"
            " to load them cast)"
        )
    if missing:
        problems.append(f"{len(missing)} parameter(s) of the model are not in the source: {listing(missing)}")
    if plan.unexpected and strict:
        problems.append(
            f"{len(plan.unexpected)} key(s) in the source fit nothing in the model: {listing(plan.unexpected)}"
            " (pass strict=False to ignore them)"
        )
        if adapter_keys and not adapter_params:
            problems.append(
                f"{len(adapter_keys)} of them are peft adapter tensors and the model has no peft adapters: wrap it"
                " with get_peft_model (with the run's config) before the load runs, in configure_model"
            )
    if problems and isinstance(source, ConvertedSource):
        problems.append(source.describe())
    if problems and adapters_only:
        raise CheckpointFileError(
            f"Cannot load saved adapters into {type(module).__name__}: " + ". ".join(problems)
            + ". Build the adapter's configuration from its directory: PeftConfig.from_pretrained(adapter_dir) (which"
            " returns the saved LoraConfig, IA3Config, ...)."
        )
    if problems:
        raise CheckpointFileError(f"Cannot load pretrained weights into {type(module).__name__}: " + ". ".join(problems))
    if plan.unexpected and warn:
        warnings.warn(f"Ignoring {len(plan.unexpected)} key(s) that fit nothing in the model: {listing(plan.unexpected)}")
    return plan


def with_conversions(module: nn.Module, source: TensorSource) -> TensorSource:
    """``source`` as ``from_pretrained`` would read it into the Hugging Face model in ``module``: through the
    checkpoint conversions transformers registers for that model (see :class:`sources.ConvertedSource`), when they
    change any of its keys."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return source
    model = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
    if model is None:
        return source
    converted = ConvertedSource(source, model)
    return converted if converted.converts else source


@dataclass(frozen=True)
class PlannedLoad:
    """One load into a model, planned against its names: the submodule it loads into (its name in the model), the
    source, the plan (which source key fills which tensor), and the weights to store in NF4 (names in the submodule)."""

    prefix: str
    source: TensorSource
    plan: LoadPlan
    nf4: list[str]
    allow_non_finite: bool = False
    verify: bool = True


@dataclass
class PlannedLoads:
    """The deferred :func:`load_pretrained` calls found in a model (:meth:`DeferredLoads.take`), in order, planned
    against its current names; run once its shards exist."""

    loads: list[PlannedLoad]

    @property
    def covered(self) -> set[str]:
        """Names (relative to the model) of the tensors these loads will give values."""
        return {f"{load.prefix}.{n}" if load.prefix else n for load in self.loads for n in load.plan.copies}

    @property
    def nf4_names(self) -> set[str]:
        """Names (relative to the model) of the weights to be stored in NF4."""
        return {f"{load.prefix}.{n}" if load.prefix else n for load in self.loads for n in load.nf4}

    @property
    def quantizes(self) -> bool:
        """Some weights are to be stored in NF4 (``load_pretrained(..., quantize="nf4")``)."""
        return any(load.nf4 for load in self.loads)

    def check_quantize(self, root: nn.Module, world_size: int, require_frozen: bool = True) -> None:
        """Raise, before anything is read, for any weight the loads would quantize that NF4 cannot store here."""
        for load in self.loads:
            shapes = {n: tuple(load.source.shape(load.plan.copies[n])) for n in load.nf4}
            check_nf4_targets(root.get_submodule(load.prefix), load.nf4, shapes, world_size, require_frozen)

    def take_nf4(self, root: nn.Module, within: str = "") -> list[NF4Weight]:
        """The weights to store in NF4 that lie in ``root``'s submodule ``within`` (all of them by default), in file
        order, taken out of the plans: :func:`lightning_fsdp2.quantize.quantize_weights` gives them their values
        (the rest is copied by :meth:`run` once the shards exist)."""
        taken = []
        for load in self.loads:
            full = {name: f"{load.prefix}.{name}" if load.prefix else name for name in load.nf4
                    if name in load.plan.copies}
            mine = [n for n, f in full.items() if not within or f.startswith(f"{within}.")]
            for name in sorted(mine, key=lambda n: load.source.where(load.plan.copies[n])):
                taken.append(NF4Weight(root.get_submodule(load.prefix), name, load.source,
                                       load.plan.copies.pop(name), full[name]))
        return taken

    def run(self, root: nn.Module) -> None:
        """Read each rank's slices into its materialized shards; then, on every rank together, raise if any rank read
        a NaN or an infinity into a parameter (unless that load allows it), or failed to read. Call on every rank."""
        if not self.loads:
            return
        for load in self.loads:  # before anything is read; every rank verifies a share of the files, all raise alike
            if load.verify:
                integrity.verify_safetensors(safetensors_files(load.source), together=True, turn_off=_TURN_OFF)
        names: list[list[str]] = []
        error: BaseException | None = None
        try:
            for load in self.loads:
                names.append(run_plan(root.get_submodule(load.prefix), load.source, load.plan,
                                      check_finite=not load.allow_non_finite))
        except Exception as err:  # noqa: BLE001 - raised below, after every rank has heard of it (none waits)
            error = err
        every = _every_rank([names, None if error is None else f"{type(error).__name__}: {error}"])
        if error is not None:
            raise error
        failed = [(rank, said) for rank, (_, said) in enumerate(every) if said is not None]
        if failed:
            rank, said = failed[0]
            raise CheckpointFileError(f"Rank {rank} failed to load pretrained weights: {said}")
        for i, load in enumerate(self.loads):
            by_rank = {rank: found[i] for rank, (found, _) in enumerate(every) if found[i]}
            if by_rank:
                where = type(root.get_submodule(load.prefix)).__name__
                raise CheckpointFileError(_non_finite_message(where, load.source, load.plan, by_rank))


_TURN_OFF = "load_pretrained(..., verify=False), lora.load_adapter(..., verify=False)"


def _every_rank(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (a small collective; just ``[mine]`` without a process group)."""
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return [mine]
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return every


def _non_finite_message(model: str, source: TensorSource, plan: LoadPlan, by_rank: dict[int, list[str]]) -> str:
    names = sorted({n for names in by_rank.values() for n in names})
    shown = "; ".join(f"{n!r} (from {plan.copies[n]!r} in {source.where(plan.copies[n])})" for n in names[:5])
    ranks = ", ".join(str(r) for r in sorted(by_rank))
    return (
        f"Loaded NaN or infinite values into {len(names)} parameter(s) of {model}: {shown}"
        + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        + f" (found by rank(s) {ranks} in their slices). Training from them gives NaN losses: the file is damaged or"
        " was saved after a diverged step. Load another checkpoint, or pass allow_non_finite=True to load it as it is."
    )
