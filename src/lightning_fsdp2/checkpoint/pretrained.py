"""``load_pretrained``: a fine-tune's initial weights, read slice by slice into the sharded model."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from lightning_fsdp2.checkpoint.files import CheckpointFileError
from lightning_fsdp2.checkpoint.module_load import load_through_model, uses_own_load_hooks
from lightning_fsdp2.checkpoint.plan import (
    LoadPlan,
    adapter_names,
    adapter_tensors,
    align_prefixes,
    canonical_name,
    is_adapter_key,
    listing,
    peft_saved,
    plan_load,
    run_plan,
)
from lightning_fsdp2.checkpoint.sources import ConvertedSource, PretrainedSource, TensorSource, open_source
from lightning_fsdp2.quantize import broadcast_nf4, check_nf4_targets, check_quantize, nf4_targets, put_in_place, to_nf4


@dataclass
class _PendingLoad:
    module: nn.Module
    source: PretrainedSource
    strict: bool
    adapters_only: bool = False
    quantize: str | None = None
    skip: Sequence[str] = ()


class DeferredLoads:
    """The ``load_pretrained``/``load_adapter`` calls made on a ``meta``-built model, kept by the strategy that builds
    it until its shards exist.

    A strategy makes one and holds it; while the model is built (``configure_model``, ``fabric.init_module()``) it is
    the current one (:meth:`collecting`), and the loads declared there are recorded in it, in order. After sharding,
    :meth:`take` hands the strategy the loads into one model, planned against its names at that point.
    """

    def __init__(self) -> None:
        self._loads: list[_PendingLoad] = []

    @contextmanager
    def collecting(self) -> Generator[None, None, None]:
        """Record the loads declared while the block runs in this object."""
        token = _current.set(self)
        try:
            yield
        finally:
            _current.reset(token)

    def take(self, root: nn.Module) -> PendingPretrained:
        """Remove and plan the loads declared on ``root`` or its submodules, in the order they were declared: a later
        one (saved adapters, after the base model's weights) may cover tensors an earlier one also wrote (peft's
        ``modules_to_save`` copies start as the base layer's weights)."""
        prefixes = {id(sub): prefix for prefix, sub in root.named_modules()}
        mine = [load for load in self._loads if id(load.module) in prefixes]
        self._loads = [load for load in self._loads if id(load.module) not in prefixes]
        loads: list[tuple[str, TensorSource, LoadPlan, list[str]]] = []
        for pending in mine:
            source = open_source(pending.source)
            source = source if pending.adapters_only else with_conversions(pending.module, source)
            # Unexpected keys were warned about when load_pretrained was called; once is enough.
            plan = check_pretrained(
                pending.module, source, strict=pending.strict, warn=False, adapters_only=pending.adapters_only
            )
            quantized = nf4_targets(pending.module, list(plan.copies), pending.skip) if pending.quantize else []
            loads.append((prefixes[id(pending.module)], source, plan, quantized))
        return PendingPretrained(loads)


_current: ContextVar[DeferredLoads | None] = ContextVar("lightning_fsdp2_deferred_loads", default=None)


def load_pretrained(
    module: nn.Module,
    source: PretrainedSource,
    *,
    strict: bool = True,
    quantize: str | None = None,
    skip: Sequence[str] = (),
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
    dtype; tied weights stay tied; adapter parameters that ``source`` does not hold keep their fresh
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

    Raises:
        CheckpointFileError: listing missing or unexpected keys, or naming a key whose shapes differ.
    """
    check_quantize(quantize, skip)
    declare_load(module, source, strict=strict, adapters_only=False, quantize=quantize, skip=tuple(skip))


def declare_load(
    module: nn.Module,
    source: PretrainedSource,
    *,
    strict: bool,
    adapters_only: bool,
    quantize: str | None = None,
    skip: Sequence[str] = (),
) -> None:
    """:func:`load_pretrained`, and with ``adapters_only`` the loading of saved peft adapters (``lora.load_adapter``):
    then the source must cover every adapter parameter and need not cover the base model."""
    # Checked now, while the user is still in configure_model, so that a wrong path or model fails before any
    # sharding; planned again after sharding, when get_peft_model may have renamed and added parameters.
    raw = open_source(source)
    opened = raw if adapters_only else with_conversions(module, raw)
    deferred = any(p.is_meta for p in module.parameters())
    try:
        plan = check_pretrained(module, opened, strict=strict, adapters_only=adapters_only, deferred=deferred)
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
        collector._loads.append(_PendingLoad(module, source, strict, adapters_only, quantize, skip))
        return
    quantized = nf4_targets(module, list(plan.copies), skip) if quantize else []
    if quantized:  # built for real: quantized at once (the weights freeze now; peft freezes the base anyway)
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        pending = PendingPretrained([("", opened, plan, quantized)])
        pending.check_quantize(module, world, require_frozen=False)
        pending.quantize(module)
    run_plan(module, opened, plan)


def check_pretrained(
    module: nn.Module,
    source: TensorSource,
    *,
    strict: bool,
    warn: bool = True,
    adapters_only: bool = False,
    deferred: bool = False,
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


@dataclass
class PendingPretrained:
    """The deferred :func:`load_pretrained` calls found in a model, planned against its current names: per load, the
    submodule's name, the source, the plan, and the weights to store in NF4."""

    loads: list[tuple[str, TensorSource, LoadPlan, list[str]]]
    quantized_so_far: int = 0
    """How many weights :meth:`quantize` has stored in NF4: the turns of the ranks go on from group to group."""

    @property
    def covered(self) -> set[str]:
        """Names (relative to the model) of the tensors these loads will give values."""
        return {f"{prefix}.{n}" if prefix else n for prefix, _, plan, _ in self.loads for n in plan.copies}

    def check_quantize(self, root: nn.Module, world_size: int, require_frozen: bool = True) -> None:
        """Raise, before anything is read, for any weight the loads would quantize that NF4 cannot store here."""
        for prefix, source, plan, names in self.loads:
            shapes = {n: tuple(source.shape(plan.copies[n])) for n in names}
            check_nf4_targets(root.get_submodule(prefix), names, shapes, world_size, require_frozen)

    def quantize(self, root: nn.Module, within: str = "", device: torch.device | None = None) -> set[str]:
        """Store in NF4 now, before sharding, the weights the loads quantize that lie in ``root``'s submodule
        ``within`` (all of them by default; see :mod:`lightning_fsdp2.quantize`): each read whole, one at a time, cast,
        quantized, put in place of its parameter; they leave the plans (the rest is copied by :meth:`run` once the
        shards exist). Call :meth:`check_quantize` first. Returns their names relative to ``root``.

        With a ``device``, on every rank of the process group together: rank r reads and quantizes the weights r,
        r + N, r + 2N... (in file order, counted on from earlier calls) and each is broadcast from the rank that made
        it, so every rank ends with the same whole NF4 tensors for 1/N of the reading and quantizing (which, at 7B,
        is most of the set-up)."""
        chosen = []
        for prefix, source, plan, names in self.loads:
            full = {name: f"{prefix}.{name}" if prefix else name for name in names if name in plan.copies}
            mine = [n for n, f in full.items() if not within or f.startswith(f"{within}.")]
            for name in sorted(mine, key=lambda n: source.where(plan.copies[n])):
                chosen.append((root.get_submodule(prefix), name, source, plan.copies.pop(name), full[name]))
        if not chosen:  # the same on every rank: a group (or a model) with nothing to quantize needs no collective
            return set()
        shared = device is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if shared else (0, 1)
        made = {}  # this rank's share, quantized first: the ranks then work at the same time
        failure: BaseException | None = None
        try:
            for i, (sub, name, source, key, _) in enumerate(chosen, start=self.quantized_so_far):
                if i % world == rank:
                    whole = source.read(key, tuple(slice(None) for _ in source.shape(key)))
                    made[i] = to_nf4(sub.get_parameter(name), whole)
                    del whole  # one weight in high precision at a time
        except BaseException as err:  # noqa: BLE001 - raised below, on every rank together
            failure = err
        if shared:
            # A rank that failed would never broadcast its share: the others would wait for it until the timeout.
            failed = torch.tensor([failure is not None], dtype=torch.int32, device=device)
            torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
            if failed.item() and failure is None:
                raise RuntimeError(
                    "load_pretrained(quantize='nf4'): another rank failed to read or quantize its share of the weights"
                    " (its own error is in its output); nothing was sharded."
                )
        if failure is not None:
            raise failure
        for i, (sub, name, _, _, _) in enumerate(chosen, start=self.quantized_so_far):
            quantized = broadcast_nf4(made.pop(i, None), i % world, device) if shared else made.pop(i)
            put_in_place(sub, name, quantized)
        self.quantized_so_far += len(chosen)
        return {full for *_, full in chosen}

    def run(self, root: nn.Module) -> None:
        """Read each rank's slices into its materialized shards."""
        for prefix, source, plan, _ in self.loads:
            run_plan(root.get_submodule(prefix), source, plan)
