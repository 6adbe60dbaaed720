"""The strategies' options, one small frozen object per technique, each checking its own arguments.

Both front-ends (:class:`lightning_fsdp2.FSDP2Strategy` and :class:`lightning_fsdp2.fabric.FSDP2Strategy`) take
Lightning's flat keyword arguments and hand them, in one call, to :meth:`StrategyOptions.from_arguments`, which gives
each technique the arguments its ``from_arguments`` names. A wrong value raises there, at construction, on every rank
alike; what depends on the processes (the world size, the device) is checked by :meth:`StrategyOptions.check` once
they are known. Everything downstream (``parallel.parallelize``, the checkpoint code) reads these objects, never the
front-ends' arguments.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from lightning_fsdp2.auto_layout import BatchShape, check_batch_shape, check_memory_budget
from lightning_fsdp2.blocks import SavePolicy, check_compile_options, check_save_policy
from lightning_fsdp2.layout import (
    Layout,
    MeshOption,
    check_mesh_option,
    check_tensor_given_once,
    check_expert_given_once,
    check_context_given_once,
    check_parallel_size,
    check_tensor_parallel_size,
)
from lightning_fsdp2.router_loss import ROUTER_AUX_LOSS, RouterAuxLoss
from lightning_fsdp2.tensor_parallel import TensorParallelPlan, check_plan_option, check_tensor_parallel_options
from lightning_fsdp2.wrap import ModulePolicy

StateDictType = Literal["full", "sharded"]
"""How checkpoints are saved: one file from rank 0, or a directory of every rank's shards."""


@dataclass(frozen=True)
class LayoutOptions:
    """How the processes are arranged (``device_mesh``, ``tensor_parallel_size``); resolved into a
    :class:`~lightning_fsdp2.layout.Layout` once the world size is known, or, with ``device_mesh="auto"``, chosen
    once the model exists from the memory it needs (``memory_budget``, ``batch_shape``: ``auto_layout.py``)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "device_mesh": (
            "``None`` (default) shards every parameter over all processes. ``(replicate, shard)``: HSDP, each "
            "parameter sharded over groups of ``shard`` consecutive ranks (the devices of one node) and replicated "
            "over ``replicate`` such groups, so only the gradient all-reduce crosses between groups; ``replicate x "
            "shard`` (x ``tensor_parallel_size``) must be the number of processes and ``shard`` divide the devices "
            "per node (or be a multiple of them). ``(replicate, shard, tensor)``: tensor parallelism over groups of "
            "``tensor`` adjacent ranks as well. The sizes by name, ``{\"replicate\": 2, \"shard\": 4, \"tensor\": 2}``, say "
            "the same (a dimension left out has one rank; ``\"shard\"`` left out, the processes the others leave). A "
            "ready ``DeviceMesh`` (1-D, 2-D as ``(replicate, shard)`` or 3-D as ``(replicate, shard, tensor)``, over "
            "every rank in order, as ``init_device_mesh`` makes it) is used as it is; it needs a process group "
            "started by the launcher. ``\"auto\"``: chosen once the model exists on ``meta``, before anything is "
            "allocated, from the memory each rank would need (parameters, gradients, Adam's state, gathered "
            "parameters, activations) against ``memory_budget``: the fastest that fits, from a shard group of one "
            "rank (every rank a whole replica, DDP's traffic) through HSDP to full sharding (then, for a causal LM "
            "with ``batch_shape``, each sequence split over a context group), and ``reshard_after_forward`` with it; "
            "printed on rank 0 and kept in ``strategy.layout_choice``."
        ),
        "tensor_parallel_size": (
            "split the layers of the tensor-parallel plan over groups of this many adjacent ranks (inside a node; it "
            "must divide the devices per node), and shard with FSDP2 over the rest (1, default: no tensor "
            "parallelism). The ranks of a group compute one batch together: ``distributed_sampler_kwargs`` count "
            "data-parallel ranks only."
        ),
        "expert_parallel_size": (
            "expert parallelism for a mixture-of-experts model: each shard group is split into groups of this many "
            "adjacent ranks (it must divide the shard group and the devices per node), each rank holding "
            "``num_experts / N`` whole experts of every MoE layer, sharded by FSDP2 over the ranks that hold the same "
            "ones, and the tokens routed to an expert sent to its rank and back by all-to-all (dropless, as in one "
            "process). Dense weights stay sharded over every data-parallel rank, and every rank still reads its own "
            "batch. The model's own plan (a Hugging Face config's ``base_model_ep_plan``) with transformers' "
            "expert-parallel styles. Also ``device_mesh={\"shard\": S, \"expert\": N}``. 1 (default): none."
        ),
        "context_parallel_size": (
            "context parallelism for long sequences: the ranks of a group of this many adjacent ranks read the same "
            "batch and each keeps ``1/N`` of every sequence's tokens through the model's layers; attention sees whole "
            "sequences for ``1/N`` of the heads (an all-to-all before and after it, DeepSpeed-Ulysses' way), so that "
            "masks, padding and packed documents behave as in one process. Hugging Face causal LMs called with whole "
            "batches (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``): the labels are shifted on "
            "the whole sequence and each rank's loss weighted so that gradients and the returned loss are one "
            "process's. FSDP2 shards over the shard and context ranks together. Also "
            "``device_mesh={\"shard\": S, \"context\": N}``. 1 (default): none."
        ),
        "memory_budget": (
            "with ``device_mesh=\"auto\"``, the bytes each rank may use (an int, or ``\"20GiB\"``/``\"80GB\"``); default: "
            "the device's free memory (on CPU, the available memory divided among the node's processes), the smallest "
            "over the ranks."
        ),
        "batch_shape": (
            "with ``device_mesh=\"auto\"``, ``(sequences, tokens)`` of one rank's micro-batch (a context group's, "
            "when it splits sequences): the activations are "
            "estimated from one forward of the model on ``meta`` (Hugging Face causal LMs). Without it, a quarter of "
            "the budget is held back for them."
        ),
    }

    device_mesh: MeshOption | Literal["auto"] = None
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    memory_budget: int | None = None
    batch_shape: BatchShape | None = None

    @classmethod
    def from_arguments(
        cls,
        *,
        device_mesh: MeshOption | Literal["auto"] = None,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        memory_budget: int | str | None = None,
        batch_shape: BatchShape | None = None,
    ) -> LayoutOptions:
        auto = isinstance(device_mesh, str) and device_mesh == "auto"
        mesh = "auto" if auto else check_mesh_option(device_mesh)
        size = check_tensor_parallel_size(tensor_parallel_size)
        check_tensor_given_once(mesh, size)
        experts = check_parallel_size(expert_parallel_size, "expert_parallel_size",
                                      "the ranks of one expert group, whose experts each holds a share of")
        check_expert_given_once(mesh, experts)
        context = check_parallel_size(context_parallel_size, "context_parallel_size",
                                      "the ranks each sequence's tokens are split over")
        check_context_given_once(mesh, context)
        budget = check_memory_budget(memory_budget)
        check_batch_shape(batch_shape, "FSDP2Strategy")
        if not auto and (budget is not None or batch_shape is not None):
            given = "memory_budget" if budget is not None else "batch_shape"
            raise ValueError(
                f"FSDP2Strategy({given}=...) is read by device_mesh='auto' (the layout chosen from the memory the run"
                f" needs), and device_mesh is {device_mesh!r}. Pass device_mesh='auto' as well, or drop {given}."
            )
        if auto and size > 1:
            raise ValueError(
                f"FSDP2Strategy(device_mesh='auto', tensor_parallel_size={size}): 'auto' chooses among data-parallel"
                " layouts (replicated, HSDP, fully sharded) only. With tensor parallelism give the layout:"
                f" device_mesh=(replicate, shard, {size}) or tensor_parallel_size alone."
            )
        return cls(mesh, size, experts, context, budget,  # type: ignore[arg-type]
                   tuple(batch_shape) if batch_shape is not None else None)

    @property
    def auto(self) -> bool:
        """The layout is chosen from the memory the run needs, once the model exists."""
        return self.device_mesh == "auto"

    def resolve(self, world_size: int, devices_per_node: int, device_type: str) -> Layout:
        assert not self.auto
        return Layout.resolve(self.device_mesh, world_size, devices_per_node, device_type,  # type: ignore[arg-type]
                              self.tensor_parallel_size, self.expert_parallel_size, self.context_parallel_size)


@dataclass(frozen=True)
class TensorParallelOptions:
    """Which layers tensor parallelism splits, and how (``tensor_parallel_plan``; ``None``: the model's own plan)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "tensor_parallel_plan": (
            "which layers tensor parallelism splits: ``None`` (default) uses a Hugging Face model's own plan "
            "(``base_model_tp_plan``) with transformers' styles; a dict of module-name patterns (``*`` for one name "
            "part, names as ``named_modules()`` of the LightningModule) to transformers' style names (``\"colwise\"``, "
            "``\"rowwise\"``, ``\"embedding_rowwise\"``...) or torch ``ParallelStyle`` objects; or a callable ``(model, "
            "tensor_mesh)`` that parallelizes the model itself. LoRA adapters on split layers are split as peft does."
        ),
    }

    plan: TensorParallelPlan = None

    @classmethod
    def from_arguments(cls, *, tensor_parallel_plan: TensorParallelPlan = None) -> TensorParallelOptions:
        return cls(check_plan_option(tensor_parallel_plan))


@dataclass(frozen=True)
class RouterLossOptions:
    """Over which tokens a mixture-of-experts model's load-balancing loss is computed (``router_aux_loss``:
    ``router_loss.py``)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "router_aux_loss": (
            "over which tokens a Hugging Face mixture-of-experts model's load-balancing loss "
            "(``output_router_logits=True``, weighted by ``router_aux_loss_coef``) is computed: ``\"per_rank\"`` "
            "(default) over each data-parallel rank's own batch, as data parallelism does (a run then differs from "
            "one process by design); ``\"global_batch\"`` over the step's whole batch, the experts' token counts "
            "summed over the data-parallel ranks (one small all-reduce per forward), so that training equals one "
            "process's. The model's ``aux_loss`` is then this rank's share (their mean is one process's)."
        ),
    }

    over: RouterAuxLoss = "per_rank"

    @classmethod
    def from_arguments(cls, *, router_aux_loss: RouterAuxLoss = "per_rank") -> RouterLossOptions:
        if router_aux_loss not in ROUTER_AUX_LOSS:
            raise _kind(router_aux_loss, str)(
                f"FSDP2Strategy(router_aux_loss={router_aux_loss!r}): pass 'per_rank' (each data-parallel rank's own"
                " batch, the default) or 'global_batch' (the step's whole batch, as one process)."
            )
        return cls(router_aux_loss)


@dataclass(frozen=True)
class ShardOptions:
    """What ``fully_shard`` is given: the groups, a precision policy overriding the plugin's, resharding after
    forward, and where the sharded parameters live (``cpu_offload``)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "auto_wrap_policy": (
            "which modules become their own FSDP group (all-gathered and freed together): a set of module classes or "
            "a callable ``(name, module) -> bool``. Default: a Hugging Face model's ``_no_split_modules``, else "
            "``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer``, else the repeated children of an "
            "``nn.ModuleList``. The root is always a group too."
        ),
        "mixed_precision": (
            "an FSDP2 ``MixedPrecisionPolicy`` that overrides the one derived from ``Trainer(precision=...)``."
        ),
        "reshard_after_forward": (
            "``True`` frees gathered parameters after forward (least memory), ``False`` keeps them to backward (least "
            "communication), an ``int`` reshards to groups of that many ranks."
        ),
        "cpu_offload": (
            "keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only); ``True`` or a "
            "``CPUOffloadPolicy``."
        ),
    }

    auto_wrap_policy: ModulePolicy | None = None
    mixed_precision: MixedPrecisionPolicy | None = None
    reshard_after_forward: bool | int = True
    offload_policy: OffloadPolicy | None = None

    @classmethod
    def from_arguments(
        cls,
        *,
        auto_wrap_policy: ModulePolicy | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool | int = True,
        cpu_offload: bool | OffloadPolicy = False,
    ) -> ShardOptions:
        """``cpu_offload=True`` is FSDP2's ``CPUOffloadPolicy()``."""
        _check_type("mixed_precision", mixed_precision, (MixedPrecisionPolicy, type(None)),
                    "a torch.distributed.fsdp.MixedPrecisionPolicy, or None for the one Trainer(precision=...) gives.")
        _check_type("reshard_after_forward", reshard_after_forward, (bool, int),
                    "True, False, or an int: the ranks to reshard to after forward (a divisor of the shard size).")
        _check_type("cpu_offload", cpu_offload, (bool, OffloadPolicy), "True, False, or an FSDP2 OffloadPolicy.")
        offload = cpu_offload if isinstance(cpu_offload, OffloadPolicy) else (CPUOffloadPolicy() if cpu_offload else None)
        return cls(auto_wrap_policy, mixed_precision, reshard_after_forward, offload)

    def check_device(self, device: torch.device) -> None:
        if self.offload_policy is not None and device.type == "cpu":
            raise ValueError(
                "FSDP2Strategy(cpu_offload=True) moves parameters from an accelerator to CPU memory, but this run is"
                " already on the CPU. Remove `cpu_offload`, or train on GPUs (`accelerator='cuda'`)."
            )

    def check_layout(self, layout: Layout) -> None:
        shard, resharded = layout.shard_size, self.reshard_after_forward
        if not isinstance(resharded, bool) and not (1 < resharded < shard and shard % resharded == 0):
            divisors = [d for d in range(2, shard) if shard % d == 0]
            if not divisors:
                raise ValueError(
                    f"FSDP2Strategy(reshard_after_forward={resharded}) with parameters sharded over {shard} ranks: an"
                    f" int is the size of smaller groups to reshard to after forward, and {shard} ranks have none"
                    f" (no divisor of {shard} other than 1 and itself). Use True (free after forward) or False (keep"
                    " to backward)."
                )
            raise ValueError(
                f"FSDP2Strategy(reshard_after_forward={resharded}) with parameters sharded over {shard} ranks: an int"
                f" is the size of the groups parameters are resharded to after forward, a divisor of {shard} other"
                f" than 1 and {shard} (those are reshard_after_forward=False and True)."
            )


@dataclass(frozen=True)
class CheckpointingOptions:
    """Activation checkpointing: which modules, every n-th of them, and which ops' outputs they keep."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "activation_checkpointing_policy": (
            "modules whose activations are recomputed in backward (same forms as ``auto_wrap_policy``); ``None`` for "
            "none. Applied before sharding."
        ),
        "activation_checkpointing_every": (
            "checkpoint only every n-th of the modules ``activation_checkpointing_policy`` selects (in model order: "
            "with 2 the second, fourth...); 1 (default) checkpoints them all."
        ),
        "activation_checkpointing_save": (
            "op-level selective checkpointing: the checkpointed modules keep the outputs of these ops and recompute "
            "the rest. ``\"matmuls\"`` (matrix multiplications and attention kernels), a collection of ATen operators, "
            "or a ``torch.utils.checkpoint`` policy function ``(ctx, op, *args, **kwargs) -> CheckpointPolicy``. "
            "``None`` (default): recompute everything."
        ),
    }

    policy: ModulePolicy | None = None
    every: int = 1
    save: SavePolicy | None = None

    @classmethod
    def from_arguments(
        cls,
        *,
        activation_checkpointing_policy: ModulePolicy | None = None,
        activation_checkpointing_every: int = 1,
        activation_checkpointing_save: SavePolicy | None = None,
    ) -> CheckpointingOptions:
        if not _int_at_least(activation_checkpointing_every, 1):
            raise _kind(activation_checkpointing_every, int)(
                f"FSDP2Strategy(activation_checkpointing_every={activation_checkpointing_every!r}): a positive int, n"
                " to checkpoint every n-th module activation_checkpointing_policy selects (1: all of them)."
            )
        check_save_policy(activation_checkpointing_save)
        if activation_checkpointing_policy is None and (
            activation_checkpointing_every != 1 or activation_checkpointing_save is not None
        ):
            raise ValueError(
                "FSDP2Strategy(activation_checkpointing_every=..., activation_checkpointing_save=...) choose among the"
                " modules activation_checkpointing_policy selects, and none is given: pass it too, e.g."
                " activation_checkpointing_policy={LlamaDecoderLayer}."
            )
        return cls(activation_checkpointing_policy, activation_checkpointing_every, activation_checkpointing_save)


@dataclass(frozen=True)
class CompileOptions:
    """``torch.compile`` of each block: its keyword arguments, or ``None`` (not compiled)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "compile": (
            "``torch.compile`` each block (the innermost modules ``auto_wrap_policy`` selects) after activation "
            "checkpointing and before sharding: ``True``, or a dict of ``torch.compile``'s keyword arguments "
            "(``{\"mode\": \"max-autotune\"}``...). Training forwards run compiled, evaluation eagerly. Parameter names "
            "and checkpoints are unchanged."
        ),
    }

    kwargs: Mapping[str, Any] | None = None

    @classmethod
    def from_arguments(cls, *, compile: bool | Mapping[str, Any] = False) -> CompileOptions:
        """``compile=True`` is ``torch.compile``'s defaults."""
        if not isinstance(compile, (bool, Mapping)):
            raise TypeError(
                f"FSDP2Strategy(compile={compile!r}): pass True, a dict of torch.compile's keyword arguments, or False"
                " (the default: not compiled)."
            )
        kwargs = None if compile is False else ({} if compile is True else dict(compile))
        if kwargs is not None:
            check_compile_options(kwargs)
        return cls(kwargs)


@dataclass(frozen=True)
class PrefetchOptions:
    """When the blocks' all-gathers start, and whether the last block reshards after its forward."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "forward_prefetch": (
            "in forward, each block starts the all-gathers of the next n blocks of its root (0, default: FSDP2's own "
            "schedule, each block gathered when its forward starts)."
        ),
        "backward_prefetch": (
            "in backward, each block starts the all-gathers of the n blocks before it (1, default: FSDP2's own)."
        ),
        "reshard_last_block": (
            "free the last block's gathered parameters after its forward like the others' (``True``, default), or "
            "keep them to its backward, which comes first (one all-gather less per step for one block's parameters "
            "held meanwhile). Only matters when ``reshard_after_forward`` is not ``False``."
        ),
    }

    forward: int = 0
    backward: int = 1
    reshard_last_block: bool = True

    @classmethod
    def from_arguments(
        cls, *, forward_prefetch: int = 0, backward_prefetch: int = 1, reshard_last_block: bool = True
    ) -> PrefetchOptions:
        if not (_int_at_least(forward_prefetch, 0) and _int_at_least(backward_prefetch, 1)):
            ints = _kind(forward_prefetch, int) is ValueError and _kind(backward_prefetch, int) is ValueError
            raise (ValueError if ints else TypeError)(
                f"FSDP2Strategy(forward_prefetch={forward_prefetch!r}, backward_prefetch={backward_prefetch!r}): how many"
                " blocks ahead to start all-gathering, an int >= 0 in forward and >= 1 in backward (0 and 1 are FSDP2's"
                " own schedule)."
            )
        _check_flag("reshard_last_block", reshard_last_block)
        return cls(forward_prefetch, backward_prefetch, reshard_last_block)


@dataclass(frozen=True)
class ActivationOffloadOptions:
    """Activations saved for backward kept in pinned CPU memory between forward and backward (CUDA only)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "offload_activations": (
            "keep the activations saved for backward (not the weights) in pinned CPU memory between each root's "
            "training forward and its backward. CUDA only."
        ),
    }

    enabled: bool = False

    @classmethod
    def from_arguments(cls, *, offload_activations: bool = False) -> ActivationOffloadOptions:
        _check_flag("offload_activations", offload_activations)
        return cls(offload_activations)

    def check(self, device: torch.device) -> None:
        if self.enabled and device.type != "cuda":
            raise ValueError(
                f"FSDP2Strategy(offload_activations=True) moves the activations saved for backward from the GPU to CPU"
                f" memory, but this run is on {device.type!r}, where they are in CPU memory already. Remove"
                " `offload_activations`, or train on GPUs (`accelerator='cuda'`)."
            )


@dataclass(frozen=True)
class ForwardCheckOptions:
    """Seconds a forward outside training waits for every rank to run it too (``None``: not checked)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "unmatched_forward_timeout": (
            "seconds a forward outside training (evaluation, ``generate``, any forward under ``torch.no_grad()`` or "
            "in ``eval()`` mode) waits for every rank to run it too, then raises naming the cause, instead of hanging "
            "in its all-gathers until ``timeout`` (a forward on rank 0 alone, e.g. sampling on rank 0 only). Default "
            "60; ``None`` turns the check off. Training forwards are not checked."
        ),
    }

    timeout: float | None = 60.0

    @classmethod
    def from_arguments(cls, *, unmatched_forward_timeout: float | None = 60.0) -> ForwardCheckOptions:
        timeout = unmatched_forward_timeout
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < float("inf")
        ):
            raise _kind(timeout, (int, float))(
                f"FSDP2Strategy(unmatched_forward_timeout={timeout!r}): seconds (> 0) a forward outside"
                " training waits for every rank to run it too, or None to turn the check off."
            )
        return cls(timeout)


@dataclass(frozen=True)
class PeerWatchOptions:
    """Seconds a rank waits in a collective for a peer, from the second training step on (``None``: the process
    group's ``timeout`` throughout, and no report of the peers' states)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "peer_timeout": (
            "seconds a rank waits in a collective for another rank, from the second training step on (the first may "
            "compile and warm up for longer), then raises ``PeerLostError`` naming what each rank was last doing (a "
            "rank that caught an exception and moved on, returned early, or is stuck in its own code; a save called "
            "on some ranks only), instead of waiting for ``timeout``. Default 300; ``None``: the process group's "
            "``timeout`` throughout, no report. Each rank publishes its phase to the process group's store once a "
            "second from a thread; the step itself pays nothing measurable."
        ),
    }

    timeout: float | None = 300.0

    @classmethod
    def from_arguments(cls, *, peer_timeout: float | None = 300.0) -> PeerWatchOptions:
        if peer_timeout is None:
            return cls(None)
        what = (f"FSDP2Strategy(peer_timeout={peer_timeout!r}): seconds (> 0) a rank waits in a collective for a peer"
                " before it raises, naming what each rank was doing; or None to wait for the process group's timeout.")
        if isinstance(peer_timeout, bool) or not isinstance(peer_timeout, (int, float)):
            raise TypeError(what)  # as every option: TypeError for another type, ValueError for a bad value
        if not 0 < peer_timeout < float("inf"):
            raise ValueError(what)
        return cls(peer_timeout)


@dataclass(frozen=True)
class InitOptions:
    """Whether the model is built on ``meta`` (each rank then allocates only its shards)."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "meta_init": (
            "build parameters on ``meta`` in ``configure_model`` (default). ``False`` builds them for real on the CPU "
            "first and shards them afterwards (every rank then holds the whole model for a moment)."
        ),
    }

    meta_init: bool = True

    @classmethod
    def from_arguments(cls, *, meta_init: bool = True) -> InitOptions:
        _check_flag("meta_init", meta_init)
        return cls(meta_init)


@dataclass(frozen=True)
class ProcessGroupOptions:
    """The default process group: its backend (``None``: from the device) and its collectives' timeout."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "process_group_backend": (
            "``\"gloo\"``, ``\"nccl\"``...; default from the device (gloo on CPU, nccl on CUDA)."
        ),
        "timeout": (
            "timeout of collective operations."
        ),
    }

    backend: str | None = None
    timeout: timedelta | None = default_pg_timeout

    @classmethod
    def from_arguments(
        cls, *, process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout
    ) -> ProcessGroupOptions:
        _check_type("process_group_backend", process_group_backend, (str, type(None)),
                    "the name of a torch.distributed backend ('nccl', 'gloo', ...), or None for the device's default.")
        _check_type("timeout", timeout, (timedelta, type(None)),
                    "a datetime.timedelta for the process group's collectives, or None for torch's default.")
        return cls(process_group_backend, timeout)


@dataclass(frozen=True)
class SaveOptions:
    """Checkpoints: one file or every rank's shards, trainable parameters only, written in the background; their
    checksums verified before a load."""

    ARGUMENTS: ClassVar[Mapping[str, str]] = {  # the front-ends' keywords, as their docs describe them
        "state_dict_type": (
            "how checkpoints are saved. ``\"full\"``: one file written by rank 0, the same a single-device run writes "
            "(loadable without this library). ``\"sharded\"``: a directory in which every rank writes its own shards "
            "(``torch.distributed.checkpoint``), much faster and lighter for large models. Both kinds are loaded by "
            "``fit(ckpt_path=...)`` on any number of processes."
        ),
        "save_trainable_only": (
            "save only parameters with ``requires_grad=True`` (and their optimizer state), e.g. the LoRA adapters of "
            "a frozen base. On resume the frozen base must come from ``load_pretrained`` again."
        ),
        "async_save": (
            "write sharded checkpoints in the background (``torch.distributed.checkpoint.async_save``): "
            "``save_checkpoint`` returns once the shards are copied to CPU memory, training goes on while they are "
            "written, and the directory appears at its path when every rank is done. The next save (and the end of "
            "``fit``) waits for the previous one; a save after ``fit`` returned is synchronous. Needs "
            "``state_dict_type=\"sharded\"``."
        ),
        "verify_checkpoints": (
            "before a checkpoint is loaded (``ckpt_path=``), check the CRC-32 of every piece of its data against the "
            "checksums written with it (the ranks share the reading: one more read of its bytes in all), and raise on "
            "every rank, naming the file and tensor, if any differs. Default ``True``; ``False`` loads without the "
            "check. Checkpoints written by others load as before."
        ),
    }

    state_dict_type: StateDictType = "full"
    save_trainable_only: bool = False
    async_save: bool = False
    verify_checkpoints: bool = True

    @classmethod
    def from_arguments(
        cls, *, state_dict_type: StateDictType = "full", save_trainable_only: bool = False, async_save: bool = False,
        verify_checkpoints: bool = True,
    ) -> SaveOptions:
        for name, flag in (("verify_checkpoints", verify_checkpoints), ("save_trainable_only", save_trainable_only),
                           ("async_save", async_save)):
            _check_flag(name, flag)
        if state_dict_type not in ("full", "sharded"):
            raise _kind(state_dict_type, str)(
                f"FSDP2Strategy(state_dict_type={state_dict_type!r}): 'full' (one file, written by rank 0) or"
                " 'sharded' (a directory of every rank's shards)."
            )
        if async_save and state_dict_type != "sharded":
            raise ValueError(
                "FSDP2Strategy(async_save=True) writes sharded checkpoints in the background; a full checkpoint is"
                " gathered to rank 0 while it is written. Pass state_dict_type='sharded' as well, or drop async_save."
            )
        return cls(state_dict_type, save_trainable_only, async_save, verify_checkpoints)

    @property
    def sharded(self) -> bool:
        """Checkpoints are saved as a directory of every rank's shards."""
        return self.state_dict_type == "sharded"


_PARTS: dict[str, type] = {
    "layout": LayoutOptions,
    "tensor_parallel": TensorParallelOptions,
    "router_loss": RouterLossOptions,
    "shard": ShardOptions,
    "checkpointing": CheckpointingOptions,
    "compile": CompileOptions,
    "prefetch": PrefetchOptions,
    "offload_activations": ActivationOffloadOptions,
    "forward_check": ForwardCheckOptions,
    "peer_watch": PeerWatchOptions,
    "init": InitOptions,
    "process_group": ProcessGroupOptions,
    "save": SaveOptions,
}


@dataclass(frozen=True)
class StrategyOptions:
    """Every technique's options (see the classes above), as both front-ends keep them."""

    layout: LayoutOptions = LayoutOptions()
    tensor_parallel: TensorParallelOptions = TensorParallelOptions()
    router_loss: RouterLossOptions = RouterLossOptions()
    shard: ShardOptions = ShardOptions()
    checkpointing: CheckpointingOptions = CheckpointingOptions()
    compile: CompileOptions = CompileOptions()
    prefetch: PrefetchOptions = PrefetchOptions()
    offload_activations: ActivationOffloadOptions = ActivationOffloadOptions()
    forward_check: ForwardCheckOptions = ForwardCheckOptions()
    peer_watch: PeerWatchOptions = PeerWatchOptions()
    init: InitOptions = InitOptions()
    process_group: ProcessGroupOptions = ProcessGroupOptions()
    save: SaveOptions = SaveOptions()

    @staticmethod
    def documented() -> dict[str, str]:
        """Each option's description (its technique's ``ARGUMENTS``), by technique: what the front-ends' docstrings
        show."""
        return {name: text for part in _PARTS.values() for name, text in part.ARGUMENTS.items()}

    @staticmethod
    def args_section(own: Mapping[str, str] | None = None, leave_out: tuple[str, ...] = ()) -> str:
        """The ``Args:`` section of a front-end's docstring (indented as a class docstring's body): every option's
        description, then the front-end's ``own`` arguments, less ``leave_out``."""
        entries = {**StrategyOptions.documented(), **(own or {})}
        lines = ["", "    Args:"]
        for name, text in entries.items():
            if name not in leave_out:
                lines += textwrap.wrap(f"{name}: {text}", width=116, initial_indent="        ",
                                       subsequent_indent="            ", break_on_hyphens=False)
        return "\n".join(lines) + "\n"

    @staticmethod
    def arguments() -> dict[str, inspect.Parameter]:
        """The front-ends' keyword arguments that are options, with their defaults."""
        return {name: param for part in _PARTS.values()
                for name, param in inspect.signature(part.from_arguments).parameters.items()}

    @classmethod
    def pick(cls, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``arguments`` (a front-end's ``locals()``) that are options."""
        names = cls.arguments()
        return {name: value for name, value in arguments.items() if name in names}

    @classmethod
    def from_arguments(cls, **arguments: Any) -> StrategyOptions:
        """The options from a front-end's keyword arguments (any subset; the rest keep their defaults), each
        technique checking its own."""
        unknown = set(arguments) - set(cls.arguments())
        if unknown:
            raise TypeError(f"FSDP2Strategy got unexpected option(s) {sorted(unknown)}.")
        parts = {}
        for field, part in _PARTS.items():
            taken = inspect.signature(part.from_arguments).parameters
            parts[field] = part.from_arguments(**{k: v for k, v in arguments.items() if k in taken})
        options = cls(**parts)
        options.check_auto_layout()
        return options

    def check_auto_layout(self) -> None:
        """``device_mesh="auto"`` chooses ``reshard_after_forward`` too, for the device's memory: refuse a value given
        with it, and ``cpu_offload`` (its state lives in host memory, which the device's budget does not count)."""
        if not self.layout.auto:
            return
        given = [name for name, on in (("reshard_after_forward", self.shard.reshard_after_forward is not True),
                                       ("cpu_offload", self.shard.offload_policy is not None)) if on]
        if given:
            raise ValueError(
                f"FSDP2Strategy(device_mesh='auto', {', '.join(f'{n}=...' for n in given)}): 'auto' chooses the"
                " layout and reshard_after_forward from the device memory the run needs, with everything on the"
                f" device. Drop {' and '.join(given)}, or give the layout yourself (device_mesh=None or (replicate,"
                " shard))."
            )

    def check_device(self, device: torch.device) -> None:
        """Raise, on every rank alike, for options that cannot work on this device (checked first)."""
        self.shard.check_device(device)
        self.offload_activations.check(device)

    def check_layout(self, layout: Layout) -> None:
        """Raise, on every rank alike, for options that cannot work with this layout."""
        self.shard.check_layout(layout)
        check_tensor_parallel_options(
            layout, plan=self.tensor_parallel.plan, compiled=self.compile.kwargs is not None,
            checkpointed=self.checkpointing.policy is not None, selective=self.checkpointing.save is not None,
            offloaded=self.shard.offload_policy is not None,
        )


def _int_at_least(n: Any, low: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= low


def _kind(value: Any, kinds: type | tuple[type, ...]) -> type[Exception]:
    """The error for a refused ``value``: ``ValueError`` when it is of the type the option takes (a bad value),
    ``TypeError`` when it is not (``bool`` is not taken for a number). Every option follows this rule."""
    right = isinstance(value, kinds) and not isinstance(value, bool)
    return ValueError if right else TypeError


def _check_type(name: str, value: Any, kinds: tuple[type, ...], what: str) -> None:
    """``TypeError`` unless ``value`` is one of ``kinds`` (``bool`` only where listed: ``True`` is an int)."""
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise TypeError(f"FSDP2Strategy({name}={value!r}): {what}")


def _check_flag(name: str, flag: Any) -> None:
    if not isinstance(flag, bool):
        raise TypeError(f"FSDP2Strategy({name}={flag!r}): pass True or False.")
