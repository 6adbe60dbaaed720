"""Which modules become FSDP2 groups, in which order they are gathered (prefetching), and when they are freed.

Each ``fully_shard(module)`` call makes one *group*: the parameters of ``module`` not already claimed by an inner
group are all-gathered together before its forward and freed after. Groups must therefore be created inner-first
(post-order): ``fully_shard`` on a block claims everything below it, so a later call on an inner module would find its
parameters taken. The roots (see :func:`root_names`) are sharded last and pick up the stragglers (embeddings, final
norm, head).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from lightning_fsdp2.layout import Storage
from lightning_fsdp2.peft_support import names_inside_adapter_layers

ModulePolicy = Union[set[type[nn.Module]], Callable[[str, nn.Module], bool]]
"""A set of module classes, or a callable ``(qualified_name, module) -> bool`` that selects modules."""

Where = Union[DeviceMesh, Callable[[str, nn.Module], Storage]]
"""Where the groups' parameters are kept: one mesh for every group (split along their first dimension), or a callable
``(group name, module) -> Storage`` asked group by group (the layout's :meth:`~lightning_fsdp2.layout.Layout.storage`)."""


def default_block_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The module classes to shard one by one when the user names none.

    In order of preference: the classes a Hugging Face model lists in ``_no_split_modules`` (its own statement of
    what a "block" is); PyTorch's transformer layers; else the class of the repeated children of an
    ``nn.ModuleList`` (the usual way a stack of blocks is written).
    """
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    if names:
        found = {type(m) for m in model.modules() if type(m).__name__ in names}
        if found:
            return found
    torch_layers = {type(m) for m in model.modules() if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))}
    if torch_layers:
        return torch_layers
    repeated: set[type[nn.Module]] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            classes = {type(child) for child in module}
            if len(classes) == 1:
                repeated |= classes
    return repeated


def resolve_policy(policy: ModulePolicy | None, model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """Turn a class set, a callable or ``None`` (the default blocks) into a ``(name, module) -> bool`` predicate."""
    if policy is None:
        policy = default_block_classes(model)
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        return lambda _name, module: isinstance(module, classes)
    if callable(policy):
        return policy
    raise TypeError(
        f"A module policy must be a set of nn.Module classes or a callable (name, module) -> bool, got {policy!r}."
    )


def block_names(model: nn.Module, policy: ModulePolicy | None = None) -> list[str]:
    """The modules :func:`shard_model` makes groups of before the roots, in ``named_modules`` order (the order a
    stack of blocks runs in): those the policy selects that hold parameters, minus the two kinds it never makes groups
    (see :func:`shard_model`)."""
    select = resolve_policy(policy, model)
    inside_adapter = names_inside_adapter_layers(model)
    owners = _parameter_owners(model)
    return [
        name for name, module in model.named_modules()
        if name and name not in inside_adapter and select(name, module)
        and any(True for _ in module.parameters()) and not _shares_parameters_outside(name, module, owners)
    ]


def innermost(names: list[str]) -> list[str]:
    """The names in ``names`` with no other of them below them (a stack's blocks, not a group that holds blocks)."""
    return [n for n in names if not any(inside(o, n) for o in names)]


def inside(name: str, other: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``other`` (qualified names; ``""`` is the model)."""
    return name != other and (other == "" or name.startswith(f"{other}."))


def fsdp_roots(model: nn.Module) -> list[str]:
    """The FSDP groups of ``model`` with no group above them: those the front-end's calls enter first."""
    groups = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    return [n for n in groups if not any(inside(n, above) for above in groups)]


def shard_model(model: nn.Module, where: Where, policy: ModulePolicy | None = None, **options: Any) -> list[str]:
    """Apply ``fully_shard`` to the selected modules bottom-up, then to the roots; return the groups' names.
    ``options`` are :func:`shard_groups`' keyword arguments; this runs it to the end."""
    return [name for name, _ in shard_groups(model, where, policy, **options)]


def shard_groups(
    model: nn.Module,
    where: Where,
    policy: ModulePolicy | None = None,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int = True,
    model_is_root: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
    roots_only: bool = False,
) -> Iterator[tuple[str, nn.Module]]:
    """``fully_shard`` the selected modules bottom-up, then the roots, one group at a time: yields each group's
    ``(name, module)`` just *before* its ``fully_shard``, which runs when the caller asks for the next one (so a step
    can ready a group's parameters first: QLoRA stores them in NF4 there). Run it to the end (``shard_model`` does).
    ``where``: the mesh of every group, or the layout's answer group by group (:data:`Where`).

    The roots are the children of ``model`` (the ``LightningModule``) that hold parameters, such as ``self.model``:
    FSDP2 gathers a root's remaining parameters (embeddings, final norm, head) when the root is *called*, so with
    ``self.model`` as a root, ``self.model(...)`` and ``self.model.generate(...)`` (registered as a forward method)
    work anywhere, in ``*_step`` or in a callback. Only when ``model`` holds parameters itself, or its children share
    parameters with each other, is
    ``model`` the single root; its steps must then run through its ``__call__`` (the strategy sees to that).
    ``model_is_root``: ``model`` is the root whatever it holds, for a front-end that calls ``model`` itself (Fabric
    calls the module given to ``setup_module``). ``ignored_params``: parameters FSDP2 leaves alone (whole, local).
    ``roots_only``: no block groups, the roots take every managed parameter (whole replicas whose frozen base is
    ignored: the trained parameters are gathered and their gradients reduced once per step, as DDP reduces its
    buckets, rather than once per block).

    Two kinds of modules are never made groups of their own, whatever the policy says:

    * modules *inside* a peft adapter layer (``base_layer``, ``lora_A``, ``lora_B``): the adapter and the weight
      it adapts are used together in one forward, so they are gathered together with their block;
    * modules whose parameters are shared with a module outside them (tied embeddings): a parameter can belong to
      one group only, so it is left to the enclosing group (at worst the root) that holds every user of it.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    storage = where if callable(where) and not isinstance(where, DeviceMesh) else lambda _n, _m: Storage(where)
    kwargs = {
        # `output_dtype` is what the model's outputs are cast to: the roots' outputs. Cast at every block, a block's
        # fp32 output would meet the next block's (or the head's) low-precision weights.
        "mp_policy": dataclasses.replace(mp_policy, output_dtype=None),
        "reshard_after_forward": reshard_after_forward,
    }
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    if ignored_params:
        kwargs["ignored_params"] = ignored_params
    sharded = 0
    # Post-order: the reversed `named_modules()` order visits children before their parents, so inner groups come first.
    for name in [] if roots_only else reversed(block_names(model, policy)):
        module = model.get_submodule(name)
        yield name, module
        _fully_shard(module, storage(name, module), kwargs)
        sharded += 1
    if not sharded and not roots_only and _rank0():
        warnings.warn(
            "The wrap policy selected no module with parameters of its own: only the roots are sharded, so each is"
            " gathered whole for its forward (no memory saved over DDP while it runs). Name the repeated blocks in"
            " FSDP2Strategy(auto_wrap_policy={BlockClass}) or a callable."
        )
    # For a root, `None` lets FSDP2 keep its parameters gathered from forward to backward (which follows at once,
    # so resharding would only buy an extra all-gather); an explicit `False` or int from the user is passed on.
    if reshard_after_forward is True:
        kwargs["reshard_after_forward"] = None
    kwargs["mp_policy"] = mp_policy
    for name in [""] if model_is_root else root_names(model):  # looks at the owners afresh: sharding replaced the grouped parameters
        root = model.get_submodule(name)
        if not isinstance(root, FSDPModule):  # a child the policy selected is a group, and a root, already
            yield name, root
            _fully_shard(root, storage(name, root), kwargs)
        # `generate` does not go through the root's forward (peft's calls the Hugging Face model's, which calls the
        # prompt encoder or reads its weight): registered as a forward method, it gathers the root's parameters
        # (embeddings, head, prompt encoder) as forward does.
        if callable(getattr(root, "generate", None)):
            register_fsdp_forward_method(root, "generate")


def _fully_shard(module: nn.Module, storage: Storage, kwargs: dict[str, Any]) -> None:
    """``fully_shard(module)`` kept as ``storage`` says, with the group's other arguments ``kwargs``."""
    if storage.divide_gradients_by is not None:
        kwargs = {**kwargs, "mp_policy": _reduce_in_fp32_not_fp16(module, kwargs["mp_policy"])}
    fully_shard(module, mesh=storage.mesh, shard_placement_fn=storage.placement, **kwargs)
    if storage.divide_gradients_by is not None:
        module.set_gradient_divide_factor(storage.divide_gradients_by)  # type: ignore[operator]
        # A divide factor of its own makes FSDP2 reduce-scatter with a pre-multiplied sum, which gloo does not
        # implement: a plain sum and a division after it give the same gradients on any backend. Not over one rank,
        # where torch 2.13 skips the collective and would then divide twice (measured).
        if storage.mesh.size(storage.mesh.ndim - 1) > 1:
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def _reduce_in_fp32_not_fp16(module: nn.Module, policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """``policy`` reducing in fp32 where it would reduce fp16 gradients: with a divide factor of its own, torch 2.13
    divides fp16 gradients in two steps around the reduction (against overflow) and, over one rank, by the whole
    factor besides (measured: the experts' gradients halved at EP 2 under ``"16-true"``). fp32 takes the one-step
    path; the sharded gradient is still stored in the parameter's dtype."""
    params = list(module.parameters(recurse=False))
    reduced = policy.reduce_dtype or policy.param_dtype or (params[0].dtype if params else None)
    return dataclasses.replace(policy, reduce_dtype=torch.float32) if reduced == torch.float16 else policy


def _rank0() -> bool:
    """Whether this process is rank 0 (or there is no process group): who warns, once."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def root_names(model: nn.Module) -> list[str]:
    """The modules to shard last: ``model``'s children with parameters, or ``[""]`` (``model`` itself) when
    ``model`` has parameters of its own or its children share parameters."""
    owners = _parameter_owners(model)
    children = [(n, c) for n, c in model.named_children() if any(True for _ in c.parameters())]
    if (
        not children
        or any(True for _ in model.parameters(recurse=False))
        or any(_shares_parameters_outside(n, c, owners) for n, c in children)
    ):
        return [""]
    return [n for n, _ in children]


def _parameter_owners(model: nn.Module) -> dict[int, set[str]]:
    """Map each parameter (by identity) to the names of every module that holds it directly."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(name)
    return owners


def _shares_parameters_outside(name: str, module: nn.Module, owners: dict[int, set[str]]) -> bool:
    prefix = f"{name}."
    return any(
        owner != name and not owner.startswith(prefix)
        for param in module.parameters()
        for owner in owners.get(id(param), ())  # parameters already in an inner group were replaced: skip them
    )


def schedule_blocks(model: nn.Module, blocks: list[str], forward: int = 0, backward: int = 1,
                    reshard_last: bool = True) -> None:
    """After sharding: have each block's hooks start the all-gathers of the next ``forward`` blocks (in forward) and of
    the previous ``backward`` blocks (in backward), and with ``reshard_last=False`` keep the last block gathered from
    its forward to its backward. ``blocks`` in the order they run; chained within each FSDP root only (another root's
    blocks may run in another order, or not at all).

    FSDP2's own schedule (``forward=0, backward=1``) gathers a block when its forward starts and, in backward, the
    block before the one whose backward starts. Issued earlier, an all-gather can run while the current block computes;
    each block prefetched ahead holds its gathered parameters that much longer. The last block runs last in forward
    and first in backward: resharding it in between only buys an all-gather.
    """
    for root in fsdp_roots(model):
        modules = [model.get_submodule(b) for b in blocks if b == root or inside(b, root)]
        for i, module in enumerate(modules):
            if forward > 0 and i + 1 < len(modules):
                module.set_modules_to_forward_prefetch(modules[i + 1 : i + 1 + forward])
            if backward > 1 and i > 0:
                module.set_modules_to_backward_prefetch(list(reversed(modules[max(0, i - backward) : i])))
        if modules and not reshard_last:
            modules[-1].set_reshard_after_forward(False, recurse=False)
