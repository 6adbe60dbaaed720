"""``FSDP2Strategy(device_mesh="auto")``: the layout chosen from the memory the run needs.

Sharding the frozen base of a LoRA model costs two all-gathers of every block per step that its tiny gradients never
repay: where a whole replica fits, replicating it (a shard group of one rank: DDP's traffic, the adapters' gradients
all-reduced) is faster; where it does not, sharding is what makes the run fit at all. Which holds depends on the model,
the precision, the trainable set and the memory of the device, so the choice is made once the model exists on
``meta``, before anything is allocated, in three pure steps:

1. :func:`measure_model` reads what the estimate needs from the model built on ``meta`` (already converted to its
   storage dtype): each future FSDP group's parameters (shape, bytes at rest, bytes gathered, trainable or not),
   and, when the per-rank batch shape is known, the activations one training forward saves for backward (one forward
   on ``meta`` under ``torch.autograd.graph.saved_tensors_hooks``: no memory, the model's own autograd decides);
2. :func:`estimate` gives one candidate layout's per-rank bytes by component (:class:`Estimate`);
3. :func:`choose` takes the first candidate of :func:`candidates` (fastest first) whose estimate fits the budget.

The budget (:func:`available_memory`: the device's free memory, or on CPU the available memory shared by the local
processes; or ``memory_budget=``) is agreed on every rank (the smallest), so every rank makes the same choice.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_fsdp2.blocks import checkpointed_names
from lightning_fsdp2.context_parallel import causal_lms
from lightning_fsdp2.layout import CONTEXT, REPLICATE, SHARD, Layout
from lightning_fsdp2.precision import PrecisionCore
from lightning_fsdp2.wrap import ModulePolicy, block_names, root_names

ADAM_STATES = 2
"""Optimizer state per trainable element, in the parameter's dtype, that the strategy assumes (Adam/AdamW: two
moments). The optimizer is made after the model is set up, so it cannot be asked; SGD with momentum needs one,
plain SGD none: the estimate errs on the safe side for them."""

ACTIVATION_MARGIN = 0.25
"""Share of the budget held back for activations when they cannot be estimated (no ``batch_shape``, or a model whose
forward cannot run on ``meta``)."""

ALLOCATOR_SHARE = {"cpu": 1.0, "cuda": 0.1}
"""What the allocator holds beyond the live tensors, as a share of the memory that is allocated and freed every step
(everything but the parameters at rest and the optimizer's state, which is made at the first step and kept). On CPU
glibc keeps freed memory for reuse and the resident set counts it: measured 0.6-1.3 of it at 58M-551M parameters (``benchmarks/auto_layout.py --estimate``; with glibc giving freed
memory back, ``MALLOC_TRIM_THRESHOLD_=0 MALLOC_MMAP_THRESHOLD_=65536``, the estimate without it is within 8% of the
resident set). On CPU, blocks freed after forward cost more (:func:`estimate`). On CUDA the caching allocator reuses
its blocks; 0.1 for fragmentation is not measured yet (``benchmarks/gpu.py``)."""

FITS_IN = 0.85
"""A layout fits when its estimate is at most this share of the budget: the headroom the measured errors need
(the estimate was up to 12% under the measured peak: 58M fully fine-tuned, fully sharded)."""

NF4_BYTES_PER_ELEMENT = 0.5 + 1 / 64 + 4 / (64 * 256)
"""torchao's NF4: 4 bits a weight, one int8 scaler per block of 64, one float factor per 256 scalers."""

BatchShape = tuple[int, int]
"""``(sequences per rank per step, tokens per sequence)``: the shape of a training batch, for the activations'
estimate."""


@dataclass(frozen=True)
class TensorSize:
    """One parameter as the estimate sees it."""

    rows: int  # size of dim 0, the one FSDP2 splits (1 for a scalar)
    numel: int
    stored: float  # bytes per element at rest (the storage dtype; NF4 about half a byte)
    gathered: float  # bytes per element while gathered (the mixed-precision policy's param_dtype, else stored)
    trainable: bool

    def sharded_numel(self, shard: int) -> int:
        """Elements one rank holds: FSDP2 splits dim 0 in ``shard`` chunks of ``ceil(rows / shard)`` rows."""
        return math.ceil(self.rows / shard) * (self.numel // max(self.rows, 1))


@dataclass(frozen=True)
class GroupSize:
    """One future FSDP group: its parameters, and whether it is a root (kept gathered through the whole step)."""

    name: str
    tensors: tuple[TensorSize, ...]
    root: bool

    def gathered_bytes(self, trainable_only: bool = False) -> int:
        return int(sum(t.numel * t.gathered for t in self.tensors if t.trainable or not trainable_only))

    def gradient_bytes(self) -> int:
        """The unsharded gradients of the group in backward, before the reduce-scatter."""
        return int(sum(t.numel * t.gathered for t in self.tensors if t.trainable))


@dataclass(frozen=True)
class ModelSize:
    """What :func:`estimate` needs of a model: its groups, and the activations of one training step on one rank
    (``None``: unknown, a margin is held back instead)."""

    groups: tuple[GroupSize, ...]
    activations: int | None = None
    activations_note: str = ""
    checkpointed: bool = False  # some activations are recomputed in backward (activation checkpointing)
    context_sizes: tuple[int, ...] = ()
    """The context-parallel group sizes the model can be split over (a Hugging Face causal LM whose query heads they
    divide: ``context_parallel.causal_lms``); empty: none."""

    @property
    def parameters(self) -> int:
        return sum(t.numel for g in self.groups for t in g.tensors)

    @property
    def trainable(self) -> int:
        return sum(t.numel for g in self.groups for t in g.tensors if t.trainable)


@dataclass(frozen=True)
class Estimate:
    """One candidate layout's estimated per-rank bytes, by component (see docs/how-it-works.md, "device_mesh='auto'")."""

    replicate: int
    shard: int
    reshard_after_forward: bool
    parameters: int  # the shards at rest
    gradients: int  # the trainable parameters' sharded gradients
    optimizer: int  # their optimizer state
    gathered: int  # gathered parameters and unsharded gradients at the step's peak
    activations: int  # saved for backward (estimated), or the margin
    allocator: int = 0  # what the allocator holds beyond live tensors (ALLOCATOR_SHARE)
    frozen_plain: bool = False  # whole replicas whose frozen parameters FSDP2 leaves alone (plain tensors)
    context: int = 1  # ranks each sequence is split over (context parallelism), inside the shard group

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations + self.allocator

    def fits(self, budget: int) -> bool:
        """Whether this estimate fits ``budget`` with the headroom the measured errors need (:data:`FITS_IN`)."""
        return self.total <= FITS_IN * budget

    @property
    def mesh(self) -> tuple[int, int]:
        """The ``device_mesh=(replicate, shard)`` that asks for this layout (with :attr:`context`, the sizes by
        name: :meth:`option`)."""
        return (self.replicate, self.shard)

    def option(self) -> tuple[int, int] | dict[str, int]:
        """The ``device_mesh`` that asks for this layout."""
        if self.context == 1:
            return self.mesh
        return {"replicate": self.replicate, "shard": self.shard, "context": self.context}

    def describe(self) -> str:
        kind = ("replicated, frozen parameters plain (DDP-like)" if self.frozen_plain else
                "replicated (DDP-like)" if self.shard == 1 and self.context == 1 else
                f"fully sharded, sequences split over {self.context} ranks" if self.context > 1 else
                "fully sharded" if self.replicate == 1 else "HSDP")
        return (f"device_mesh={self.option()} [{kind}],"
                f" reshard_after_forward={self.reshard_after_forward}")


@dataclass(frozen=True)
class LayoutChoice:
    """What ``device_mesh="auto"`` found: every candidate's estimate (fastest first), the budget, and the one
    chosen (``None`` from :func:`estimate_layouts` without a budget)."""

    candidates: tuple[Estimate, ...]
    budget: int | None
    chosen: Estimate | None
    activations_note: str
    budget_given: bool = True  # memory_budget; else the device's free memory when the run started

    @property
    def layout(self) -> Layout:
        assert self.chosen is not None
        return layout_of(self.chosen)

    def table(self) -> str:
        """The estimates as a table (bytes per rank, in units by size), the chosen row marked."""
        head = ("| layout | reshard after forward | parameters | gradients | optimizer | gathered | activations |"
                " allocator | total | fits |")
        lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for e in self.candidates:
            fits = "-" if self.budget is None else ("yes" if e.fits(self.budget) else "no")
            mark = " (chosen)" if e is self.chosen else ""
            shown = f"({e.replicate}, {e.shard})" + (f" x context {e.context}" if e.context > 1 else "")
            lines.append(
                f"| {shown}{mark} | {e.reshard_after_forward} | {_size(e.parameters)} |"
                f" {_size(e.gradients)} | {_size(e.optimizer)} | {_size(e.gathered)} | {_size(e.activations)} |"
                f" {_size(e.allocator)} | {_size(e.total)} | {fits} |"
            )
        return "\n".join(lines)

    def describe(self) -> str:
        """What the strategy prints once on rank 0."""
        chosen = self.chosen.describe() if self.chosen is not None else "none"
        return (f"FSDP2Strategy(device_mesh='auto') chose {chosen}: estimated memory per rank against"
                f" {_budget_words(self.budget, self.budget_given)}; activations: {self.activations_note}.\n"
                f"{self.table()}")


def layout_of(estimate: Estimate) -> Layout:
    """The :class:`Layout` of a candidate (1-D when every rank shards, as ``device_mesh=None`` makes it)."""
    if estimate.context > 1:
        names = ((REPLICATE,) if estimate.replicate > 1 else ()) + (SHARD, CONTEXT)
        sizes = ((estimate.replicate,) if estimate.replicate > 1 else ()) + (estimate.shard, estimate.context)
        return Layout(names, sizes)
    if estimate.replicate == 1:
        return Layout((SHARD,), (estimate.shard,))
    return Layout((REPLICATE, SHARD), (estimate.replicate, estimate.shard))


# ------------------------------------------------------------------------------------------------ 1. the model
def measure_model(
    model: nn.Module,
    blocks: Sequence[str],
    roots: Sequence[str],
    *,
    gathered_dtype: torch.dtype | None = None,
    nf4: Iterable[str] = (),
    batch_shape: BatchShape | None = None,
    checkpointed: Sequence[str] = (),
) -> ModelSize:
    """Read the groups of ``model`` (built on ``meta``, in its storage dtype): ``blocks`` (the modules ``fully_shard``
    will be applied to, inner-first) and ``roots`` (those sharded last, which take every remaining parameter).
    ``gathered_dtype``: the mixed-precision policy's ``param_dtype`` (floating parameters are gathered in it).
    ``nf4``: names of the weights ``load_pretrained(..., quantize="nf4")`` stores in NF4. ``batch_shape``:
    ``(sequences, tokens)`` of one rank's micro-batch, to estimate the activations (:func:`saved_activations`);
    ``checkpointed``: the modules whose activations are recomputed in backward."""
    nf4 = set(nf4)
    claimed: set[int] = set()
    groups = []
    owners = [(name, model.get_submodule(name), False) for name in sorted(blocks, key=lambda n: -n.count("."))]
    owners += [(name, model.get_submodule(name), True) for name in roots]
    for name, module, is_root in owners:
        tensors = []
        for pname, param in module.named_parameters():
            if id(param) in claimed:
                continue
            claimed.add(id(param))
            full = f"{name}.{pname}" if name else pname
            tensors.append(_tensor_size(param, gathered_dtype, full in nf4))
        if tensors:
            groups.append(GroupSize(name, tuple(tensors), is_root))
    activations, note = (None, f"{ACTIVATION_MARGIN:.0%} of the budget held back (no batch_shape given)")
    contexts: tuple[int, ...] = ()
    if batch_shape is not None:
        activations, note = saved_activations(model, batch_shape, checkpointed)
        contexts = context_sizes(model, batch_shape[1])
    return ModelSize(tuple(groups), activations, note, checkpointed=bool(checkpointed), context_sizes=contexts)


def context_sizes(model: nn.Module, tokens: int) -> tuple[int, ...]:
    """The context-parallel group sizes (above 1, up to ``tokens``) ``model`` can be split over: every one its Hugging
    Face causal LMs accept (``context_parallel.causal_lms``: dense, ``sdpa``/``eager`` attention, query heads they
    divide); none for other models."""
    heads = [getattr(getattr(m, "config", None), "num_attention_heads", None) for m in model.modules()
             if type(m).__name__.endswith("ForCausalLM")]
    sizes = []
    for size in range(2, min(max([h for h in heads if isinstance(h, int)], default=1), tokens) + 1):
        try:
            causal_lms(model, size)
        except ValueError:
            continue
        sizes.append(size)
    return tuple(sizes)


def _tensor_size(param: Tensor, gathered_dtype: torch.dtype | None, nf4: bool) -> TensorSize:
    rows = param.shape[0] if param.dim() > 0 else 1
    stored = NF4_BYTES_PER_ELEMENT if nf4 else param.element_size()
    gathered = stored
    if gathered_dtype is not None and param.is_floating_point() and not nf4:
        gathered = gathered_dtype.itemsize
    return TensorSize(rows, param.numel(), stored, gathered, param.requires_grad)


def saved_activations(
    model: nn.Module, batch_shape: BatchShape, checkpointed: Sequence[str] = ()
) -> tuple[int | None, str]:
    """The bytes one training step's activations take on one rank, and how they were found.

    One forward of the Hugging Face model inside ``model`` on ``meta`` (token ids of ``batch_shape``, labels the
    same; with the KV cache a training forward makes by default, which holds the keys and values attention saves
    anyway, and which spares transformers' data-dependent checks of packed sequences, impossible on ``meta``): every
    tensor autograd saves for backward passes through a ``saved_tensors_hooks`` pack hook, which adds up the bytes of
    each distinct storage that is not a parameter and is still alive when the forward ends. A checkpointed module
    keeps only its inputs; the one recomputed in backward adds its own saved bytes once. The loss's backward adds two float32
    tensors of the logits' size (the gradient of the log-softmax and its result), where a step's activations peak.
    Models without a Hugging Face causal-LM forward, or whose forward cannot run on ``meta``: ``None`` (a
    margin is held back instead)."""
    target = _causal_lm(model)
    if target is None:
        return None, (f"{ACTIVATION_MARGIN:.0%} of the budget held back (no Hugging Face causal-LM forward found in"
                      f" {type(model).__name__} to estimate them from)")
    params = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers()]}
    seen: dict[Any, int] = {}
    total = [0]

    def pack(tensor: Tensor) -> Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in params and ref not in seen:
            seen[ref] = tensor.untyped_storage().nbytes()
            total[0] += seen[ref]
        return tensor

    starts: dict[str, int] = {}
    inside: dict[str, int] = {}
    inputs: dict[str, int] = {}
    handles = []
    for name in checkpointed:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(_mark_start(name, total, starts, inputs), with_kwargs=True))
        handles.append(module.register_forward_hook(_mark_end(name, total, starts, inside), with_kwargs=True))
    modes = {m: m.training for m in model.modules()}
    sequences, tokens = batch_shape
    ids = torch.zeros(sequences, tokens, dtype=torch.long, device="meta")
    try:
        model.train()
        with torch.enable_grad(), _FusedAttention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = target(input_ids=ids, labels=ids, use_cache=True)
        logits = getattr(output, "logits", None)
        # The loss's backward holds two float32 tensors of the logits' size at once (the gradient of the log-softmax
        # and its output), at the step's peak, on top of what forward saved.
        out_bytes = 2 * 4 * logits.numel() if isinstance(logits, Tensor) else 0
    except Exception as err:  # noqa: BLE001 - any model code may fail on meta; the margin then stands in
        return None, (f"{ACTIVATION_MARGIN:.0%} of the budget held back ({type(target).__name__}'s forward did not"
                      f" run on meta: {type(err).__name__}: {str(err)[:200]})")
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training
    # What is still saved at the end of the forward: a graph branch whose output was dropped frees its tensors.
    dropped = sum(n for ref, n in seen.items() if ref.expired())
    saved = total[0] - dropped - sum(inside.values()) + sum(inputs.values()) + max(inside.values(), default=0)
    how = f"estimated for micro-batches of {sequences} x {tokens} tokens (one forward on meta)"
    return saved + out_bytes, how + (f", {len(checkpointed)} checkpointed modules" if checkpointed else "")


class _FusedAttentionSaves(torch.autograd.Function):
    """What a fused attention kernel (flash or memory-efficient, CUDA's and the CPU's alike) saves for backward: its
    inputs, its output and one float log-sum-exp per query and head; never the ``heads x tokens x tokens``
    probabilities torch's math kernel (the only one on ``meta``) would keep."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:  # type: ignore[override]
        # Laid out as the kernels lay theirs out, (batch, tokens, heads, dim) seen as (batch, heads, tokens, dim): the
        # usual `out.transpose(1, 2).contiguous()` that follows then copies nothing, as in a real run.
        *batch, heads, tokens, _ = query.shape
        out = query.new_empty((*batch, tokens, heads, value.shape[-1])).transpose(-3, -2)
        ctx.save_for_backward(query, key, value, out, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # type: ignore[override]
        raise RuntimeError("The activation estimate's stand-in attention has no backward.")


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """Inside the estimate's forward on ``meta``: ``scaled_dot_product_attention`` saves what the fused kernels a
    real run dispatches to save (:class:`_FusedAttentionSaves`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.nn.functional.scaled_dot_product_attention:
            query, key, value = args[:3]
            return _FusedAttentionSaves.apply(query, key, value)
        return func(*args, **(kwargs or {}))


def _mark_start(name: str, total: list[int], starts: dict[str, int], inputs: dict[str, int]) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs[name] = sum(t.numel() * t.element_size() for t in [*args, *kwargs.values()]
                           if isinstance(t, Tensor) and t.is_floating_point())
        starts[name] = total[0]

    return hook


def _mark_end(name: str, total: list[int], starts: dict[str, int], inside: dict[str, int]) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        inside[name] = total[0] - starts[name]

    return hook


def _causal_lm(model: nn.Module) -> nn.Module | None:
    """The outermost module that takes ``input_ids`` and ``labels`` as a Hugging Face causal LM does (a
    ``PreTrainedModel`` with a vocabulary, or peft's model around one)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "vocab_size", None) is not None and hasattr(module, "forward") and (
            type(module).__name__.endswith("ForCausalLM") or type(module).__name__.startswith("PeftModel")
        ):
            return module
    return None


# ------------------------------------------------------------------------------------------------ 2. one candidate
def estimate(
    model: ModelSize,
    replicate: int,
    shard: int,
    reshard_after_forward: bool,
    *,
    optimizer_states: int = ADAM_STATES,
    budget: int | None = None,
    device_type: str = "cuda",
    frozen_plain: bool = False,
    context: int = 1,
) -> Estimate:
    """Per-rank bytes of ``model`` sharded over ``shard`` ranks and replicated ``replicate`` times, each sequence
    split over ``context`` ranks inside the shard group (context parallelism: the parameters sharded over
    ``shard x context`` ranks, which share each micro-batch, each holding ``1/context`` of its activations) (``frozen_plain``:
    whole replicas whose frozen parameters FSDP2 does not manage and whose roots alone are groups, so that only the
    trained ones are gathered, all together):

    * parameters: each rank's rows of every parameter (``ceil(rows / shard)``), at rest in the storage dtype;
    * gradients and optimizer state: the same for the trainable ones (gradients in the storage dtype, the optimizer's
      ``optimizer_states`` per element too);
    * gathered: the roots' parameters (gathered from forward to the end of backward), plus two blocks (the one
      running and the one prefetched) or, with ``reshard_after_forward=False``, every block; plus one group's
      unsharded gradients before their reduce-scatter. A shard group of one rank gathers too (FSDP2 copies the
      shard into the gathered buffer), so it is counted alike;
    * activations: ``model.activations``, or :data:`ACTIVATION_MARGIN` of ``budget`` when unknown (0 without one);
    * allocator: :data:`ALLOCATOR_SHARE` of ``device_type`` times what is allocated and freed every step (all but the
      parameters at rest, the optimizer's state and a margin held back); on CPU, with blocks freed after forward, at least every block's
      gathered bytes: FSDP2 gathers into one buffer per parameter, glibc keeps those it frees after each block's
      forward in its heap, and the activations allocated in between keep it from reusing them whole, so the heap grows
      by about a block per block (measured on a 48-layer model: 2.0 GB per rank with glibc giving freed memory back,
      4.3 GB without)."""
    # Nothing to leave plain without frozen parameters (full fine-tuning): the blocks stay groups.
    frozen_plain = frozen_plain and any(not t.trainable for g in model.groups for t in g.tensors)
    group = shard * context  # FSDP2's shard group: the context ranks compute different gradients too
    params = sum(int(t.sharded_numel(group) * t.stored) for g in model.groups for t in g.tensors)
    grads = sum(int(t.sharded_numel(group) * t.stored) for g in model.groups for t in g.tensors if t.trainable)
    blocks = [g.gathered_bytes(frozen_plain) for g in model.groups if not g.root]
    roots = sum(g.gathered_bytes(frozen_plain) for g in model.groups if g.root)
    if frozen_plain:  # the roots alone are groups: every trained parameter gathered together
        blocks, roots = [], roots + sum(blocks)
    held = sum(sorted(blocks, reverse=True)[:2]) if reshard_after_forward else sum(blocks)
    unsharded_grads = max((g.gradient_bytes() for g in model.groups), default=0)
    activations = model.activations
    if activations is not None:
        # Each rank of a context group keeps 1/context of every sequence's tokens through the layers, its logits and
        # its loss; the whole sequence's embeddings and mask (one layer input's worth) are left out of the estimate.
        activations = -(-activations // context)
    else:
        activations = int(ACTIVATION_MARGIN * budget) if budget is not None else 0
    known = activations if model.activations is not None else 0
    moving = grads + roots + held + unsharded_grads + known  # the optimizer's state is made once and kept
    allocator = int(ALLOCATOR_SHARE.get(device_type, ALLOCATOR_SHARE["cuda"]) * moving)
    if device_type == "cpu" and reshard_after_forward:
        allocator = max(allocator, sum(blocks))
    return Estimate(replicate, shard, reshard_after_forward, params, grads, optimizer_states * grads,
                    roots + held + unsharded_grads, activations, allocator, frozen_plain, context)


# ------------------------------------------------------------------------------------------------ 3. the choice
def candidates(world_size: int, devices_per_node: int, contexts: Iterable[int] = ()
               ) -> list[tuple[int, int, bool, int]]:
    """The layouts ``"auto"`` considers, fastest first, as ``(replicate, shard, reshard_after_forward, context)``: a
    shard group of one (every rank a whole replica, no all-gathers: DDP's traffic), then HSDP's shard groups from the
    smallest (inside a node first, then whole nodes), each keeping its gathered parameters from forward to backward
    (one all-gather per step) before freeing them (two), then full sharding over every rank; last, where a sequence
    does not fit otherwise, full sharding with each sequence split over ``context`` ranks (``contexts``: the sizes the
    model takes; the smallest first: fewer all-to-alls' partners, more data parallelism), groups inside a node. Shard
    groups that straddle nodes unevenly are left out (:meth:`Layout.resolve` refuses them)."""
    sizes = [s for s in range(1, world_size + 1) if world_size % s == 0
             and (s == world_size or devices_per_node % s == 0 or s % devices_per_node == 0)]
    out = []
    for shard in sizes:
        for reshard in ((True,) if shard == 1 else (False, True)):
            out.append((world_size // shard, shard, reshard, 1))
    for context in sorted(contexts):
        if context > 1 and world_size % context == 0 and devices_per_node % context == 0:
            out.append((1, world_size // context, True, context))
    return out


def estimate_all(
    model: ModelSize,
    world_size: int,
    devices_per_node: int,
    *,
    budget: int | None = None,
    optimizer_states: int = ADAM_STATES,
    device_type: str = "cuda",
    frozen_plain: bool = False,
) -> tuple[Estimate, ...]:
    """:func:`estimate` of every one of :func:`candidates`, in their order (``frozen_plain`` for whole replicas)."""
    return tuple(estimate(model, r, s, k, optimizer_states=optimizer_states, budget=budget, device_type=device_type,
                          frozen_plain=frozen_plain and s == 1 and c == 1, context=c)
                 for r, s, k, c in candidates(world_size, devices_per_node, model.context_sizes))


def choose(
    model: ModelSize,
    world_size: int,
    devices_per_node: int,
    budget: int,
    *,
    optimizer_states: int = ADAM_STATES,
    device_type: str = "cuda",
    frozen_plain: bool = False,
    budget_given: bool = True,
) -> LayoutChoice:
    """The first of :func:`candidates` whose :func:`estimate` fits ``budget`` (bytes per rank, :meth:`Estimate.fits`);
    a ``ValueError`` saying what to change when none does. ``frozen_plain``: whole replicas may leave the frozen
    parameters to plain tensors (see :func:`choose_layout`). Pure: every rank, given the same budget, chooses the
    same."""
    estimates = estimate_all(model, world_size, devices_per_node, budget=budget, optimizer_states=optimizer_states,
                             device_type=device_type, frozen_plain=frozen_plain)
    chosen = next((e for e in estimates if e.fits(budget)), None)
    note = model.activations_note
    if chosen is None:
        smallest = min(estimates, key=lambda e: e.total)
        parts = {"parameters": smallest.parameters, "gradients": smallest.gradients,
                 "optimizer state": smallest.optimizer, "gathered parameters": smallest.gathered,
                 "activations": smallest.activations, "the allocator's share": smallest.allocator}
        breakdown = ", ".join(f"{what} {_size(n)}" for what, n in sorted(parts.items(), key=lambda kv: -kv[1]) if n)
        raise ValueError(
            f"FSDP2Strategy(device_mesh='auto'): no layout fits {_budget_words(budget, budget_given)}. The smallest,"
            f" {smallest.describe()}, needs about {_size(smallest.total)}: {breakdown} (Adam's two moments assumed;"
            f" activations: {note}). To fit: " + "; ".join(_what_would_fit(smallest, model)) + ".\n"
            + LayoutChoice(estimates, budget, None, note).table()
        )
    return LayoutChoice(estimates, budget, chosen, note, budget_given)


@dataclass(frozen=True)
class AutoLayout:
    """``device_mesh="auto"`` before the model exists: the processes, the budget every rank agreed on (the
    smallest), and the micro-batch shape the activations are estimated for."""

    world_size: int
    devices_per_node: int
    budget: int
    batch_shape: BatchShape | None = None
    device_type: str = "cuda"
    budget_given: bool = True  # memory_budget; else the device's free memory when the run started


def choose_layout(
    module: nn.Module,
    request: AutoLayout,
    *,
    auto_wrap_policy: ModulePolicy | None,
    gathered_dtype: torch.dtype | None,
    checkpointing: tuple[ModulePolicy, int] | None,
    nf4: Iterable[str] = (),
    module_is_root: bool = False,
    frozen_plain: bool = False,
) -> LayoutChoice:
    """``parallel.parallelize``'s step for ``device_mesh="auto"``: measure ``module`` (on ``meta``, converted to its
    storage dtype) as ``fully_shard`` will group it (``auto_wrap_policy``'s blocks, then the roots), and choose.
    ``checkpointing``: the activation-checkpointing policy and its ``every``, if any. ``frozen_plain``: in whole
    replicas, the frozen parameters may be left out of ``fully_shard`` (plain tensors, each rank a copy, as DDP holds
    them): FSDP2 would otherwise copy them into gathered buffers and back every step, for nothing (the caller allows
    it where nothing needs FSDP2 to manage them: no mixed-precision cast, no NF4)."""
    size = _measure(module, auto_wrap_policy, module_is_root, gathered_dtype, checkpointing, nf4, request.batch_shape)
    return choose(size, request.world_size, request.devices_per_node, request.budget,
                  device_type=request.device_type, frozen_plain=frozen_plain, budget_given=request.budget_given)


def estimate_layouts(
    model: nn.Module,
    world_size: int,
    *,
    devices_per_node: int | None = None,
    precision: str = "32-true",
    memory_budget: int | str | None = None,
    batch_shape: BatchShape | None = None,
    optimizer_states: int = ADAM_STATES,
    auto_wrap_policy: ModulePolicy | None = None,
    activation_checkpointing_policy: ModulePolicy | None = None,
    device_type: str = "cuda",
) -> LayoutChoice:
    """What ``FSDP2Strategy(device_mesh="auto")`` would estimate and choose for ``model`` on ``world_size``
    processes (``devices_per_node`` of them per node, default all), without starting any: every candidate's per-rank
    bytes by component and, given ``memory_budget`` (bytes, or ``"20GiB"``), the layout chosen (a ``ValueError`` if
    none fits). ``model`` is built on ``meta`` (``with torch.device("meta"): ...``) and left as it is (a copy is
    measured). ``precision``: the ``Trainer``'s (``"bf16-true"`` stores bf16, ``"bf16-mixed"`` gathers in bf16).
    ``optimizer_states``: state per trainable element (Adam: 2, the strategy's assumption; SGD with momentum: 1).
    ``batch_shape``: ``(sequences, tokens)`` per rank, to estimate the activations. ``device_type``: ``"cuda"`` or
    ``"cpu"`` (what the allocator holds beyond the tensors differs: :data:`ALLOCATOR_SHARE`)."""
    _check_estimate_inputs(world_size, devices_per_node, optimizer_states, device_type)
    check_batch_shape(batch_shape, "estimate_layouts")
    real = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
    if real:
        raise ValueError(
            f"estimate_layouts measures a model built on meta, and {type(model).__name__} holds real tensors"
            f" ({real[:3]}...). Build it under `with torch.device('meta'):` (no memory is used)."
        )
    plugin = PrecisionCore(precision)  # type: ignore[arg-type]
    model = plugin.convert_module(copy.deepcopy(model))
    budget = check_memory_budget(memory_budget)
    gathered_dtype = plugin.mixed_precision_policy.param_dtype
    checkpointing = (activation_checkpointing_policy, 1) if activation_checkpointing_policy is not None else None
    size = _measure(model, auto_wrap_policy, False, gathered_dtype, checkpointing, (), batch_shape)
    devices = devices_per_node or world_size
    options = dict(optimizer_states=optimizer_states, device_type=device_type, frozen_plain=gathered_dtype is None)
    if budget is not None:
        return choose(size, world_size, devices, budget, **options)  # type: ignore[arg-type]
    estimates = estimate_all(size, world_size, devices, **options)  # type: ignore[arg-type]
    return LayoutChoice(estimates, None, None, size.activations_note if size.activations is not None
                        else "not estimated (no batch_shape), not included")


def _measure(
    module: nn.Module,
    auto_wrap_policy: ModulePolicy | None,
    module_is_root: bool,
    gathered_dtype: torch.dtype | None,
    checkpointing: tuple[ModulePolicy, int] | None,
    nf4: Iterable[str],
    batch_shape: BatchShape | None,
) -> ModelSize:
    """:func:`measure_model` with the groups ``fully_shard`` will make (``wrap.py``'s blocks, then the roots) and the
    modules activation checkpointing will take."""
    roots = [""] if module_is_root else root_names(module)
    checkpointed = checkpointed_names(module, *checkpointing) if checkpointing is not None else []
    return measure_model(module, block_names(module, auto_wrap_policy), roots, gathered_dtype=gathered_dtype, nf4=nf4,
                         batch_shape=batch_shape, checkpointed=checkpointed)


def agreed_budget(option: int | None, device: torch.device, local_processes: int) -> int:
    """The budget every rank uses: ``option`` (``memory_budget``), or :func:`available_memory`; the smallest over the
    ranks, so that all make the same choice. A collective: every rank calls it."""
    budget = option if option is not None else available_memory(device, local_processes)
    if not torch.distributed.is_initialized():
        return budget
    staged = torch.tensor([budget], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    torch.distributed.all_reduce(staged, op=torch.distributed.ReduceOp.MIN)
    return int(staged.item())


# ------------------------------------------------------------------------------------------------ the budget
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def check_batch_shape(batch_shape: Any, caller: str) -> None:
    """Refuse a ``batch_shape`` that is not two positive ints: ``TypeError`` for another type, ``ValueError`` for a bad
    value."""
    if batch_shape is None or (
        isinstance(batch_shape, (tuple, list)) and len(batch_shape) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in batch_shape)
    ):
        return
    of_ints = isinstance(batch_shape, (tuple, list)) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in batch_shape)
    raise (ValueError if of_ints else TypeError)(
        f"{caller}(batch_shape={batch_shape!r}): (sequences, tokens) of one rank's micro-batch, two positive ints,"
        " which device_mesh='auto' estimates the activations for."
    )


def _check_estimate_inputs(world_size: Any, devices_per_node: Any, optimizer_states: Any, device_type: Any) -> None:
    """``estimate_layouts``' own arguments, refused as the strategy refuses its options (before anything is built)."""
    def positive(n: Any) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n > 0

    states_ok = isinstance(optimizer_states, int) and not isinstance(optimizer_states, bool) and optimizer_states >= 0
    for name, value, ok, what in (
        ("world_size", world_size, positive(world_size), "a positive int"),
        ("devices_per_node", devices_per_node, devices_per_node is None or positive(devices_per_node),
         "a positive int, or None for one node"),
        ("optimizer_states", optimizer_states, states_ok, "an int >= 0 (state per trainable element: Adam 2)"),
    ):
        if not ok:
            kind = ValueError if isinstance(value, int) and not isinstance(value, bool) else TypeError
            raise kind(f"estimate_layouts({name}={value!r}): {what}.")
    if devices_per_node is not None and world_size % devices_per_node and devices_per_node % world_size:
        raise ValueError(
            f"estimate_layouts(world_size={world_size}, devices_per_node={devices_per_node}): the processes are whole"
            " nodes: devices_per_node divides world_size (or, for one node, is world_size)."
        )
    if device_type not in ("cuda", "cpu"):
        raise (ValueError if isinstance(device_type, str) else TypeError)(
            f"estimate_layouts(device_type={device_type!r}): 'cuda' or 'cpu' (what the allocator holds beyond the"
            " tensors differs between them)."
        )


def check_memory_budget(value: Any) -> int | None:
    """``memory_budget`` as bytes (an int, or a string such as ``"20GiB"``/``"80GB"``); a ``TypeError`` for another
    type, a ``ValueError`` for a bad value (as every option)."""
    if value is None:
        return None
    what = (f"FSDP2Strategy(memory_budget={value!r}): the bytes each rank may use, as a positive int or a string such"
            " as '20GiB' or '80GB' (a number, then B, KB, MB, GB, TB or KiB, MiB, GiB, TiB, any case; None: the"
            " device's free memory).")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(what)
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(what)
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", value, re.I)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(what)
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def available_memory(device: torch.device, local_processes: int) -> int:
    """Bytes this rank may use: the CUDA device's free memory, or on the CPU the memory the system reports
    available (``MemAvailable``) divided among the node's processes."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError) as err:
        raise RuntimeError(
            "FSDP2Strategy(device_mesh='auto') could not read the available memory of this machine"
            f" (/proc/meminfo: {err}). Give it: FSDP2Strategy(device_mesh='auto', memory_budget='20GiB')."
        ) from err
    return available // max(local_processes, 1)


def _what_would_fit(estimate: Estimate, model: ModelSize) -> list[str]:
    """What would make ``estimate`` smaller, for its largest components first, leaving out what is done already
    (16-bit weights, NF4, LoRA, activation checkpointing); then more processes, and a budget that is wrong."""
    tensors = [t for g in model.groups for t in g.tensors]
    wide = sum(t.numel for t in tensors if t.stored >= 4) > 0.5 * max(model.parameters, 1)  # mostly 32-bit (not
    # the fp32 adapters "bf16-true" keeps on a 16-bit base)
    quantized = any(t.stored < 1 for t in tensors)  # NF4 already (it leaves embeddings, norms and the head whole)
    frozen_wide = not quantized and any(not t.trainable and t.stored >= 2 for t in tensors)
    many_trained = model.trainable > 0.1 * max(model.parameters, 1)
    bits = "store the weights in 16 bits (precision='bf16-true')"
    remedies = {
        "parameters": [(bits, wide), ("quantize the frozen base (load_pretrained(..., quantize='nf4'))", frozen_wide)],
        "gradients": [("train fewer parameters (LoRA)", many_trained), (bits, wide)],
        "optimizer": [("train fewer parameters (LoRA)", many_trained)],
        "gathered": [(bits, wide)],
        # Without batch_shape the activations are a fixed share of the budget: only an estimate can change them.
        "activations": [("give batch_shape= for an estimate of the activations instead of that share",
                         model.activations is None),
                        ("recompute activations (activation_checkpointing_policy)",
                         model.activations is not None and not model.checkpointed),
                        ("use smaller micro-batches", model.activations is not None)],
    }
    sizes = {"parameters": estimate.parameters, "gradients": estimate.gradients, "optimizer": estimate.optimizer,
             "gathered": estimate.gathered, "activations": estimate.activations}
    advice: list[str] = []
    for component in sorted(sizes, key=lambda c: -sizes[c]):
        advice += [what for what, useful in remedies[component] if useful and sizes[component] and what not in advice]
    return advice + ["run more processes", "or give memory_budget= if the budget itself is wrong"]


def _budget_words(budget: int | None, given: bool = True) -> str:
    """Which figure is the budget, where it came from, and how much of it an estimate may use."""
    if budget is None:
        return "no budget"
    source = "memory_budget" if given else "the device's free memory when the run started, the smallest over the ranks"
    return (f"the budget of {_size(budget)} per rank ({source}), of which an estimate may use {FITS_IN:.0%}:"
            f" {_size(int(FITS_IN * budget))}")


_UNITS_DOWN = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _size(n: int | None) -> str:
    """Bytes in the unit that suits them, three significant digits: ``"512 B"``, ``"12.3 KiB"``, ``"1.5 GiB"`` (a
    figure that rounds up to 1024 of a unit is written in the next one)."""
    if n is None:
        return "-"

    def digits(value: float) -> str:
        return f"{value:.3g}" if value < 100 else f"{value:.0f}"

    for i, (unit, scale) in enumerate(_UNITS_DOWN):
        if abs(n) >= scale or unit == "B":
            text = digits(n / scale)
            if i and float(text) >= 1024:
                unit, text = _UNITS_DOWN[i - 1][0], digits(n / _UNITS_DOWN[i - 1][1])
            return f"{text} {unit}"
    raise AssertionError("unreachable")
