"""The router's load-balancing loss over the global batch (``FSDP2Strategy(router_aux_loss="global_batch")``).

A Hugging Face mixture-of-experts causal LM called with ``output_router_logits=True`` adds
``router_aux_loss_coef * aux_loss`` to its loss, where ``aux_loss`` (Switch Transformer's) is
``num_experts * sum_e f_e * P_e``: ``f_e`` the fraction of the (token, choice) pairs routed to expert ``e``, ``P_e``
the mean router probability of ``e``, both over the tokens of the batch the forward sees. Under data parallelism each
rank sees its own part of the step's batch, so each balances its own tokens: the run differs from one process by
design (``"per_rank"``, the default: what data parallelism does everywhere, expert parallelism included).

``"global_batch"`` makes it one process's: ``f_e`` and the token count are summed over the data-parallel ranks (one
all-reduce of ``num_experts + 1`` numbers per forward; ``f_e`` carries no gradient), and each rank's loss holds its
share ``num_experts * sum_e f_e * P_e(own tokens) * R / (all tokens)`` (``R``: data-parallel ranks). The gradients,
averaged over the ranks as data parallelism averages them, and the mean of the ranks' losses are then one process's
over the whole batch.

The model's ``load_balancing_loss_func`` is not replaced: a forward hook on the model takes its ``aux_loss`` out of the
loss and puts the rank's share in (``aux_loss`` holds the share then). The share's router probabilities are computed
in fp32 (transformers' own loss takes the softmax in the logits' dtype: in bf16 a near-tie may rank differently).
Models whose balancing loss is another function (Doge's, NLLB-MoE's) are refused by name; so is a forward with
``return_dict=False`` and the router logits on, whose loss cannot be told apart in its output.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp2.init import outermost
from lightning_fsdp2.layout import DATA_PARALLEL, Layout

RouterAuxLoss = Literal["per_rank", "global_batch"]
"""Over which tokens a mixture-of-experts model's load-balancing loss is computed: each data-parallel rank's own
(``"per_rank"``, as data parallelism does) or the step's whole batch (``"global_batch"``, as one process does)."""

ROUTER_AUX_LOSS = get_args(RouterAuxLoss)

_MOE_ATTRIBUTES = ("router_aux_loss_coef", "num_experts", "num_experts_per_tok")
_REFERENCE = "transformers.models.qwen3_moe.modeling_qwen3_moe"  # whose balancing loss the share is derived from


def apply_router_loss(module: nn.Module, layout: Layout, mesh: DeviceMesh, over: RouterAuxLoss) -> None:
    """``parallel.parallelize``'s step for ``router_aux_loss``: with ``"global_batch"``, every Hugging Face
    mixture-of-experts causal LM in ``module`` computes its load-balancing loss over the data-parallel ranks' batches
    (a ``ValueError`` naming ``module``'s class if it holds none). Every rank, before ``fully_shard``."""
    if over == "per_rank":
        return
    models = moe_models(module)
    if not models:
        raise ValueError(
            f"FSDP2Strategy(router_aux_loss='global_batch'): {type(module).__name__} holds no Hugging Face"
            " mixture-of-experts causal LM (one with `router_aux_loss_coef`, `num_experts` and `num_experts_per_tok`:"
            " Qwen3-MoE's, Mixtral's), whose load-balancing loss it computes over the global batch. Drop"
            " router_aux_loss for this model."
        )
    others = [type(m).__name__ for m in models if not computes_switch_loss(m)]
    if others:
        raise ValueError(
            f"FSDP2Strategy(router_aux_loss='global_batch'): the load-balancing loss of {', '.join(others)} is not"
            " transformers' Switch-Transformer `load_balancing_loss_func` (Qwen3-MoE's, Mixtral's, ...), whose"
            " global-batch form this option computes. Drop router_aux_loss for this model."
        )
    group_mesh = layout.sub_mesh(mesh, DATA_PARALLEL)
    if group_mesh is None:  # one data-parallel rank: its batch is the global batch already
        return
    group, ranks = group_mesh.get_group(), group_mesh.size()
    for model in models:
        model.register_forward_hook(_global_batch_hook(model, group, ranks), with_kwargs=True)


def moe_models(module: nn.Module) -> list[nn.Module]:
    """The outermost Hugging Face models in ``module`` that add a router's load-balancing loss to their loss."""
    from transformers import PreTrainedModel  # a dependency, imported with the option's step

    return [m for _, m in outermost(module, PreTrainedModel) if all(hasattr(m, a) for a in _MOE_ATTRIBUTES)]


def computes_switch_loss(model: nn.Module) -> bool:
    """Whether ``model``'s modeling module balances its experts with transformers' Switch-Transformer loss (the same
    function, copied into each model's module: compared by its code, not its name; Doge's and NLLB-MoE's differ)."""
    import importlib

    def code(function: Any) -> Any:
        c = function.__code__
        return c.co_code, c.co_names, c.co_consts[1:]  # the docstring aside

    own = getattr(importlib.import_module(type(model).__module__), "load_balancing_loss_func", None)
    reference = importlib.import_module(_REFERENCE).load_balancing_loss_func
    return own is not None and code(own) == code(reference)


def _global_batch_hook(model: nn.Module, group: Any, ranks: int) -> Any:
    signature = inspect.signature(model.forward)

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        # Bound only when it is needed: the hook runs on every forward, most of them without router logits.
        def argument(name: str) -> Any:
            return signature.bind_partial(*args, **kwargs).arguments.get(name)

        if isinstance(output, tuple):  # return_dict=False: the loss cannot be told apart from the other outputs
            asked = argument("output_router_logits")
            if asked or (asked is None and getattr(getattr(module, "config", None), "output_router_logits", False)):
                raise ValueError(
                    f"FSDP2Strategy(router_aux_loss='global_batch'): {type(module).__name__} was called with"
                    " return_dict=False and its router logits on; the global-batch balancing loss replaces the"
                    " model's own in its output's `loss` and `aux_loss`. Call it with return_dict=True (the default)."
                )
            return None
        local = getattr(output, "aux_loss", None)
        logits = getattr(output, "router_logits", None)
        if local is None or not logits:  # output_router_logits off: no balancing loss to replace
            return None
        mask = argument("attention_mask")
        share = global_batch_share(logits, module.num_experts, module.num_experts_per_tok, mask, group, ranks)
        if output.loss is not None:  # the model added coef * aux_loss to its loss (it does when given labels)
            change = module.router_aux_loss_coef * (share - local.to(share.dtype))
            output.loss = output.loss + change.to(output.loss.device, output.loss.dtype)
        output.aux_loss = share
        return output

    return hook


def global_batch_share(
    router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: torch.Tensor | None,
    group: Any, ranks: int,
) -> torch.Tensor:
    """This rank's share of the load-balancing loss over the batches of the ``ranks`` ranks of ``group`` (every rank
    calls it with its own ``router_logits``, one ``(tokens, num_experts)`` tensor per MoE layer): the mean of the
    shares is the loss one process computes over all the tokens, and so is the mean of their gradients. Padding
    (``attention_mask == 0``) counts for nothing, as in transformers' own loss."""
    device = router_logits[0].device
    weight = None if attention_mask is None else attention_mask.reshape(-1).to(device, torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probabilities = torch.zeros(num_experts, dtype=torch.float32, device=device)
    tokens = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        routing = torch.softmax(logits.to(device, torch.float32), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices.reshape(-1)
        # fp32 whatever the default dtype (`*-true` precision sets it to bf16/fp16 around forwards): counts exactly
        rows = torch.ones(routing.shape[0], dtype=torch.float32, device=device) if weight is None else weight
        counts = counts.scatter_add(0, chosen, rows.repeat_interleave(top_k))
        probabilities = probabilities + (routing * rows.unsqueeze(-1)).sum(dim=0)
        tokens = tokens + rows.sum()
    # The counts carry no gradient (top-k), as in one process: summed over the ranks, they are the global batch's.
    totals = torch.cat([counts, tokens.reshape(1)]).detach()
    dist.all_reduce(totals, group=group)
    fractions, everyone = totals[:-1] / totals[-1], totals[-1]
    return num_experts * ranks * torch.sum(fractions * probabilities) / everyone
