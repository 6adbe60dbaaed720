"""Meta-device construction, and giving each rank's shard real storage and values afterwards.

Three words, kept apart: *materialize* = allocate real storage for meta tensors;
*initialize* = give them values by the model's own rules; *load* = values from a checkpoint (``checkpoint/``).

Why meta at all: a model built eagerly occupies its full size on every rank before sharding can cut it down. Built on
``meta`` it costs nothing; after ``fully_shard`` each parameter is a ``DTensor`` whose local piece is this rank's
shard, and only that piece is allocated.

Why buffers stay real: non-persistent buffers (RoPE ``inv_freq``, causal masks) are in no checkpoint, and a meta
tensor has no values to recover them from. :func:`meta_init_context` therefore sends only *parameters* to ``meta``;
buffers are computed for real during construction (they are small). If the user builds under their own
``torch.device("meta")`` the buffers are meta too; then the model's own init rules must restore them (Hugging Face
models do), or :func:`check_initialized` names them.

Why a NaN sentinel: materialized storage is filled with NaN before the init rules run. Whatever a rule did not
write is still NaN afterwards, so a parameter that no rule covers is detected and named instead of training on
whatever bytes ``torch.empty`` returned.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Generator, Iterator, Set
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_fsdp2.layout import pieces_coordinate
from lightning_fsdp2.peft_support import modules_holding, peft_dora_rule, peft_lora_rule, peft_tuner_rule

__all__ = [
    "UninitializedError",
    "check_initialized",
    "initialize_from_loaded",
    "initialize_module",
    "materialize_module",
    "meta_init_context",
]


class UninitializedError(RuntimeError):
    """Raised when parameters or buffers were left without values after materialization."""


@contextmanager
def meta_init_context() -> Generator[None, None, None]:
    """Create parameters on ``meta`` and buffers for real while the block runs.

    Every ``nn.Parameter`` registered on a module is moved to ``meta`` the moment it is registered; whatever the
    module's ``__init__`` then does to it (``reset_parameters``) is a no-op. Tensors that are not parameters stay
    where they were created, so buffers keep the exact values an eager build gives them.

    Two patches of global state, both undone when the block ends (also after an error), and both the only way we know:

    * ``nn.Module.register_parameter`` (every ``self.weight = nn.Parameter(...)`` goes through it). A
      ``torch.device("meta")`` context would send buffers to ``meta`` too, and their values (RoPE ``inv_freq``) with
      them; accelerate's ``init_empty_weights(include_buffers=False)`` patches the same method for the same reason.
    * ``from_pretrained`` of transformers' and peft's models made to raise: the weights it reads would land on
      ``meta`` parameters and be dropped without a word.

    They are process-wide while the block runs: another thread building modules at the same time would be affected.
    Lightning runs ``configure_model`` (and Fabric ``init_module``) on the main thread, before training starts.

    And a torch function mode (thread-local, popped when the block ends) that creates the parameters of torch's own
    layers (``nn.Linear``, ``nn.Embedding``, convolutions, norms: most of a Llama's bytes) on ``meta`` in the first
    place. Without it each is allocated on the CPU and freed at once; glibc keeps the freed chunks in its heap, split
    by the small allocations that follow, so a 672M model left 1.5 GB of holes there, which later training steps
    touched a little more each step (the resident set grew ~23 MB a step until it reached the heap's size). Other
    parameters (transformers' ``Conv1D`` in GPT-2, a model's own ``nn.Parameter(torch.empty(...))``) still take the
    way through the CPU.
    """
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            meta = param.to("meta")
            new = nn.Parameter(meta, requires_grad=param.requires_grad) if type(param) is nn.Parameter else meta
            new.__dict__.update(param.__dict__)
            module._parameters[name] = new

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    refused = _refuse_loading_on_meta()
    layers_on_meta = _TorchLayersOnMeta()
    try:
        with layers_on_meta:
            yield
    finally:
        # A mode the user entered in the block and left entered would make the `with` pop theirs and leave ours on
        # the stack: made inert, it then changes nothing.
        layers_on_meta.done = True
        nn.Module.register_parameter = original  # type: ignore[method-assign]
        for cls, method in refused:
            setattr(cls, "from_pretrained", method)


# The __init__ code of torch's layers that create nothing but parameters, each with `torch.empty` (their
# `reset_parameters` then fills them: a no-op on meta). Only these exact code objects: a subclass's own __init__ may
# build buffers with `torch.empty`, and those must stay real.
_PARAMETER_ONLY_INITS = frozenset(
    cls.__init__.__code__
    for cls in (nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag, nn.modules.conv._ConvNd, nn.LayerNorm,
                nn.GroupNorm, nn.RMSNorm)
)


class _TorchLayersOnMeta(TorchFunctionMode):
    """``torch.empty`` called by one of :data:`_PARAMETER_ONLY_INITS` creates its tensor on ``meta``; everything else
    runs unchanged."""

    done = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.empty and not self.done and _caller_code() in _PARAMETER_ONLY_INITS:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _caller_code() -> Any:
    """The code that called the torch function, past the ``__torch_function__`` of modes entered after ours (a
    ``torch.device`` context, a user's mode) that passed the call on."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    return frame.f_code if frame is not None else None


def _refuse_loading_on_meta() -> list[tuple[type, Any]]:
    """Make ``from_pretrained`` raise while parameters go to ``meta``: the weights it loads would land on meta
    tensors and be lost, and the model would then be initialized at random without a word."""
    classes: list[type] = []
    try:
        from transformers import PreTrainedModel

        classes.append(PreTrainedModel)
    except ImportError:
        pass
    try:
        from peft import PeftModel

        classes.append(PeftModel)
    except ImportError:
        pass

    def refuse(cls: type, *args: Any, **kwargs: Any) -> None:
        if any(kwargs.get(k) is not None for k in ("distributed_config", "tp_plan", "tp_size")):
            raise RuntimeError(
                f"{cls.__name__}.from_pretrained(..., distributed_config=... / tp_plan=...) was called in"
                " `configure_model` (or `fabric.init_module()`): transformers would shard the model itself, and FSDP2Strategy does not take"
                " over a model sharded elsewhere. Build it with `from_config(...)` and declare its weights with"
                " load_pretrained (each rank reads only its shards' slices, as transformers' loader does);"
                " DistributedConfig's dp_replicate_size/fsdp_size are FSDP2Strategy(device_mesh=(replicate, shard))."
            )
        raise RuntimeError(
            f"{cls.__name__}.from_pretrained was called in `configure_model` (or `fabric.init_module()`) while"
            " FSDP2Strategy builds parameters on the meta device: the loaded weights would be dropped. Build the model"
            " with `from_config(...)` (and peft's `get_peft_model`) and declare its weights with load_pretrained, read"
            " after sharding; or pass FSDP2Strategy(meta_init=False) to build and load the whole model on the CPU"
            " first."
        )

    saved = [(cls, cls.__dict__["from_pretrained"]) for cls in classes if "from_pretrained" in cls.__dict__]
    for cls, _ in saved:
        setattr(cls, "from_pretrained", classmethod(refuse))
    return saved


def named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Parameters then buffers of ``module`` with their clean names (each shared tensor once)."""
    yield from module.named_parameters()
    yield from module.named_buffers()


def meta_tensor_names(module: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``module`` that are still on ``meta``."""
    return [name for name, tensor in named_tensors(module) if tensor.is_meta]


def materialize_module(
    module: nn.Module,
    device: torch.device,
    buffer_device: torch.device | None = None,
    to_load: Set[str] = frozenset(),
) -> list[str]:
    """Allocate real storage on ``device`` for every meta tensor of ``module``; return their names.

    On a sharded model this allocates only the local shard of each parameter. New storage is filled with NaN
    (integers with their maximum) so that :func:`check_initialized` can tell what no rule wrote. Tensors that are
    already real (buffers built eagerly, parameters of a module built outside ``meta``) keep their values and are
    only moved. Buffers go to ``buffer_device`` (default ``device``): with CPU offload the sharded parameters live in
    CPU memory, but buffers are used as they are by the forward on the accelerator. Tensors named in
    ``to_load`` are left unfilled: a pretrained load is about to copy every element of their shards, and filling
    gigabytes only to overwrite them costs real time.
    """
    materialized = meta_tensor_names(module)
    if not materialized:
        return []
    buffer_ids = {id(b) for b in module.buffers()}
    unfilled = {id(t) for name, t in named_tensors(module) if name in to_load}

    def allocate(tensor: Tensor) -> Tensor:
        target = (buffer_device or device) if id(tensor) in buffer_ids else device
        if not tensor.is_meta:
            return tensor.to(target)
        out = torch.empty_like(tensor, device=target)
        if id(tensor) in unfilled:
            return out
        return out.fill_(_sentinel(out.dtype)) if out.dtype != torch.bool else out.zero_()

    # `_apply` is what `Module.to_empty` uses; FSDP2 hooks it to re-register the new local shards. Unlike
    # `to_empty`, this keeps the values of tensors that were already real.
    with torch.no_grad():
        module._apply(allocate)
    return materialized


def _sentinel(dtype: torch.dtype) -> float | int:
    return math.nan if dtype.is_floating_point or dtype.is_complex else torch.iinfo(dtype).max


InitRule = Callable[[nn.Module, set[str]], None]
"""An initialization rule ``(model, materialized_names)``: gives values to materialized tensors, in place."""


@torch.no_grad()
def initialize_module(module: nn.Module, materialized: list[str], rules: list[InitRule] | None = None) -> None:
    """Initialize the materialized tensors of a model by the rules its own code would have applied eagerly.

    The default rules run in the order an eager build applies them:

    1. PyTorch's own: ``reset_parameters()`` (or ``_reset_parameters()``, as in ``nn.MultiheadAttention`` and
       ``nn.Transformer``), children before parents, just as constructors run.
    2. Hugging Face: each outermost ``PreTrainedModel``'s ``initialize_weights()`` (its ``_init_weights``), which
       also recomputes rotary ``inv_freq`` buffers.
    3. peft: ``reset_lora_parameters`` with each adapter's own ``init_lora_weights`` (``lora_B`` zero; AdaLoRA's
       own), then the other tuners' reset methods (IA3, LoHa, LoKr, VeRA), last, since adapters are injected after
       the base model is built. DoRA's magnitudes derive from the loaded base weights:
       :func:`initialize_from_loaded` gives them values later.

    Only modules holding a materialized tensor are touched, so values that were real before (buffers computed during
    construction, parts built outside ``meta``) survive. On CPU meshes, where DTensor has no distributed RNG, random
    draws use a seed derived from the current one and the rank's shard coordinate, so shards of one weight are not
    copies of each other, and replicas of one shard (HSDP) are.
    """
    if not materialized:
        return
    rules = default_init_rules() if rules is None else rules
    names = set(materialized)
    with _distinct_rng_per_shard(module):
        for rule in rules:
            rule(module, names)


def default_init_rules() -> list[InitRule]:
    """The rules :func:`initialize_module` applies by default, in order."""
    return [reset_parameters_rule, hf_init_rule, peft_lora_rule, peft_tuner_rule]


@torch.no_grad()
def initialize_from_loaded(module: nn.Module, materialized: list[str]) -> None:
    """Give values to the materialized tensors whose initial values derive from the base weights, once those hold
    their final (loaded) values: DoRA's magnitude vectors are the norms of the pretrained weights' rows.

    Call on every rank after the pretrained weights are loaded: the rule gathers each adapted weight whole (a
    collective, in module order, the same on every rank).
    """
    if materialized:
        peft_dora_rule(module, set(materialized))


def reset_parameters_rule(module: nn.Module, materialized: set[str]) -> None:
    """Call ``reset_parameters`` (or ``_reset_parameters``) on modules holding materialized tensors, post-order."""
    holders = modules_holding(module, materialized)
    for name, sub in reversed(list(module.named_modules())):
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if callable(reset) and name in holders:
            reset()


def hf_init_rule(module: nn.Module, materialized: set[str]) -> None:
    """Run Hugging Face's own weight init on every outermost ``PreTrainedModel`` inside ``module``.

    Tensors that were real before materialization get Hugging Face's ``_is_hf_initialized`` mark for the duration,
    so its guarded init functions leave them alone; module marks left from the meta build are cleared first.
    """
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return
    keep = [t for name, t in named_tensors(module) if name not in materialized]
    for tensor in keep:
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    try:
        for _, sub in outermost(module, PreTrainedModel):
            for m in sub.modules():
                m.__dict__.pop("_is_hf_initialized", None)
            sub.initialize_weights()
    finally:
        for tensor in keep:
            tensor.__dict__.pop("_is_hf_initialized", None)


def outermost(module: nn.Module, cls: type) -> list[tuple[str, nn.Module]]:
    """Instances of ``cls`` in ``module`` that are not inside another instance, with their names (pre-order sees
    parents first)."""
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, cls) and not any(n == "" or name.startswith(f"{n}.") for n, _ in found):
            found.append((name, sub))
    return found


@contextmanager
def _distinct_rng_per_shard(module: nn.Module) -> Generator[None, None, None]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._random import is_rng_supported_mesh

    dtensor = next((p for p in module.parameters() if isinstance(p, DTensor)), None)
    if dtensor is None or not dist.is_initialized():
        yield
        return
    import warnings

    with warnings.catch_warnings():
        # DTensor repeats this on every random op on a CPU mesh; the per-rank seed below is our answer to it.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        if is_rng_supported_mesh(dtensor.device_mesh):
            yield
            return
        # The rank's coordinate among the distinct pieces the parameters hold (from their placements: HSDP's
        # replicas share one): ranks holding the same shards draw the same values, ranks holding different shards
        # different ones. (Parameters tensor parallelism leaves whole are then made equal over each tensor group
        # afterwards: `tensor_parallel.broadcast_replicas`.) The base seed is rank 0's: without `seed_everything`
        # each process starts from its own random seed, and replicas would then differ.
        base = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)
        dist.broadcast(base, src=0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((int(base) + 7919 * pieces_coordinate(module.parameters())) % 2**63)
            yield


def check_initialized(module: nn.Module, names: list[str], device: torch.device) -> None:
    """Raise :class:`UninitializedError` naming every tensor in ``names`` that still holds the sentinel.

    Every rank checks its own shards, then one all-reduce makes all ranks agree, so all raise (or none does) and
    no rank is left waiting in a collective.
    """
    if not names:
        return
    tensors = dict(named_tensors(module))
    flags = torch.tensor([_holds_sentinel(tensors[name]) for name in names], dtype=torch.int32, device=device)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    missing = [name for name, flag in zip(names, flags.tolist()) if flag]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        raise UninitializedError(
            f"{len(missing)} tensor(s) built on the meta device were given no values by any init rule: {shown}. "
            "Give their module a `reset_parameters()` method, or build them outside `torch.device('meta')` "
            "(FSDP2Strategy already keeps buffers real unless you wrap configure_model in torch.device('meta')), "
            "or pass FSDP2Strategy(meta_init=False) to build the whole model for real."
        )


def _holds_sentinel(tensor: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel() == 0 or local.dtype == torch.bool:
        return False
    if local.dtype.is_floating_point or local.dtype.is_complex:
        return bool(torch.isnan(local).any())
    return bool((local == torch.iinfo(local.dtype).max).any())
