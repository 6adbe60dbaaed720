"""Expert parallelism: the experts of every MoE layer are divided among the ranks of an expert group, and the tokens
routed to an expert travel to its rank and back (``FSDP2Strategy(expert_parallel_size=N)``).

Under FSDP alone each MoE layer gathers every expert on every rank for every micro-batch, although each token uses a
few of them. Here each rank of an expert group holds ``num_experts / N`` whole experts; the group's ranks send each
(token, expert) pair to the expert's rank with an all-to-all and get the weighted outputs back with a second one
(dropless: every token reaches every expert it is routed to, as in one process). Dense weights are untouched by this
step and stay sharded over every data-parallel rank; the experts are kept, by FSDP2, sharded over the ranks holding
the same ones (``Layout.storage``).

The plan and the styles are transformers' own: a Hugging Face MoE model's config ships ``base_model_ep_plan``
(Qwen3-MoE's and Mixtral's ``"layers.*.mlp.experts.gate_up_proj": "grouped_gemm"`` splits the fused expert tensors
along the expert dimension, ``"layers.*.mlp.experts": "ep_dispatch_experts"`` replaces the experts' forward with the
token exchange), applied by ``transformers.distributed.expert_parallel.apply_expert_parallelism``.

Why it composes with FSDP2: the experts' tensors become ``DTensor``s on the ``"expert"`` dimension of a mesh that
shares its root with the dense one (``Layout.expert_mesh``: the shard dimension split into ``"expert_shard"`` and
``"expert"``), and ``fully_shard`` over ``"expert_shard"`` shards each rank's experts again, so checkpoints, loads and
gathers see one ``DTensor`` per parameter with both placements, as under tensor parallelism. An expert's gradient
sums the tokens of the whole expert group (the all-to-all's backward brings them to it): its FSDP group divides by
every data-parallel rank, not its own, and so the experts step as in one process.
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp2.init import outermost
from lightning_fsdp2.layout import EXPERT, Layout
from lightning_fsdp2.peft_support import is_tuner_layer

SUPPORTED_STYLES = frozenset({"grouped_gemm", "ep_dispatch_experts"})
"""transformers' expert-parallel style names that run (and are tested against one process) under FSDP2Strategy."""


def apply_expert_parallel(module: nn.Module, layout: Layout, mesh: DeviceMesh, quantizes: bool = False) -> DeviceMesh | None:
    """``parallel.parallelize``'s step for the layout's ``"expert"`` dimension: divide the experts of every Hugging
    Face MoE model in ``module`` among the expert groups' ranks by the model's own plan, and route the tokens to them.
    Return the expert mesh (``Layout.expert_mesh``: the experts' FSDP groups are kept on it), or ``None`` without
    expert parallelism. ``quantizes``: weights are loaded with ``quantize="nf4"`` (refused).

    Every rank built the same model, so every check raises on every rank alike, before anything is allocated."""
    if layout.expert == 1:
        return None
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    size = layout.size(EXPERT)
    if quantizes:
        raise ValueError(
            f"load_pretrained(..., quantize='nf4') (QLoRA) does not run with expert parallelism"
            f" (expert_parallel_size={size}) yet: NF4 quantizes the FSDP shards of whole weights, and the experts are"
            " divided first. Drop expert_parallel_size, or load the base unquantized."
        )
    plans = expert_plans(module, size, layout.shard_size)
    expert_mesh = layout.expert_mesh(mesh)
    assert expert_mesh is not None
    for model, plan in plans:
        apply_expert_parallelism(model, expert_mesh[EXPERT], expert_mesh["expert_alone"], plan)
    return expert_mesh


def expert_plans(module: nn.Module, size: int, shard: int) -> list[tuple[nn.Module, dict[str, str]]]:
    """Each outermost Hugging Face model in ``module`` with its expert-parallel plan expanded by transformers to its
    concrete experts; a ``ValueError`` naming what cannot run: no model with a plan, a style not run here, experts
    that do not divide by ``size`` (the sizes offered instead also divide the ``shard`` group), peft adapters on the
    experts."""
    from transformers import PreTrainedModel  # a dependency: imported here, as the step is, only when EP is asked for

    models = [m for _, m in outermost(module, PreTrainedModel)]
    planned = [(m, dict(getattr(m, "ep_plan", None) or {})) for m in models]
    planned = [(m, plan) for m, plan in planned if plan]
    if not planned:
        found = ", ".join(type(m).__name__ for m in models) or type(module).__name__
        raise ValueError(
            f"FSDP2Strategy(expert_parallel_size={size}): {found} has no expert-parallel plan (a Hugging Face"
            " mixture-of-experts config carries one as `base_model_ep_plan`: Qwen3-MoE's, Mixtral's). Expert"
            " parallelism divides the experts of such a model; train this one without expert_parallel_size."
        )
    result = []
    for model, plan in planned:
        unsupported = sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})
        if unsupported:
            raise ValueError(
                f"FSDP2Strategy(expert_parallel_size={size}): the expert-parallel plan of {type(model).__name__} uses"
                f" {unsupported}, which FSDP2Strategy does not run yet (it runs {sorted(SUPPORTED_STYLES)})."
            )
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if isinstance(experts, int) and experts % size:
            fits = [d for d in range(2, experts + 1) if experts % d == 0 and shard % d == 0]
            advice = (f"Choose an expert_parallel_size among {fits}." if fits else
                      f"No size above 1 divides both the {experts} experts and the shard group of {shard} ranks:"
                      " train this model without expert_parallel_size, or on a number of ranks that the experts"
                      " divide.")
            raise ValueError(
                f"FSDP2Strategy(expert_parallel_size={size}): {type(model).__name__} has {experts} experts per MoE"
                f" layer, and each rank of an expert group holds an equal share of them. {advice}"
            )
        _check_no_adapters_on_experts(model, plan, size)
        result.append((model, model._expand_parallel_plan(plan)))
    return result


def _check_no_adapters_on_experts(model: nn.Module, plan: dict[str, str], size: int) -> None:
    """peft's adapters on the fused expert tensors (``target_parameters``) wrap the experts module in a tuner layer:
    its tensors are then no longer where the plan names them (refused until tested)."""
    patterns = [re.compile(re.escape(key).replace(r"\*", r"\d+")) for key in plan]
    wrapped = [name for name, sub in model.named_modules()
               if is_tuner_layer(sub) and any(p.fullmatch(name) for p in patterns)]
    if wrapped:
        raise ValueError(
            f"FSDP2Strategy(expert_parallel_size={size}): peft adapters on the experts ({wrapped[:3]}) do not run with"
            " expert parallelism yet: a target_modules entry that names an expert tensor (\"down_proj\","
            " \"all-linear\") or target_parameters puts them there. Put the adapters on the attention and dense"
            " layers (e.g. target_modules=[\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\"], the experts frozen), or"
            " train the experts in full, or drop expert_parallel_size."
        )
