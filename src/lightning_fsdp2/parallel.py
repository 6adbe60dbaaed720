"""The model's road from a ``meta``-built module to initialized shards, with no front-end in it.

Both strategies call these functions: :class:`lightning_fsdp2.FSDP2Strategy` (the ``Trainer``'s, from ``setup``) and
:class:`lightning_fsdp2.fabric.FSDP2Strategy` (Fabric's, from ``setup_module``). Everything a step needs arrives as an
argument and everything it finds out is returned; nothing is stored on the user's modules.

:func:`parallelize` is the sequence, one concern per step (torchtitan's shape: each an ``apply_*`` function here or
in the module named):

1. :func:`check_can_parallelize`: the refusals, on every rank alike, before anything changes;
2. the precision plugin converts the module (``*-true``: parameters stored in bf16/fp16; on ``meta`` only metadata);
   with ``device_mesh="auto"``, :func:`apply_auto_layout` then chooses the layout from what the converted model will
   hold per rank against the device's memory (``auto_layout.py``), before anything is allocated;
3. :func:`broadcast_real_tensors`: tensors built for real are made the same on every rank (rank 0's), so shards of
   one tensor fit together;
4. ``tensor_parallel.apply_tensor_parallel``: with a tensor dimension in the layout, the layers the plan names are
   split over it (the model's own plan, or ``tensor_parallel_plan``), LoRA adapters with them; then
   ``expert_parallel.apply_expert_parallel``: with an expert dimension, the experts of each MoE layer are divided
   among the ranks of an expert group and the tokens routed to them by all-to-all (the model's own plan);
   ``router_loss.apply_router_loss``: with ``router_aux_loss="global_batch"``, a mixture-of-experts model's
   load-balancing loss is computed over every data-parallel rank's batch;
   ``context_parallel.apply_context_parallel``: with a context dimension, each causal LM's forward splits its
   sequences over the context group, attention seeing whole sequences (an all-to-all around it);
5. :func:`apply_checkpointing_and_compile`: activation checkpointing, then ``torch.compile`` of each block
   (``blocks.py``), before any FSDP hook exists;
6. :func:`apply_fully_shard`: ``fully_shard`` bottom-up, then the roots (``wrap.py``), each group where the layout
   keeps it (``Layout.storage``: the data-parallel mesh; the experts on their own); weights loaded with ``quantize="nf4"`` are quantized group by group (``quantize.py``);
7. ``wrap.schedule_blocks`` (prefetching) and :func:`apply_root_hooks` (activation offloading, the roots' forwards
   outside training made to wait for every rank for a bounded time: ``forward_guard.py``);
8. :func:`apply_values`: each rank materializes its own shards, initializes what no pretrained weights cover
   (``init.py``; what tensor parallelism leaves whole made equal over each tensor group), loads the slices
   ``load_pretrained`` declared (``checkpoint/pretrained.py``), derives what depends on them (DoRA magnitudes),
   then checks nothing was left unset;
9. ``load_state_dict`` hooks let code written for one device load whole tensors into the shards
   (``checkpoint/module_load.py``).

Which ranks hold what comes from the :class:`~lightning_fsdp2.layout.Layout` (named mesh dimensions), and the options
from :class:`~lightning_fsdp2.options.StrategyOptions` (one object per technique).
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from lightning_fsdp2.auto_layout import AutoLayout, LayoutChoice, choose_layout
from lightning_fsdp2.checkpoint.module_load import install_load_hooks
from lightning_fsdp2.checkpoint.pretrained import PlannedLoads
from lightning_fsdp2.expert_parallel import apply_expert_parallel
from lightning_fsdp2.forward_guard import guard_forwards
from lightning_fsdp2.init import (
    check_initialized,
    initialize_from_loaded,
    initialize_module,
    materialize_module,
    meta_tensor_names,
)
from lightning_fsdp2.context_parallel import apply_context_parallel
from lightning_fsdp2.blocks import (
    apply_activation_checkpointing,
    check_checkpointing_with_compile,
    checkpointed_names,
    compile_blocks,
    no_kv_cache_in_training,
    offload_activations,
)
from lightning_fsdp2.layout import Layout
from lightning_fsdp2.options import StrategyOptions
from lightning_fsdp2.quantize import shard_quantizing
from lightning_fsdp2.step_access import make_step_accessible
from lightning_fsdp2.peft_support import check_peft_supported, untrainable_reason
from lightning_fsdp2.router_loss import apply_router_loss
from lightning_fsdp2.tensor_parallel import apply_tensor_parallel, broadcast_replicas
from lightning_fsdp2.wrap import (
    ModulePolicy,
    block_names,
    fsdp_roots,
    innermost,
    resolve_policy,
    schedule_blocks,
    shard_model,
)


class ModulePrecision(Protocol):
    """What :func:`parallelize` needs of a precision plugin (both front-ends' ``FSDP2Precision`` have it)."""

    mixed_precision_policy: MixedPrecisionPolicy

    def convert_module(self, module: nn.Module) -> nn.Module: ...

    def compute_as(self, policy: MixedPrecisionPolicy, device: torch.device) -> None: ...


@dataclass
class Parallelized:
    """What :func:`parallelize` did to a model, for the strategy that called it."""

    initialized: frozenset[str] = field(default_factory=frozenset)
    """Names of the tensors that got their values from the init rules (materialized, not loaded): a checkpoint that
    leaves them out (``save_trainable_only``) leaves them at random values."""

    quantized: frozenset[str] = field(default_factory=frozenset)
    """Names of the weights stored in NF4 (``load_pretrained(..., quantize="nf4")``): frozen, never saved in
    checkpoints (they come from ``load_pretrained`` again)."""

    layout: Layout | None = None
    """The layout the model was sharded in (the one given, or the one ``device_mesh="auto"`` chose)."""

    mesh: DeviceMesh | None = None
    """... and its device mesh."""

    layout_choice: LayoutChoice | None = None
    """With ``device_mesh="auto"``: every candidate layout's estimate and the one chosen."""


@dataclass(frozen=True)
class SetUp:
    """A model's set-up, kept on the model (it outlives the strategy that made it): a later Trainer or Fabric run
    that is given the same model takes it as it is when it would lay it out the same way (:func:`earlier_set_up`).
    A set-up cannot be undone in place (torch has no inverse of ``fully_shard``), so another way is refused."""

    parallelized: Parallelized
    settings: dict[str, object]
    """What decided the model's layout: the processes, the layout asked for, the options that shape the model, the
    precision."""
    parameters: frozenset[int]
    """The ids of the parameters it set up: another set means ``configure_model`` built layers anew."""
    training: bool
    """Set up for training (what training alone checks was checked)."""


_SET_UP = "_lightning_fsdp2_set_up"


def remember_set_up(module: nn.Module, parallelized: Parallelized, settings: dict[str, object],
                    training: bool) -> None:
    """Keep on ``module`` how it was set up, for a later run given the same model (a second ``Trainer``)."""
    ids = frozenset(id(p) for p in module.parameters())
    object.__setattr__(module, _SET_UP, SetUp(parallelized, settings, ids, training))  # not a submodule, nor state


def earlier_set_up(module: nn.Module, settings: dict[str, object], training: bool) -> Parallelized | None:
    """What an earlier run of this package did to ``module``, if it did set it up: reused when ``settings`` (this
    run's) lay it out the same way, in the same process group, with the same layers; otherwise refused on every rank
    alike (all hold the same model and settings), saying what differs and what to do."""
    earlier: SetUp | None = module.__dict__.get(_SET_UP)
    if earlier is None:
        return None
    check_not_rebuilt(module)
    if frozenset(id(p) for p in module.parameters()) != earlier.parameters:
        raise RuntimeError(
            f"`configure_model` built new layers into {type(module).__name__}, which an earlier run of FSDP2Strategy"
            " set up: Lightning calls it again for every `fit`/`validate`/`test`/`predict`, and for a new Trainer."
            " Make it return early when the layers exist (`if self.model is not None: return`), so that the model"
            " the earlier run set up is taken as it is."
        )
    if training and not earlier.training:  # set up for evaluation, now trained: what only training needs
        check_trainable(module)
        check_peft_supported(module, training=True)
    mesh = earlier.parallelized.mesh
    groups = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    alive = mesh is None or all(group in groups for group in mesh.get_all_groups())
    differs = {name: (was, now) for name, was in earlier.settings.items()
               if (now := settings.get(name)) != was and not (name == "layout" and isinstance(now, AutoLayout))}
    if alive and not differs:
        return earlier.parallelized
    why = (", ".join(f"{name}: {was!r} then, {now!r} now" for name, (was, now) in differs.items())
           if differs else "its process group is gone (destroyed, or an earlier run's processes ended)")
    raise RuntimeError(
        f"{type(module).__name__} was set up by an earlier run of FSDP2Strategy, which laid it out otherwise ({why})."
        " A model is taken again as it is by a later Trainer or Fabric run with the same layout, options and"
        " precision (functions, policies and tensor-parallel styles among the options compare as objects: pass the"
        " same ones); a sharded model cannot be laid out again in place. Use the same strategy settings, or save a"
        " checkpoint (`trainer.save_checkpoint`), build the model anew and resume from it: checkpoints load into any"
        " layout."
    )


def parallelize(
    module: nn.Module,
    mesh: DeviceMesh | None,
    *,
    layout: Layout | AutoLayout,
    options: StrategyOptions,
    precision: ModulePrecision,
    device: torch.device,
    pretrained: PlannedLoads,
    training: bool,
    module_is_root: bool = False,
) -> Parallelized:
    """Convert, checkpoint, shard, materialize and initialize ``module`` in place, on every rank.

    ``mesh``: ``layout``'s device mesh; with ``device_mesh="auto"``, ``layout`` is the :class:`AutoLayout` request and
    ``mesh`` ``None``: the layout is chosen from the model's memory (the returned ``Parallelized`` says which).
    ``pretrained``: the deferred ``load_pretrained``/``load_adapter`` calls to run
    once the shards exist (planned before this call, so that a checkpoint that does not fit fails before anything is
    allocated). ``training``: the model will be trained (peft methods that cannot be trained sharded are refused).
    ``module_is_root``: the front-end calls ``module`` itself (Fabric), so it is the FSDP root; otherwise its children
    are (the Trainer's ``LightningModule``, whose steps call ``self.model``; see :func:`wrap.shard_model`).
    """
    check_can_parallelize(module, training)
    module = precision.convert_module(module)
    # `*-mixed` autocasts in the dtype the parameters are gathered in (a user's policy's too), on this device.
    precision.compute_as(options.shard.mixed_precision or precision.mixed_precision_policy, device)
    choice = None
    if isinstance(layout, AutoLayout):
        choice = apply_auto_layout(module, layout, options, precision, pretrained, module_is_root)
        layout, mesh = choice.layout, choice.layout.build_mesh(device.type)
        options = replace(options, shard=replace(options.shard,
                                                 reshard_after_forward=choice.chosen.reshard_after_forward))
    assert mesh is not None
    broadcast_real_tensors(module, device)
    apply_tensor_parallel(module, layout, mesh, options.tensor_parallel.plan, pretrained.quantizes)
    expert_mesh = apply_expert_parallel(module, layout, mesh, pretrained.quantizes)
    apply_router_loss(module, layout, mesh, options.router_loss.over)
    apply_context_parallel(module, layout, mesh)
    blocks = innermost(block_names(module, options.shard.auto_wrap_policy))
    apply_checkpointing_and_compile(module, blocks, options)
    plain = {p for p in module.parameters() if not p.requires_grad} if choice and choice.chosen.frozen_plain else None
    quantized = apply_fully_shard(module, mesh, layout, options, precision, pretrained, device, module_is_root, plain,
                                  expert_mesh)
    schedule_blocks(module, [] if plain else blocks, forward=options.prefetch.forward,
                    backward=options.prefetch.backward, reshard_last=options.prefetch.reshard_last_block)
    apply_root_hooks(module, options)
    initialized = apply_values(module, options, pretrained, device, layout.shared_batch_mesh(mesh))
    install_load_hooks(module)  # module.load_state_dict of whole tensors from here on (code written for one device)
    make_step_accessible(module)  # `.item()`, `.tolist()`, `param.data = ...` in a step, as in one process
    return Parallelized(initialized=frozenset(initialized), quantized=frozenset(quantized), layout=layout, mesh=mesh,
                        layout_choice=choice)


def check_can_parallelize(module: nn.Module, training: bool) -> None:
    """Refuse, on every rank alike (all built the same model), what cannot be set up: FSDP1-wrapped or already
    sharded modules, a model without parameters, nothing trainable for training, peft methods that cannot run
    sharded."""
    check_no_fsdp1(module)
    check_not_sharded_already(module)
    check_built(module)
    if training:
        check_trainable(module)
    check_peft_supported(module, training=training)


def apply_auto_layout(
    module: nn.Module,
    request: AutoLayout,
    options: StrategyOptions,
    precision: ModulePrecision,
    pretrained: PlannedLoads,
    module_is_root: bool,
) -> LayoutChoice:
    """``device_mesh="auto"``: choose the layout and ``reshard_after_forward`` from what ``module`` (on ``meta``, in
    its storage dtype) will hold per rank, as ``fully_shard`` will group it, against the agreed budget
    (``auto_layout.py``)."""
    ac = options.checkpointing
    mp_policy = options.shard.mixed_precision or precision.mixed_precision_policy
    return choose_layout(
        module, request, auto_wrap_policy=options.shard.auto_wrap_policy, gathered_dtype=mp_policy.param_dtype,
        checkpointing=(ac.policy, ac.every) if ac.policy is not None else None, nf4=pretrained.nf4_names,
        module_is_root=module_is_root, frozen_plain=mp_policy.param_dtype is None and not pretrained.quantizes,
    )


def apply_checkpointing_and_compile(module: nn.Module, blocks: list[str], options: StrategyOptions) -> None:
    """Activation checkpointing on the chosen modules, then ``torch.compile`` of each block (``blocks.py``), before
    any FSDP hook exists."""
    compile_kwargs = options.compile.kwargs
    compiled = blocks if compile_kwargs is not None else []
    if compile_kwargs is not None and not blocks:
        raise ValueError(
            "FSDP2Strategy(compile=...) compiles the blocks auto_wrap_policy selects, and it selected none in"
            f" {type(module).__name__}. Name the repeated block class: auto_wrap_policy={{DecoderLayerClass}}."
        )
    ac = options.checkpointing
    checkpointed = checkpointed_names(module, ac.policy, ac.every) if ac.policy is not None else []
    if compiled:
        check_checkpointing_with_compile(checkpointed, compiled)
        compile_blocks(module, compiled, compile_kwargs, checkpointed, ac.save)
    elif checkpointed:
        apply_activation_checkpointing(module, checkpointed, ac.save)
    no_kv_cache_in_training(module, checkpointed + compiled)


def apply_fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    layout: Layout,
    options: StrategyOptions,
    precision: ModulePrecision,
    pretrained: PlannedLoads,
    device: torch.device,
    module_is_root: bool,
    plain: set[nn.Parameter] | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> set[str]:
    """``fully_shard`` bottom-up, then the roots (``wrap.py``), each group kept where the layout says
    (:meth:`Layout.storage`: over the data-parallel part of ``mesh``); with weights loaded with ``quantize="nf4"``, group by group, each group's stored in NF4 just before its
    ``fully_shard`` (``quantize.py``). ``plain``: parameters FSDP2 leaves alone (``device_mesh="auto"``'s whole
    replicas: the frozen ones stay plain tensors, and the roots alone are groups, so the trained parameters are
    gathered and reduced once per step). ``expert_mesh``: expert parallelism's (its experts are groups of their own,
    kept on it). Return the names of the weights stored in NF4."""
    shard = options.shard
    policy: ModulePolicy | None = shard.auto_wrap_policy
    if expert_mesh is not None:  # FSDP2 takes one mesh per group: the experts, kept apart, are groups of their own
        blocks = resolve_policy(policy, module)
        policy = lambda name, sub: blocks(name, sub) or layout.holds_experts(sub)  # noqa: E731
    arguments = {
        "policy": policy,
        "mp_policy": shard.mixed_precision or precision.mixed_precision_policy,
        "offload_policy": shard.offload_policy,
        "reshard_after_forward": shard.reshard_after_forward,
        "model_is_root": module_is_root,
    }
    if plain:
        arguments.update(ignored_params=plain, roots_only=True)
    where = functools.partial(layout.storage, mesh, expert_mesh=expert_mesh)
    if pretrained.quantizes:
        return shard_quantizing(module, where, pretrained, layout.shard_size, device, **arguments)
    shard_model(module, where, **arguments)
    return set()


def apply_root_hooks(module: nn.Module, options: StrategyOptions) -> None:
    """On the FSDP roots: activation offloading, and forwards outside training made to wait for every rank for a
    bounded time (``forward_guard.py``)."""
    roots = [module.get_submodule(name) for name in fsdp_roots(module)]
    if options.offload_activations.enabled:
        offload_activations(roots)
    guard_forwards(roots, options.forward_check.timeout)


def apply_values(
    module: nn.Module,
    options: StrategyOptions,
    pretrained: PlannedLoads,
    device: torch.device,
    shared_batch_mesh: DeviceMesh | None = None,
) -> list[str]:
    """Each rank materializes its own shards, initializes what no pretrained weights cover (``init.py``; what the
    ranks computing one batch together (``shared_batch_mesh``: tensor parallelism's) hold whole made equal over
    them), loads the slices
    ``load_pretrained`` declared (``checkpoint/pretrained.py``), derives what depends on them (DoRA magnitudes),
    then checks nothing was left unset; return the names initialized by the init rules."""
    # Offloaded shards live in CPU memory; FSDP2 copies them to the device when it gathers them.
    storage = torch.device("cpu") if options.shard.offload_policy is not None else device
    loaded = pretrained.covered
    materialized = materialize_module(module, storage, buffer_device=device, to_load=loaded)
    # Tensors that pretrained weights overwrite are neither initialized nor checked for the NaN sentinel: every
    # element of their shards is copied from the file (or the load raises). At scale that saves minutes.
    to_initialize = [name for name in materialized if name not in loaded]
    initialize_module(module, to_initialize)
    broadcast_replicas(module, to_initialize, shared_batch_mesh)
    pretrained.run(module)
    initialize_from_loaded(module, to_initialize)  # DoRA magnitudes: norms of the loaded base weights
    check_initialized(module, to_initialize, device)
    return to_initialize


@torch.no_grad()
def broadcast_real_tensors(module: nn.Module, device: torch.device) -> None:
    """Give every rank rank 0's values of the tensors built for real (in ``__init__``, or with ``meta_init=False``),
    as DDP does: ``fully_shard`` keeps each rank's own slice of its own tensor, so values that differ between ranks
    (another seed, weights loaded on one rank) would end up stitched together. One tensor at a time, through the
    device for backends that need it (NCCL). Meta tensors are left alone: they get their values after sharding."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_meta:
            continue
        staged = tensor.data if tensor.device == device else tensor.data.to(device)
        torch.distributed.broadcast(staged, src=0)
        if staged is not tensor.data:
            tensor.data.copy_(staged)


def reshard(module: nn.Module) -> None:
    """Put every FSDP group of ``module`` back in its sharded state. A root is not resharded after a forward without
    gradients (an evaluation, ``generate``), which waits for a backward that does not come: until the next forward
    its parameters are the unsharded tensors, which an optimizer made from ``model.parameters()`` would then hold
    (and never update the shards). Call before taking the parameters outside a step."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


@contextmanager
def no_gradient_sync(module: nn.Module, enabled: bool = True) -> Generator[None, None, None]:
    """Skip the gradient reduce-scatter of every FSDP group in ``module`` while the block runs (micro-batches that
    only accumulate); the next backward outside it reduces the accumulated gradients."""
    groups = [m for m in module.modules() if isinstance(m, FSDPModule)] if enabled else []
    for group in groups:
        group.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for group in groups:
            group.set_requires_gradient_sync(True, recurse=False)


def check_no_fsdp1(module: nn.Module) -> None:
    """Refuse modules wrapped in FSDP1's ``FullyShardedDataParallel``."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    wrapped = [name or "<root>" for name, m in module.named_modules() if isinstance(m, FullyShardedDataParallel)]
    if wrapped:
        raise TypeError(
            f"Modules {wrapped} are wrapped in FSDP1's FullyShardedDataParallel. FSDP2Strategy shards the model"
            " itself with FSDP2: build the plain modules (in `configure_model`, or under `fabric.init_module()`) and"
            " remove the FullyShardedDataParallel wrapping."
        )


def check_not_sharded_already(module: nn.Module) -> None:
    """Refuse a model whose parameters are sharded already: by transformers (``from_pretrained(...,
    distributed_config=DistributedConfig(...))``), by ``fully_shard`` or ``parallelize_module`` calls left in the
    user's code (``ModelParallelStrategy``'s way), or by another strategy's earlier run. FSDP2Strategy decides the
    groups, the precision, the initialization and the load itself; sharding such a model again fails deep inside
    torch (``c10d.broadcast_.default does not have a sharding strategy``). The same on every rank: all built the same
    model."""
    from torch.distributed.tensor import DTensor

    groups = [name or "<root>" for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    sharded = [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    if not groups and not sharded:
        return
    by_transformers = [(m, getattr(m.config, "distributed_config")) for m in module.modules()
                       if getattr(getattr(m, "config", None), "distributed_config", None) is not None]
    if by_transformers:
        owner, config = by_transformers[0]
        name = (type(owner).__bases__[-1] if isinstance(owner, FSDPModule) else type(owner)).__name__
        tensor_parallel = (getattr(config, "tp_size", None) or 1) > 1
        layout = (" DistributedConfig's tp_size is `FSDP2Strategy(tensor_parallel_size=tp_size)` (the model's own plan,"
                  " applied by FSDP2Strategy)." if tensor_parallel
                  else " `FSDP2Strategy(device_mesh=(replicate, shard))` is DistributedConfig's"
                  " `dp_replicate_size`/`fsdp_size`.")
        raise RuntimeError(
            f"{name} was sharded by transformers (`from_pretrained(..., distributed_config="
            "DistributedConfig(...))`). FSDP2Strategy shards the model itself and does not take over a model sharded"
            " elsewhere. Drop `distributed_config` and build the model with `AutoModelForCausalLM.from_config(config)`"
            " plus `load_pretrained(model, path)` in `configure_model` (or under `fabric.init_module()`): each rank"
            f" reads only its shards' slices, as transformers' loader does.{layout} To keep transformers' sharding,"
            " train with Lightning's ModelParallelStrategy or your own loop instead."
        )
    what = f"Modules {groups[:5]} were passed to fully_shard" if groups else f"Parameters {sharded[:5]} are DTensors"
    raise RuntimeError(
        f"{what} before FSDP2Strategy set the model up: it is sharded already, by your code (`fully_shard` or"
        " `parallelize_module` calls, ModelParallelStrategy's way) or by an earlier run whose set-up failed part-way."
        " FSDP2Strategy calls fully_shard itself: delete those calls from `configure_model`, keep the model"
        " construction (see docs/comparison.md, 'Moving from them'); after a set-up that failed part-way (a load that"
        " did not fit), or to start over, build the model anew. (A model an earlier run set up completely is taken"
        " as it is by the next Trainer or Fabric run.)"
    )


def check_trainable(module: nn.Module) -> None:
    """Raise :func:`untrainable_reason`'s message, if any (a model about to be trained)."""
    reason = untrainable_reason(module)
    if reason is not None:
        raise ValueError(reason)


def check_built(module: nn.Module) -> None:
    """Refuse a module without parameters (the network was never built)."""
    if not any(True for _ in module.parameters()):
        raise RuntimeError(
            f"{type(module).__name__} has no parameters to shard. Build the network in `configure_model` (or"
            " `__init__`) and assign it to an attribute, e.g. `self.model = AutoModelForCausalLM.from_config(...)`."
        )


def check_not_rebuilt(module: nn.Module) -> None:
    """Refuse new layers built on ``meta`` into a model that is already sharded."""
    rebuilt = meta_tensor_names(module)
    if rebuilt:
        raise RuntimeError(
            f"`configure_model` built new layers on a model that is already sharded ({rebuilt[:5]}...). Lightning"
            " calls it again for every `fit`/`validate`/`test`/`predict`; make it return early when the layers exist,"
            " e.g. `if self.model is not None: return`."
        )
