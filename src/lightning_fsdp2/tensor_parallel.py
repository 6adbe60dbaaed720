"""Tensor parallelism: the layers a plan names are split over the layout's ``"tensor"`` ranks, before FSDP2 shards
what each rank holds over the data-parallel ranks (torchtitan's order: TP, then checkpointing/compile, then FSDP).

The plan comes from the model. A Hugging Face model ships one (its config's ``base_model_tp_plan`` and its class's
``_tp_plan``: Llama's q/k/v/gate/up colwise, o/down rowwise, the embeddings vocab-parallel, the head colwise with its
output gathered); transformers' own styles apply it (``transformers.distributed.tensor_parallel``: each parameter
becomes a ``DTensor`` on the tensor mesh, each module's forward turns its inputs and outputs into the layouts the
next layer expects). Any model can be given a plan instead: module-name patterns to transformers' style names or
torch ``ParallelStyle`` objects, or a callable ``(model, tensor_mesh)`` that parallelizes it itself.

Why it composes with FSDP2: a parameter split here is a ``DTensor`` on the tensor mesh, and ``fully_shard`` over the
data-parallel mesh (a sibling sub-mesh of the same device mesh) shards each rank's piece again, so checkpoints,
loads and gathers see one ``DTensor`` per parameter with both placements. Parameters the plan leaves whole (norms,
LoRA's replicated half) are the same on every rank of a tensor group, and so are their gradients (the inputs of the
split layers are all-reduced in backward), so FSDP2's data-parallel reduction is all they need; the exception, norms
inside the split heads (Qwen3's ``q_norm``), is all-reduced over the tensor group in backward
(``"replicated_with_grad_allreduce"``).

peft's LoRA layers on a split layer follow peft's own TP code (``peft_support.shard_lora_adapters``): behind a
colwise base ``lora_B`` is split like it and ``lora_A`` stays whole; behind a rowwise base the reverse.

On a model built on ``meta`` (the default) nothing here allocates: transformers' styles only make placeholders. With
``meta_init=False`` the styles cut each rank's piece out of the whole tensors every rank holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp2.init import outermost
from lightning_fsdp2.layout import Layout, is_split
from lightning_fsdp2.peft_support import (
    check_tensor_parallel_adapter,
    is_peft_layer,
    is_tuner_layer,
    names_inside_adapter_layers,
    shard_lora_adapters,
)

TensorParallelPlan = Mapping[str, Any] | Callable[[nn.Module, DeviceMesh], Any] | None
"""What ``FSDP2Strategy(tensor_parallel_plan=...)`` takes: ``None`` (the Hugging Face model's own plan), a mapping of
module-name patterns (``*`` for one name part, e.g. a layer number) to transformers' style names (``"colwise"``,
``"rowwise"``, ``"embedding_rowwise"``, ...) or torch ``ParallelStyle`` objects, or a callable ``(model,
tensor_mesh)``."""

SUPPORTED_STYLES = frozenset({
    "colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise",
    "replicated_with_grad_allreduce",
})
"""transformers' style names that run (and are tested against one process) under FSDP2Strategy. The others either
split weights in packed pieces that loads and checkpoints cannot read slice by slice (``packed_colwise``, MoE
experts), or change activation layouts in ways no test here checks (``sequence_parallel``, ...): refused by name."""

_PACKED = frozenset({"packed_colwise", "packed_rowwise", "moe_tp_experts", "moe_identity_expert"})


def check_plan_option(plan: Any) -> TensorParallelPlan:
    """``tensor_parallel_plan`` as the strategies keep it, or an error saying what it takes (at construction)."""
    if plan is None or (callable(plan) and not isinstance(plan, Mapping)):
        return plan
    if isinstance(plan, Mapping) and not plan:
        raise ValueError(
            "FSDP2Strategy(tensor_parallel_plan={}): the plan is empty. Name the layers to split, e.g."
            " {'model.layers.*.mlp.up_proj': 'colwise', 'model.layers.*.mlp.down_proj': 'rowwise'}, or pass None for"
            " a Hugging Face model's own plan."
        )
    if isinstance(plan, Mapping):
        from torch.distributed.tensor.parallel import ParallelStyle

        bad = {k: v for k, v in plan.items() if not isinstance(k, str) or not isinstance(v, (str, ParallelStyle))}
        if not bad:
            unknown = sorted({v for v in plan.values() if isinstance(v, str) and v not in SUPPORTED_STYLES})
            if unknown:
                raise ValueError(
                    f"FSDP2Strategy(tensor_parallel_plan=...): unknown or unsupported style name(s) {unknown}; the"
                    f" names FSDP2Strategy runs are {sorted(SUPPORTED_STYLES)} (transformers' styles), or pass torch"
                    " ParallelStyle objects (ColwiseParallel(), ...)."
                )
            return dict(plan)
    raise TypeError(
        f"FSDP2Strategy(tensor_parallel_plan={plan!r}): pass a dict of module-name patterns to style names or torch"
        " ParallelStyle objects (e.g. {'layers.*.linear1': 'colwise', 'layers.*.linear2': 'rowwise'}), a callable"
        " (model, tensor_mesh) that parallelizes the model itself, or None for a Hugging Face model's own plan."
    )


def check_tensor_parallel_options(
    layout: Layout, *, plan: TensorParallelPlan, compiled: bool, checkpointed: bool, selective: bool, offloaded: bool
) -> None:
    """Refuse, by name, what does not run with tensor parallelism (yet), and a plan without a tensor dimension:
    ``StrategyOptions.check_layout``'s part for this dimension, on every rank alike, before any collective."""
    if layout.tensor_size == 1:
        if plan is not None:
            raise ValueError(
                "FSDP2Strategy(tensor_parallel_plan=...) is given, but the layout has no tensor dimension: pass"
                " tensor_parallel_size=N (or device_mesh=(replicate, shard, tensor)) as well, or drop the plan."
            )
        return
    if compiled and checkpointed:
        # torch 2.13: AOTAutograd of a checkpointed block whose DTensor ops carry the tensor mesh saves the mesh
        # for backward and fails ("expected all tensors_saved_with_vc_check to be Tensors").
        raise ValueError(
            "FSDP2Strategy(compile=..., activation_checkpointing_policy=...) together do not run with tensor"
            f" parallelism (tensor size {layout.tensor_size}): torch's compiled autograd of a checkpointed block"
            " with split layers fails. Keep one of the two (each runs with tensor parallelism), or train without"
            " tensor parallelism."
        )
    named = [name for name, given in (("cpu_offload", offloaded), ("activation_checkpointing_save", selective))
             if given]
    if named:
        raise ValueError(
            f"FSDP2Strategy({', '.join(f'{n}=...' for n in named)}) does not run with tensor parallelism"
            f" (tensor size {layout.tensor_size}) yet. Drop {' and '.join(named)}, or train without tensor"
            " parallelism (tensor_parallel_size=1). Whole-block activation checkpointing"
            " (activation_checkpointing_policy) and compile do run with it."
        )


# =============================================================================================== the step
def apply_tensor_parallel(
    module: nn.Module, layout: Layout, mesh: DeviceMesh, plan: TensorParallelPlan, quantizes: bool = False
) -> None:
    """``parallel.parallelize``'s step for the layout's ``"tensor"`` dimension: split the layers ``plan`` names (the
    models' own plans when ``None``) over it. Nothing without a tensor dimension. ``quantizes``: weights are loaded
    with ``quantize="nf4"`` (refused: NF4 quantizes the FSDP shards of whole weights, and the plan splits them
    first).

    Every rank built the same model, so every check raises on every rank alike, before anything is allocated.
    Afterwards the ranks of a tensor group draw the same random numbers (dropout on the activations they share must
    drop the same elements)."""
    mesh = layout.tensor_mesh(mesh)  # type: ignore[assignment]
    if mesh is None:
        return
    if quantizes:
        raise ValueError(
            "load_pretrained(..., quantize='nf4') (QLoRA) does not run with tensor parallelism: NF4 quantizes the FSDP"
            " shards of whole weights, and the plan splits them first. Drop tensor_parallel_size (QLoRA already"
            " keeps the base at 4 bits per weight), or load the base unquantized."
        )
    tied = _tied_parameters(module)
    if callable(plan):
        plan(module, mesh)
    else:
        steps = plan_steps(module, plan)
        check_heads(module, steps, mesh.size())
        for step in steps:
            step.apply(mesh)
    _retie(module, tied)
    if not any(splits_on(param, mesh) for param in module.parameters()):
        raise ValueError(
            f"FSDP2Strategy(tensor_parallel_size={mesh.size()}): the tensor-parallel plan split no parameter of"
            f" {_model_names(module)}. Pass tensor_parallel_plan={{...}} naming its linear layers (module names as in"
            " named_modules(), `*` for a layer number), or a callable (model, tensor_mesh)."
        )
    check_divisible(module, mesh)
    share_random_state(mesh)


class _Step:
    """One layer of the plan: transformers' style (by name) or a torch ``ParallelStyle`` on module ``name`` of
    ``root``, and the style that splits each of its own parameters (``params``: name -> style; the module's own, or
    the plan's entry for that parameter, as MoE experts' ``gate_up_proj`` has); for a peft tuner layer, the styles go
    on its base layer and its adapters follow peft's TP code."""

    def __init__(self, root: nn.Module, name: str, style: Any, params: dict[str, str]) -> None:
        self.root, self.name, self.style, self.params = root, name, style, params

    def apply(self, mesh: DeviceMesh) -> None:
        from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

        module = self.root.get_submodule(self.name)
        if isinstance(self.style, ParallelStyle):
            parallelize_module(module, mesh, self.style)
            return
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

        adapters = is_tuner_layer(module)
        target = module.get_base_layer() if adapters else module
        for param, param_style in self.params.items():
            ALL_PARALLEL_STYLES[param_style].shard_param(target, param, mesh)
        if self.style == "replicated_with_grad_allreduce":
            all_reduce_gradients_in_backward(target, mesh)
        elif self.style is not None:  # None: only parameters of this module are named by the plan
            ALL_PARALLEL_STYLES[self.style].install_forward(target, mesh)
        if adapters:
            shard_lora_adapters(module, self.style, mesh, self.name)


def plan_steps(module: nn.Module, plan: Mapping[str, Any] | None) -> list[_Step]:
    """The layers to split, each with its style: the user's ``plan`` matched against ``module``'s module names, or
    (``None``) every outermost Hugging Face model's own plan, expanded by transformers to its concrete layers."""
    steps = _user_steps(module, plan) if plan is not None else _model_steps(module)
    check_styles(module, steps)
    for step in steps:
        layer = step.root.get_submodule(step.name)
        if is_peft_layer(layer):
            check_tensor_parallel_adapter(layer, step.name, step.style)
    return steps


def _user_steps(module: nn.Module, plan: Mapping[str, Any]) -> list[_Step]:
    patterns = {key: re.compile(re.escape(key).replace(r"\*", r"[^.]+")) for key in plan}
    inside = names_inside_adapter_layers(module)
    steps, used = [], set()
    for name, sub in module.named_modules():
        if name in inside:
            continue
        key = next((k for k, pattern in patterns.items() if pattern.fullmatch(name)), None)
        if key is None:
            continue
        used.add(key)
        target = sub.get_base_layer() if is_tuner_layer(sub) else sub
        style = plan[key]
        params = {n: style for n, _ in target.named_parameters(recurse=False)} if isinstance(style, str) else {}
        steps.append(_Step(module, name, style, params))
    unused = [k for k in plan if k not in used]
    if unused:
        near = {k: _names_ending_like(module, k) for k in unused}
        hints = "; ".join(f"for {k!r}: {', '.join(repr(n) for n in names)}" for k, names in near.items() if names)
        raise ValueError(
            f"FSDP2Strategy(tensor_parallel_plan=...): {unused} match no module of the {type(module).__name__} the"
            " strategy sets up. Keys are module names as its `named_modules()` gives them (the LightningModule's, or"
            " for Fabric the module given to setup_module; a peft model adds `base_model.model.`), `*` for one name"
            " part. " + (f"Its modules that end like them: {hints}." if hints else
                         "None of its modules ends like them either: print(dict(module.named_modules()).keys()).")
        )
    return steps


def _names_ending_like(module: nn.Module, key: str, limit: int = 3) -> list[str]:
    """``module``'s module names (layer numbers as ``*``) that end like ``key``: its longest tail that matches any."""
    names = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n, _ in module.named_modules() if n})
    parts = key.split(".")
    for keep in range(len(parts), 0, -1):
        tail = re.escape(".".join(parts[-keep:])).replace(r"\*", r"[^.]+")
        found = [n for n in names if re.fullmatch(rf"(?:.*\.)?{tail}", n)]
        if found:
            return found[:limit]
    return []


def _model_steps(module: nn.Module) -> list[_Step]:
    """Transformers' expansion of each outermost ``PreTrainedModel``'s plan: its parameter entries (sharded) and module
    entries (hooked), here grouped per module; a peft layer's entry is taken to its base layer."""
    steps = []
    for prefix, model in _models(module):
        rules = dict(getattr(model, "tp_plan", None) or {})
        if not rules:
            continue
        expanded = model._expand_parallel_plan(rules)  # transformers' own wildcard expansion, on this model's names
        inside = names_inside_adapter_layers(model)
        for name, layer in model.named_modules():
            if name in inside:
                continue
            style = expanded.get(name)
            if is_tuner_layer(layer):  # peft wrapped the layer after transformers planned it: all of its base's
                params = {p: style for p, _ in layer.get_base_layer().named_parameters(recurse=False)} if style else {}
            else:  # each parameter by its own entry (the module's, or one of its own)
                params = {p: expanded[f"{name}.{p}" if name else p] for p, _ in layer.named_parameters(recurse=False)
                          if (f"{name}.{p}" if name else p) in expanded}
            if style is not None or params:
                steps.append(_Step(module, f"{prefix}.{name}" if prefix else name, style, params))
    if not steps:
        raise ValueError(
            f"FSDP2Strategy(tensor_parallel_size>1): {_model_names(module)} has no tensor-parallel plan (a Hugging Face"
            " model's config carries one as `base_model_tp_plan`) and none was given. Pass"
            " tensor_parallel_plan={'layers.*.linear1': 'colwise', 'layers.*.linear2': 'rowwise', ...} (module"
            " names as in named_modules(), `*` for a layer number; transformers' style names or torch"
            " ParallelStyle objects), or a callable (model, tensor_mesh)."
        )
    return steps


# =============================================================================================== checks
def check_styles(module: nn.Module, steps: list[_Step]) -> None:
    """Refuse the model's own plan's styles that do not run here (``SUPPORTED_STYLES``), naming the layers."""
    unsupported: dict[str, list[str]] = {}
    for step in steps:
        for style in {step.style, *step.params.values()}:
            if isinstance(style, str) and style not in SUPPORTED_STYLES:
                unsupported.setdefault(style, []).append(step.name)
    if not unsupported:
        return
    shown = {style: names[:3] + (["..."] if len(names) > 3 else []) for style, names in unsupported.items()}
    if set(unsupported) & _PACKED:
        raise ValueError(
            f"FSDP2Strategy(tensor_parallel_size>1): the plan of {_model_names(module)} splits layers in packed pieces"
            f" (transformers' 'packed_colwise'/'packed_rowwise', e.g. MoE experts' fused gate_up_proj: {shown}), which"
            " loads and checkpoints cannot read slice by slice yet. Pass tensor_parallel_plan={...} without those"
            " layers (e.g. the attention projections, embeddings and head only), or train this model with FSDP or"
            " HSDP (no tensor_parallel_size)."
        )
    raise ValueError(
        f"FSDP2Strategy(tensor_parallel_size>1): the plan of {_model_names(module)} uses style(s) FSDP2Strategy does"
        f" not run yet: {shown}. It runs {sorted(SUPPORTED_STYLES)}: pass tensor_parallel_plan={{...}} without those"
        " layers, or train without tensor parallelism."
    )


def check_heads(module: nn.Module, steps: list[_Step], size: int) -> None:
    """Each rank of a tensor group computes whole attention heads: the plan's models' head counts must divide by
    ``size``."""
    split = {step.name.rsplit(".", 1)[-1] for step in steps}
    for _, model in _models(module):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if not isinstance(heads, int) or not split & {"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"}:
            continue
        if heads % size or kv_heads % size:
            fits = [d for d in range(2, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]
            raise ValueError(
                f"FSDP2Strategy(tensor_parallel_size={size}): {type(model).__name__} has {heads} attention heads and"
                f" {kv_heads} key/value heads, and each rank of a tensor group computes whole heads: the size must"
                f" divide both. Choose a tensor_parallel_size among {fits or [1]}."
            )


def check_divisible(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every split dimension divides evenly over the tensor group (the uneven pieces transformers allows would leave
    the last rank short, which FSDP2's sharding and our slice arithmetic do not follow), and no parameter is split in
    packed pieces (a torch style or a callable plan can make them too: each rank's piece is not one block of the
    whole, so loads and checkpoints cannot read it slice by slice)."""
    from torch.distributed.tensor import DTensor

    uneven, packed = [], []
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            if any(is_split(p) and not p.is_shard() for p in param.placements):
                packed.append(name)
            for placement in param.placements:
                dim = getattr(placement, "dim", None)
                if is_split(placement) and param.shape[dim] % mesh.size():
                    uneven.append(f"{name} {tuple(param.shape)} on dim {dim}")
    if packed:
        raise ValueError(
            f"FSDP2Strategy(tensor_parallel_size={mesh.size()}): the plan splits {packed[:5]}"
            f"{' ...' if len(packed) > 5 else ''} in packed pieces, which loads and checkpoints cannot read slice by"
            " slice yet. Pass tensor_parallel_plan={...} without those layers, or train without tensor parallelism."
        )
    if uneven:
        raise ValueError(
            f"FSDP2Strategy(tensor_parallel_size={mesh.size()}): these parameters do not split evenly over"
            f" {mesh.size()} ranks: {uneven[:5]}{' ...' if len(uneven) > 5 else ''}. Choose a tensor_parallel_size"
            " that divides their sizes (e.g. pad the vocabulary to a multiple), or leave those layers out of the plan."
        )


# =============================================================================================== during and after
def all_reduce_gradients_in_backward(module: nn.Module, mesh: DeviceMesh) -> None:
    """transformers' ``"replicated_with_grad_allreduce"`` (a norm inside the split heads, such as Qwen3's ``q_norm``:
    whole on every rank, but each rank's gradient covers its own heads only), done inside autograd: each forward uses
    the parameters through an identity whose backward sums the gradient over the tensor group. transformers' own
    version all-reduces ``param.grad`` after it accumulates, which under FSDP2's accumulation without reduction
    (``no_backward_sync``, ``accumulate_grad_batches``) would sum the earlier micro-batches' gradients again."""
    from transformers.distributed.parallel_utils import _AllReduceBackward

    group = mesh.get_group()
    originals: dict[str, nn.Parameter] = {}

    def through_identity(sub: nn.Module, args: Any) -> None:
        for name, param in sub._parameters.items():
            if param is not None and param.requires_grad and torch.is_grad_enabled():
                originals[name] = param
                sub._parameters[name] = _AllReduceBackward.apply(param, group)  # type: ignore[assignment]

    def restore(sub: nn.Module, args: Any, output: Any) -> None:
        sub._parameters.update(originals)
        originals.clear()

    module.register_forward_pre_hook(through_identity)
    module.register_forward_hook(restore, always_call=True)


def splits_on(tensor: Tensor, mesh: DeviceMesh) -> bool:
    """Whether ``tensor`` is a ``DTensor`` split along ``mesh``'s (1-D) dimension, whatever mesh it lives on (the
    tensor mesh itself before ``fully_shard``, the data-parallel x tensor mesh after)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    name = (mesh.mesh_dim_names or (None,))[0]
    return any(n == name and is_split(p) for n, p in zip(names, tensor.placements))


@torch.no_grad()
def broadcast_replicas(module: nn.Module, names: Iterable[str], mesh: DeviceMesh | None) -> None:
    """Make the tensors ``names`` that ``mesh`` does not split the same on all of its ranks (its rank 0's values):
    ``mesh`` is the layout's ranks that compute one batch together (a tensor group). Each rank drew its own random
    values for them, and a replicated weight that differs between the ranks computing one batch would give each rank
    another model. One tensor at a time, in name order (the same on every rank)."""
    if mesh is None:
        return
    from torch.distributed.tensor import DTensor

    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    group = mesh.get_group()
    source = dist.get_global_rank(group, 0)
    for name in sorted(names):
        tensor = tensors[name]
        if splits_on(tensor, mesh):
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        staged = local if local.device.type == mesh.device_type else local.to(mesh.device_type)
        dist.broadcast(staged, src=source, group=group)
        if staged is not local:
            local.copy_(staged)


def share_random_state(mesh: DeviceMesh) -> None:
    """Give every rank of a tensor group tensor rank 0's random state: dropout on the activations they share (the
    replicated input of a colwise layer, LoRA's) must drop the same elements on each, or the replicated weights
    would receive different gradients and drift apart. The ranks then draw alike for the rest of the run (they run
    the same code on the same batch)."""
    group = mesh.get_group()
    source = dist.get_global_rank(group, 0)
    states = [(torch.random.get_rng_state, torch.random.set_rng_state)]
    if mesh.device_type == "cuda":
        states.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state))
    for get, put in states:
        state = get().to(mesh.device_type)  # through the device for backends that need it (NCCL)
        dist.broadcast(state, src=source, group=group)
        put(state.cpu())


# =============================================================================================== helpers
def _tied_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Parameters held by more than one module (tied embeddings): each as its holders ``(module, attribute)``."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attribute, param in sub._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((sub, attribute))
    return [h for h in holders.values() if len(h) > 1]


def _retie(module: nn.Module, tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Tie again what the split untied: a style replaces the parameter of the module it is applied to, so each holder
    of a tied weight got a split copy of its own. Kept: the first, when every holder's is split alike (each holder's
    forward then expects that split); a weight split for one holder and left whole, or split otherwise, for another
    is refused (the other's forward would meet a split weight it has no style for)."""
    from torch.distributed.tensor import DTensor

    for holders in tied:
        params = [sub._parameters[attribute] for sub, attribute in holders]
        split = [p for p in params if isinstance(p, DTensor)]
        if not split:
            continue
        if len(split) < len(params) or any(p.placements != split[0].placements for p in split[1:]):
            names = [f"{type(sub).__name__}.{attribute}" for sub, attribute in holders]
            placements = [str(p.placements) if isinstance(p, DTensor) else "whole" for p in params]
            raise ValueError(
                f"FSDP2Strategy(tensor_parallel_size>1): the weight tied between {names} is split differently for"
                f" each ({placements}). Give every holder a style that splits it alike (a vocab-parallel embedding"
                " with a colwise head), leave all of them out of the plan, or untie the weights"
                " (tie_word_embeddings=False)."
            )
        for sub, attribute in holders:
            sub._parameters[attribute] = split[0]


def _models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models in ``module``, with their names."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    return outermost(module, PreTrainedModel)


def _model_names(module: nn.Module) -> str:
    models = [type(m).__name__ for _, m in _models(module)]
    return ", ".join(models) if models else type(module).__name__
