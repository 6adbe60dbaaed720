"""What is done to the blocks' forwards before they are sharded: activation checkpointing (whole modules, every n-th,
or op-level selective), ``torch.compile`` per block, and activation offloading to CPU memory.

The order is torchtitan's: checkpointing, then compile, then ``fully_shard`` (``wrap.py``). Nothing here adds a
wrapper module, so parameter names and checkpoints are the same with and without these options:

* checkpointing outside a compiled block uses the composable ``checkpoint`` (hooks on the module);
* a compiled block gets a ``forward`` that runs its class's ``forward`` through ``torch.compile`` in training, with
  the checkpointing *inside* the compiled function (``torch.utils.checkpoint``): the compiler then sees which
  activations are recomputed, and an op-level policy is honoured (outside, the compiled kernels would run under the
  policy's dispatch mode unseen, and everything would be recomputed). FSDP2's hooks are on the module's ``__call__``,
  outside the compiled function: the all-gathers run eagerly, as ``fully_shard`` expects (transformers' own
  checkpointing wraps ``forward`` for the same reason).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from typing import Any, Literal, Union

import torch
from torch import nn

from lightning_fsdp2.wrap import ModulePolicy, inside, resolve_policy

SavePolicy = Union[Literal["matmuls"], Collection[Any], Callable[..., Any]]
"""Op-level selective checkpointing: what a checkpointed module saves instead of recomputing. ``"matmuls"`` (the
outputs of matrix multiplications and attention kernels, see :func:`matmul_ops`), a collection of ATen operators
(``torch.ops.aten.mm.default``...), or a policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` as
``torch.utils.checkpoint.create_selective_checkpoint_contexts`` takes."""


def matmul_ops() -> set[Any]:
    """The operators ``save="matmuls"`` saves: matrix multiplications and the fused attention kernels (the
    compute-intensive ops torchtitan's selective checkpointing saves; everything else, norms, activations, rotary
    embeddings, is cheap to recompute). Those this build of torch lacks are left out."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def context_fn(save: SavePolicy | None) -> Callable[[], Any] | None:
    """The ``context_fn`` of ``torch.utils.checkpoint`` for an op-level policy (``None``: recompute everything)."""
    if save is None:
        return None
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    if callable(save):
        policy = save
    else:
        ops = matmul_ops() if save == "matmuls" else set(save)

        def policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def check_save_policy(save: Any) -> None:
    """Refuse a ``activation_checkpointing_save`` that is none of the accepted forms (at construction)."""
    if save is None or save == "matmuls" or callable(save):
        return
    if isinstance(save, str) or not isinstance(save, Collection) or not all(isinstance(op, torch._ops.OpOverload) for op in save):
        raise TypeError(
            f"FSDP2Strategy(activation_checkpointing_save={save!r}): pass 'matmuls', a collection of ATen operators such as"
            " {torch.ops.aten.mm.default}, or a policy function (ctx, op, *args, **kwargs) -> CheckpointPolicy"
            " (see torch.utils.checkpoint.create_selective_checkpoint_contexts)."
        )


def checkpointed_names(model: nn.Module, policy: ModulePolicy, every: int = 1) -> list[str]:
    """The modules to checkpoint: every ``every``-th of those ``policy`` selects, in ``named_modules`` order (with 2:
    the second, fourth...; torchtitan counts the same way)."""
    select = resolve_policy(policy, model)
    chosen = [name for name, module in model.named_modules() if name and select(name, module)]
    return chosen[every - 1 :: every]


def apply_activation_checkpointing(model: nn.Module, names: list[str], save: SavePolicy | None = None) -> None:
    """Recompute the activations of the modules ``names`` in backward instead of storing them (all of them, or, with
    ``save``, all but the outputs of the ops it names), with the composable ``checkpoint`` (hooks, no wrapper module,
    so names stay clean). Must run before ``fully_shard``; the recomputation re-enters FSDP's pre-forward hook. For
    compiled blocks, :func:`compile_blocks` places the checkpoint itself."""
    from torch.distributed._composable import checkpoint

    context = context_fn(save)
    for name in names:
        module = model.get_submodule(name)
        checkpoint(module) if context is None else checkpoint(module, context_fn=context)


def compile_blocks(
    model: nn.Module,
    names: list[str],
    options: Mapping[str, Any],
    checkpointed: Collection[str] = (),
    save: SavePolicy | None = None,
) -> None:
    """Give each module in ``names`` a ``forward`` that runs its class's ``forward`` through ``torch.compile``
    (``options``: its keyword arguments) in training, checkpointed inside the compiled code for those in
    ``checkpointed`` (``save``: the op-level policy).

    The module is not wrapped (no ``_orig_mod`` in any name) and its hooks, FSDP2's all-gathers among them, run
    outside the compiled code. The class's ``forward`` is looked up at each call, so a wrapper the class gets later
    (transformers' ``GradientCheckpointingLayer`` wraps the ``FSDP<Layer>`` class that ``fully_shard`` makes) still
    runs. One compiled function serves every block, the module an argument: dynamo treats the parameters as inputs,
    so a stack of identical blocks compiles once (plus once for a block whose input needs no gradient, the first one
    under LoRA). Only training forwards (training mode, gradients enabled) are compiled: evaluation and generation,
    with a key/value cache (whose per-layer index would compile each layer anew) and no autograd, run eagerly.

    Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): a graph traced for
    one block would serve another whose submodules carry other hooks, and skip them. So blocks whose submodules
    carry hooks get compiled functions of their own (by the hooks they carry), and each call of this function makes
    new ones (a new code object: dynamo keeps its cache on the code, so a second model in the process compiles
    afresh instead of running the first one's graphs). Hooks registered on a submodule after the first step are not
    seen: dynamo's own rule, which the docs repeat.
    """
    compiled_for: dict[tuple[bool, tuple[int, ...]], Callable] = {}
    watch = _GraphWatch()
    for name in names:
        module = model.get_submodule(name)
        key = (name in checkpointed, _inner_hooks(module))
        if key not in compiled_for:
            function = _checkpointed_class_forward(context_fn(save)) if key[0] else _class_forward
            compiled_for[key] = torch.compile(_fresh(function), **options)
        compiled = compiled_for[key]

        def forward(*args: Any, _module: nn.Module = module, _compiled: Callable = compiled, _name: str = name,
                    **kwargs: Any) -> Any:
            if _module.training and torch.is_grad_enabled():
                if watch.pending(_name):
                    return watch.first_call(_name, _compiled, _module, *args, **kwargs)
                return _compiled(_module, *args, **kwargs)
            return _class_forward(_module, *args, **kwargs)

        module.forward = forward


class _GraphWatch:
    """Warn once, on rank 0, when a compiled block's first training forward broke its graph or compiled none (it
    then runs eagerly, or in pieces, without a word from torch): a hook on a submodule, a data-dependent branch, an
    unsupported call. Read from dynamo's counters around each block's first compiled call only (compilation happens
    there, synchronously), so later steps pay nothing. "No graph" means dynamo tried to compile a frame in that call
    and made no graph: a call served from dynamo's cache (a second model compiled in the same process shares the
    compiled code), or dynamo turned off (``TORCH_COMPILE_DISABLE=1``), is not one. Only rank 0 looks and speaks:
    the ranks run the same code, so they break the same way."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._warned = False

    def pending(self, name: str) -> bool:
        return name not in self._seen

    def first_call(self, name: str, compiled: Callable, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self._seen.add(name)
        counters = _dynamo_counters()
        if counters is None or self._warned:
            return compiled(module, *args, **kwargs)
        breaks = dict(counters["graph_break"])
        graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["total"]
        out = compiled(module, *args, **kwargs)
        new_breaks = {k: v - breaks.get(k, 0) for k, v in counters["graph_break"].items() if v > breaks.get(k, 0)}
        tried = counters["frames"]["total"] > frames
        no_graph = tried and counters["stats"]["unique_graphs"] == graphs
        if new_breaks or no_graph:
            self._warned = True
            _warn_on_rank_zero(name, new_breaks, no_graph)
        return out


def _dynamo_counters() -> Any:
    """dynamo's statistics (``torch._dynamo.utils.counters``: graphs made, graph breaks and their reasons), or None
    where this torch has none: then nothing is checked."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every torch this package supports has them
        return None
    return counters


def _warn_on_rank_zero(name: str, breaks: Mapping[str, int], no_graph: bool) -> None:
    import warnings

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    what = [f"broke its graph {sum(breaks.values())} time(s)"] if breaks else []
    what += ["compiled no graph (it ran eagerly)"] if no_graph else []
    # torch's reasons: a first line and an explanation each; the same reason for several calls only once
    reasons = {" ".join(line.strip() for line in reason.strip().splitlines()[:2] if line.strip()) for reason in breaks}
    causes = "; ".join(sorted(r.rstrip(".") for r in reasons)) or "torch gave none"
    warnings.warn(
        f"FSDP2Strategy(compile=...): block {name!r} {' and '.join(what)} in its first training step; torch's"
        f" reason: {causes}. The block trains correctly, but not compiled (or in pieces). Common causes: a forward"
        " hook on a module inside the block that changes outside state (appends to a list: register it on the block"
        " itself, or remove it while training), a .item() or print in a forward. TORCH_LOGS=graph_breaks prints"
        " torch's full report. Given once, for the first such block.",
        stacklevel=1,  # raised from inside the training step: no line of the user's points at the cause
    )


def _inner_hooks(block: nn.Module) -> tuple[int, ...]:
    """The identities of the forward (pre-)hooks on the block's submodules (its own run outside the compiled code)."""
    return tuple(id(hook) for sub in block.modules() if sub is not block
                 for hooks in (sub._forward_pre_hooks, sub._forward_hooks) for hook in hooks.values())


def _fresh(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own: dynamo's cache of compiled graphs lives on the code object."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def _class_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(module).forward(module, *args, **kwargs)


def _checkpointed_class_forward(context: Callable[[], Any] | None) -> Callable[..., Any]:
    """``_class_forward`` under ``torch.utils.checkpoint``: compiled, the checkpoint becomes part of the graph and
    the compiler recomputes what it says (an op-level ``context`` included)."""
    from torch.utils.checkpoint import checkpoint

    extra = {} if context is None else {"context_fn": context}

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(lambda *a, **k: type(module).forward(module, *a, **k), *args, use_reentrant=False,
                          **extra, **kwargs)

    return forward


def check_compile_options(options: Mapping[str, Any]) -> None:
    """Refuse keyword arguments ``torch.compile`` does not take (at construction, not at the first step)."""
    import inspect

    known = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"FSDP2Strategy(compile={dict(options)!r}): torch.compile takes no {unknown}. Pass True, or a dict of"
            f" torch.compile's keyword arguments ({', '.join(sorted(known))})."
        )


def check_checkpointing_with_compile(checkpointed: list[str], compiled: list[str]) -> None:
    """With ``compile``, only whole compiled blocks can be checkpointed: the checkpoint must sit inside the compiled
    function (see the module's docstring); a checkpointed module inside or around a block would put hooks the
    compiler cannot honour inside or around its code."""
    stray = [n for n in checkpointed if n not in compiled]
    if stray:
        raise ValueError(
            f"With FSDP2Strategy(compile=...), activation checkpointing applies to whole compiled blocks ({compiled[:3]}"
            f"...), but activation_checkpointing_policy selected {stray[:3]}. Select the blocks (the classes of"
            " auto_wrap_policy), and use activation_checkpointing_save for finer, op-level choices."
        )


def offload_activations(roots: list[nn.Module]) -> None:
    """Keep the activations autograd saves for backward in pinned CPU memory from each root's training forward until
    backward needs them, as torchtune's activation offloading does (its own ``saved_tensors_hooks``, not
    ``torch.autograd.graph.save_on_cpu``, which would also move every saved weight). Hooks on the roots, so whichever
    front-end calls them gets it. CUDA only (the strategy refuses it elsewhere).

    Left on the GPU: parameters and views of them (a matmul saves its weight, here FSDP2's gathered one: copying it
    out and back every step would move the whole model), tensors under 1 KiB (not worth a copy), and what a
    recomputation saves during backward (activation checkpointing's, needed at once).
    """
    for root in roots:
        stack = ExitStack()

        def before(module: nn.Module, _args: Any, _stack: ExitStack = stack) -> None:
            in_backward = torch._C._current_graph_task_id() != -1
            if module.training and torch.is_grad_enabled() and not in_backward:
                _stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device))

        def after(_module: nn.Module, _args: Any, _output: Any, _stack: ExitStack = stack) -> None:
            _stack.close()

        root.register_forward_pre_hook(before)
        root.register_forward_hook(after, always_call=True)


_OFFLOAD_MIN_BYTES = 1024  # torchtune's threshold too


def _to_host(tensor: torch.Tensor) -> Any:
    base = tensor if tensor._base is None else tensor._base
    if (tensor.device.type != "cuda" or isinstance(base, nn.Parameter)
            or tensor.numel() * tensor.element_size() < _OFFLOAD_MIN_BYTES):
        return tensor
    host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
    host.copy_(tensor, non_blocking=True)  # ordered before the copy back on the same stream
    return tensor.device, host


def _to_device(packed: Any) -> torch.Tensor:
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=True)


def no_kv_cache_in_training(model: nn.Module, modules: list[str]) -> None:
    """Turn the key/value cache off for the training forwards of the Hugging Face models (``PreTrainedModel``) in
    ``model`` that hold one of ``modules`` (checkpointed or compiled ones) and have ``config.use_cache=True``.

    A model that returns its key/value cache from a training forward (T5 does by default) makes the recomputed forward
    save other tensors than the first one, which torch's checkpoint refuses ("A different number of tensors was
    saved"). In a compiled block the cache's updates break the graph, and its per-layer index makes every layer
    compile anew. Transformers' own checkpointing turns the cache off when ``self.training`` and gradients are enabled;
    the hooks registered here do the same around each such forward, and put the setting back after it (also after an
    error): generation and evaluation keep the cache, and the config saved with the model is unchanged. Hooks on the
    model, so it holds whichever front-end calls it (the Trainer's steps, a Fabric loop).
    """
    from transformers import PreTrainedModel

    seen: list[Any] = []
    for name, sub in model.named_modules():
        # The Hugging Face models themselves, whose forward the steps call (through peft's wrapper, if any): not any
        # module with a `config` attribute (a LightningModule keeping `self.config` is never called as a module).
        config = getattr(sub, "config", None) if isinstance(sub, PreTrainedModel) else None
        holds = any(inside(c, name) for c in modules)
        if not (getattr(config, "use_cache", False) and holds) or any(config is c for c in seen):
            continue
        seen.append(config)
        saved: list[bool] = []

        def before(module: nn.Module, _args: Any, config: Any = config, saved: list[bool] = saved) -> None:
            saved.append(config.use_cache)
            if module.training and torch.is_grad_enabled():
                config.use_cache = False

        def after(_module: nn.Module, _args: Any, _output: Any, config: Any = config, saved: list[bool] = saved) -> None:
            if saved:
                config.use_cache = saved.pop()

        sub.register_forward_pre_hook(before)
        sub.register_forward_hook(after, always_call=True)
