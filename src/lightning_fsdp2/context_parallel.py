"""Context parallelism: each sequence's tokens split over a group of ranks, attention seeing whole sequences
(``FSDP2Strategy(context_parallel_size=N)``).

FSDP and tensor parallelism shard weights; a long sequence's activations (every layer's inputs, its attention and MLP
intermediates) still grow with its length on every rank. Here the ranks of a context group read the same batch, and
each keeps ``1/N`` of every sequence's tokens through the decoder layers: rank ``c`` holds tokens ``[c * L/N, (c+1) *
L/N)`` (the sequence padded inside to a multiple of ``N``). Attention is the one place where tokens meet: an
all-to-all turns the ``(tokens/N, all heads)`` queries, keys and values into ``(all tokens, heads/N)`` ones, the
model's own attention function runs on them with the model's own mask, and a second all-to-all brings the output
back (DeepSpeed-Ulysses' scheme). So causal masks, padding masks, sliding windows and the block-diagonal mask of
packed documents act exactly as in one process, and each rank does the same attention work (no causal imbalance,
which ring attention has to balance by reordering the sequence).

What is split where (the user's ``training_step`` is unchanged: it calls the model on whole batches):

* the causal LM's forward (a pre-hook): the labels are shifted on the whole sequence (transformers' loss takes
  ``shift_labels``) and this rank's slice kept, and the loss is weighted by the whole batch's token count;
* embeddings, rotary position embeddings and the attention mask are computed on the whole sequence, as one process
  computes them (the mask is what attention needs, and what packed documents bring);
* each decoder layer (a pre-hook) takes this rank's slice of its input and of the position embeddings;
* attention (an implementation registered with transformers' ``AttentionInterface``, wrapping the model's own
  ``sdpa`` or ``eager``) exchanges heads for tokens around the model's own function;
* the final norm, the LM head and the loss run on this rank's tokens: the logits are never whole on one rank.

The loss: one process's is ``sum(token losses) / T`` over the batch's ``T`` counted tokens. Rank ``c``'s loss is
``N * sum(its token losses) / T`` (transformers' own loss with ``num_items_in_batch = T / N``), whose gradient,
summed over the group and divided by the ``N`` ranks FSDP2 reduces over (the context ranks are in its shard group),
is one process's. The value returned is the group's mean, one process's loss, on every rank (gradient unchanged).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp2.init import outermost
from lightning_fsdp2.layout import Layout

MARKER = "lightning_fsdp2_context"
"""The keyword argument this forward's split travels by: transformers passes a causal LM's extra keyword arguments
down to each decoder layer and its attention function (and ignores them in the loss), so the split needs no state
outside the call, and a checkpointed layer's recomputation sees the same one."""

ATTENTION = ("sdpa", "eager")
"""The models' attention implementations context parallelism wraps (tested against one process)."""

_PREFIX = "lightning_fsdp2_context_"  # + the wrapped implementation: the name registered with transformers


def apply_context_parallel(module: nn.Module, layout: Layout, mesh: DeviceMesh) -> None:
    """``parallel.parallelize``'s step for the layout's ``"context"`` dimension: every Hugging Face causal LM in
    ``module`` splits the sequences of its forwards over the context group. Every rank built the same model, so every
    check raises on every rank alike, before anything is allocated. Nothing without a context dimension."""
    context = layout.context_mesh(mesh)
    if context is None:
        return
    models = causal_lms(module, layout.context_size, layout.tensor_size)
    group = context.get_group()
    for model in models:
        _install(model, _Group(group, context.size(), context.get_local_rank()))


def causal_lms(module: nn.Module, size: int, tensor: int = 1) -> list[nn.Module]:
    """The outermost Hugging Face causal LMs in ``module``, each checked to run split over ``size`` context ranks
    (after tensor parallelism's split of the heads over ``tensor`` ranks); a ``ValueError`` naming what cannot."""
    from transformers import PreTrainedModel  # a dependency, imported with the option's step
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    models = [m for _, m in outermost(module, PreTrainedModel)]
    found = [m for m in models if type(m).__name__ in causal and not m.config.is_encoder_decoder]
    if not found:
        names = ", ".join(type(m).__name__ for m in models) or type(module).__name__
        raise ValueError(
            f"FSDP2Strategy(context_parallel_size={size}): {names} is no Hugging Face causal LM (a decoder-only"
            " `...ForCausalLM`), whose sequences context parallelism splits. Train this model without"
            " context_parallel_size."
        )
    for model in found:
        _check_model(model, size, tensor)
    return found


def _check_model(model: nn.Module, size: int, tensor: int) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    name, config = type(model).__name__, model.config
    shown = f"FSDP2Strategy(context_parallel_size={size})"
    implementation = config._attn_implementation
    if implementation not in ATTENTION and not implementation.startswith(_PREFIX):
        raise ValueError(
            f"{shown}: {name} computes attention with {implementation!r}; context parallelism runs the model's"
            f" {' and '.join(repr(a) for a in ATTENTION)} attention (tested against one process). Load it with"
            " attn_implementation='sdpa'."
        )
    if any(hasattr(config, a) for a in ("num_experts", "num_local_experts")):
        raise ValueError(
            f"{shown}: {name} is a mixture-of-experts model; context parallelism runs dense causal LMs (its"
            " load-balancing loss would count each rank's tokens alone). Train it without context_parallel_size"
            " (expert_parallel_size splits its experts instead)."
        )
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads % tensor or (heads // tensor) % size:
        local = f"{heads // tensor} per tensor rank" if isinstance(heads, int) and tensor > 1 else f"{heads}"
        raise ValueError(
            f"{shown}: {name} has {local} attention heads, and attention's all-to-all gives each of the {size}"
            f" context ranks an equal share of them. Choose a context_parallel_size that divides {local}."
        )
    if model.loss_function is not ForCausalLMLoss:
        raise ValueError(
            f"{shown}: the loss of {name} is not transformers' causal LM loss (`ForCausalLMLoss`), which context"
            " parallelism weights per rank. Train this model without context_parallel_size."
        )
    if not _layers(model):
        raise ValueError(
            f"{shown}: {name} names no decoder layer class in `_no_split_modules`, whose inputs context parallelism"
            " splits. Train this model without context_parallel_size."
        )


def _layers(model: nn.Module) -> list[nn.Module]:
    classes = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if any(c.__name__ in classes for c in type(m).__mro__)]  # FSDP2's subclass too


@dataclass(frozen=True)
class _Group:
    group: Any
    size: int
    rank: int


class _Split:
    """One forward's split of its sequences over a context group (travels as the keyword argument :data:`MARKER`).

    A plain class, not a dataclass: FSDP2's mixed-precision cast of a layer's inputs rebuilds dataclasses it finds in
    them (``dataclasses.replace``), and each layer would count on a copy."""

    __slots__ = ("ranks", "length", "loss", "layers", "attentions")

    def __init__(self, ranks: _Group, length: int) -> None:
        self.ranks = ranks
        self.length = length
        """The whole sequence's tokens (as given)."""
        self.loss = False
        """The model computes its loss (labels were given): it stays on this rank's tokens and is weighted."""
        self.layers = 0
        """Decoder layers that took this rank's slice in this forward ..."""
        self.attentions = 0
        """... and attention calls that exchanged heads for tokens (one per layer, or a layer mixes tokens
        elsewhere)."""

    @property
    def chunk(self) -> int:
        """Tokens per rank (the sequence padded to a multiple of the group inside)."""
        return -(-self.length // self.ranks.size)

    @property
    def padded(self) -> int:
        return self.chunk * self.ranks.size

    def take(self, tensor: torch.Tensor, dim: int, fill: float = 0, copy: bool = True) -> torch.Tensor:
        """This rank's slice of ``tensor``'s whole sequence along ``dim``, padded with ``fill`` past its end."""
        dim = dim % tensor.dim()
        start = min(self.ranks.rank * self.chunk, self.length)
        piece = tensor.narrow(dim, start, min(self.chunk, self.length - start))
        missing = self.chunk - piece.shape[dim]
        if missing:
            shape = list(piece.shape)
            shape[dim] = missing
            return torch.cat([piece, piece.new_full(shape, fill)], dim)
        # A copy of a layer's input frees the whole sequence's (a view would keep it alive, saved for backward).
        return piece.clone() if copy else piece

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, heads, tokens/N, dim)`` -> ``(batch, heads/N, tokens, dim)``: this rank's share of the heads
        over the whole (padded) sequence."""
        n = self.ranks.size
        b, h, t, d = x.shape
        x = x.reshape(b, n, h // n, t, d).permute(1, 0, 2, 3, 4).contiguous()  # heads group i goes to rank i
        x = _all_to_all(x, self.ranks.group)  # ... and slice i of the tokens comes from rank i
        return x.reshape(n, b, h // n, t, d).permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Attention's output ``(batch, tokens, heads/N, dim)`` -> ``(batch, tokens/N, heads, dim)``."""
        n = self.ranks.size
        b, t, h, d = x.shape
        x = x.reshape(b, n, t // n, h, d).permute(1, 0, 2, 3, 4).contiguous()  # token slice i goes to rank i
        x = _all_to_all(x, self.ranks.group)  # ... and heads group i comes from rank i
        return x.reshape(n, b, t // n, h, d).permute(1, 2, 0, 3, 4).reshape(b, t // n, n * h, d)

    def whole_mask(self, mask: torch.Tensor | None, causal: bool, device: torch.device) -> torch.Tensor | None:
        """The model's attention mask for the padded sequence: the padding tokens (past the end) attend to
        themselves and are attended by nothing. Without a mask (sdpa's ``is_causal``, or attention over everything)
        and with padding, an explicit one: ``causal``, or every real token. Made per call (FSDP2's mixed precision
        hands each layer its own cast copy of the model's mask; sdpa keeps the one it gets for backward)."""
        if self.padded == self.length:
            return mask
        if mask is None:
            whole = torch.ones(self.length, self.length, dtype=torch.bool, device=device)
            mask = (whole.tril() if causal else whole)[None, None]
        if mask.dim() != 4 or mask.shape[-1] != self.length or mask.shape[-2] != self.length:
            raise RuntimeError(
                f"FSDP2Strategy(context_parallel_size={self.ranks.size}): the attention mask has shape"
                f" {tuple(mask.shape)}; context parallelism pads a sequence of {self.length} tokens to"
                f" {self.padded} and expects a (batch, heads, {self.length}, {self.length}) mask. Pass sequences"
                f" whose length divides by {self.ranks.size}."
            )
        extra = torch.arange(self.length, self.padded, device=mask.device)
        shape = (*mask.shape[:-2], self.padded, self.padded)
        if mask.dtype == torch.bool:
            padded = mask.new_zeros(shape)
            padded[..., extra, extra] = True
        else:
            padded = mask.new_full(shape, torch.finfo(mask.dtype).min)
            padded[..., extra, extra] = 0
        padded[..., : self.length, : self.length] = mask
        return padded


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x, None, None, group))


# ------------------------------------------------------------------------------------------------ the hooks
def _install(model: nn.Module, ranks: _Group) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    inner = model.config._attn_implementation.removeprefix(_PREFIX)
    name = _PREFIX + inner
    AttentionInterface.register(name, _attention(inner))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])  # the mask the model builds anyway
    model.config._attn_implementation = name
    signature = inspect.signature(model.forward)
    model.register_forward_pre_hook(_split_inputs(signature, ranks, type(model).__name__), with_kwargs=True)
    model.register_forward_hook(_join_outputs(type(model).__name__), with_kwargs=True)
    for layer in _layers(model):
        layer.register_forward_pre_hook(_split_layer_input, with_kwargs=True)


def _split_inputs(signature: inspect.Signature, ranks: _Group, name: str) -> Callable[..., Any]:
    """``name``: the model's class, as the user knows it (FSDP2 subclasses it once sharded)."""
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        bound = signature.bind_partial(*args, **kwargs).arguments
        given = {**{k: v for k, v in bound.items() if k != var_keyword}, **bound.get(var_keyword, {})}
        if MARKER in given:
            return None
        if given.get("cache", given.get("past_key_values")) is not None or given.get("use_cache") is True:
            # Decoding with a cache (generate(), or a loop of the caller's own that asks for one): each rank of the
            # group computes the whole sequence, as one process does; they hold the same batch, so they stay alike.
            return None
        tokens = given.get("input_ids")
        if tokens is None:
            tokens = given.get("inputs_embeds")
        if tokens is None:
            return None
        shown = f"FSDP2Strategy(context_parallel_size={ranks.size})"
        asked = [n for n in ("output_attentions", "output_hidden_states") if given.get(n)]
        keep = given.get("logits_to_keep")
        if asked or not (keep is None or (isinstance(keep, int) and keep == 0)):
            raise ValueError(
                f"{shown}: {name} was called with {asked or ['logits_to_keep']}; under context"
                " parallelism each rank holds a slice of every sequence's hidden states, so these are not returned."
                " Call it without them."
            )
        if given.get("return_dict") is False:
            raise ValueError(
                f"{shown}: {name} was called with return_dict=False; context parallelism sets the"
                " output's `loss` and `logits` by name. Call it with return_dict=True (the default)."
            )
        _check_same_batch(given, tokens, ranks, name)
        split = _Split(ranks, tokens.shape[1])
        labels, shifted = given.get("labels"), given.get("shift_labels")
        if labels is not None:  # transformers computes the loss when given labels (then shift_labels if given)
            ignore = given.get("ignore_index", -100)
            if shifted is None:  # shifted on the whole sequence: the last token of a slice predicts the next slice's
                shifted = nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
            counted = given.get("num_items_in_batch")
            if counted is None:
                counted = (shifted != ignore).sum()
            mine = split.take(shifted, dim=-1, fill=ignore)
            given.update(labels=mine, shift_labels=mine, num_items_in_batch=counted / ranks.size)
            split.loss = True
        given.update(use_cache=False)  # a cache of this rank's keys would be no model's cache
        given[MARKER] = split
        return (), given

    return hook


def _check_same_batch(given: dict, tokens: torch.Tensor, ranks: _Group, name: str) -> None:
    """Refuse, on every rank of the group, a forward whose ranks were given different batches (a sampler of the
    caller's own, data set up before ``device_mesh="auto"`` chose a context group, a stream sharded by global rank):
    their slices would be stitched into sequences of no batch. One all-reduce of 9 numbers per forward (the same
    count on every rank, whatever each was given)."""
    device = tokens.device
    shape = list(tokens.shape)[:3] + [0] * (3 - min(tokens.dim(), 3))
    parts = [torch.tensor(shape, dtype=torch.float64, device=device)]
    for tensor in (tokens, given.get("labels")):
        if tensor is None:
            parts.append(torch.tensor([-1.0, 0.0, 0.0], dtype=torch.float64, device=device))
            continue
        flat = tensor.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(flat.numel(), device=device).remainder(97).to(torch.float64) + 1
        parts.append(torch.stack([flat.new_tensor(float(flat.numel())), flat.sum(), (flat * weights).sum()]))
    digest = torch.cat(parts)
    both = torch.cat([digest, -digest])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ranks.group)
    if not torch.equal(both[: digest.numel()], -both[digest.numel():]):
        raise RuntimeError(
            f"FSDP2Strategy(context_parallel_size={ranks.size}): the ranks of a context group called {name} with"
            " different batches; they split one batch's sequences between them. Give every rank of a group the same"
            " batch: the strategy's `distributed_sampler_kwargs` (Lightning's own sampler uses them) count"
            " data-parallel ranks only; with Fabric and device_mesh='auto', set up the model before the dataloaders."
        )


def _split_layer_input(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    split: _Split | None = kwargs.get(MARKER)
    if split is None:
        return None
    if args:
        hidden = args[0]
        if hidden.shape[1] == split.length:  # the first layer: the whole sequence's embeddings
            args = (split.take(hidden, dim=1), *args[1:])
    elif isinstance(kwargs.get("hidden_states"), torch.Tensor) and kwargs["hidden_states"].shape[1] == split.length:
        kwargs["hidden_states"] = split.take(kwargs["hidden_states"], dim=1)
    embeddings = kwargs.get("position_embeddings")
    if isinstance(embeddings, tuple):  # (cos, sin) of the whole sequence, (batch, tokens, dim): this rank's rows
        kwargs["position_embeddings"] = tuple(
            split.take(t, dim=-2, copy=False) if t.dim() >= 2 and t.shape[-2] == split.length else t
            for t in embeddings)
    split.layers += 1
    return args, kwargs


def _attention(inner: str) -> Callable[..., Any]:
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        split: _Split | None = kwargs.pop(MARKER, None)
        function = _inner_function(module, inner)
        if split is None:
            return function(module, query, key, value, attention_mask, **kwargs)
        target: Any = module
        n, heads, kv_heads = split.ranks.size, query.shape[1], key.shape[1]
        if kv_heads % n:
            # Fewer key/value heads than the group can share (or not a multiple): repeat each as grouped-query
            # attention would, the least that divides, and tell the inner function the groups that remain.
            repeat = next(r for r in range(2, heads // kv_heads + 1)
                          if (heads // kv_heads) % r == 0 and (kv_heads * r) % n == 0)
            key, value = (t.repeat_interleave(repeat, dim=1) for t in (key, value))
            target = _Groups(module, getattr(module, "num_key_value_groups", heads // kv_heads) // repeat)
        q, k, v = (split.to_heads(t) for t in (query, key, value))
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        out, _ = function(target, q, k, v, split.whole_mask(attention_mask, causal, q.device), **kwargs)
        split.attentions += 1
        return split.to_tokens(out), None

    return attention


class _Groups:
    """An attention module seen with another ``num_key_value_groups`` (its key/value heads repeated already)."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _inner_function(module: nn.Module, inner: str) -> Callable[..., Any]:
    if inner == "eager":  # each modeling module has its own (soft-capping, sinks...)
        return importlib.import_module(type(module).__module__).eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]


def _join_outputs(name: str) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        split: _Split | None = kwargs.get(MARKER)
        if split is None:
            return None
        if split.layers == 0 or split.attentions != split.layers:
            raise RuntimeError(
                f"FSDP2Strategy(context_parallel_size={split.ranks.size}): {name}'s {split.layers} decoder layers"
                f" took slices of the sequence but its attention exchanged them {split.attentions} times: the model"
                " mixes tokens outside its attention function (linear attention, convolutions, recurrent layers) or"
                " does not pass keyword arguments down to it, and cannot be split over the sequence. Train it"
                " without context_parallel_size."
            )
        group = split.ranks.group
        if split.loss and output.loss is not None:
            # The gradient is this rank's weighted share; the value, the group's mean: one process's loss.
            total = output.loss.detach().float().clone()
            dist.all_reduce(total, group=group)
            mean = (total / split.ranks.size).to(output.loss.dtype)
            output.loss = output.loss + (mean - output.loss.detach())
        elif not split.loss:
            # No labels: the caller reads the logits of the whole sequence (gathered; its gradient comes back to
            # each rank's slice, summed over the group as FSDP2's division by the group expects).
            from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

            whole = wait_tensor(all_gather_single_autograd(output.logits.contiguous(), gather_dim=1, group=group))
            output.logits = whole[:, : split.length]
        return output

    return hook
