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
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from lightning_fsdp2.auto_layout import BatchShape, check_memory_budget
from lightning_fsdp2.blocks import SavePolicy, check_compile_options, check_save_policy
from lightning_fsdp2.layout import Layout, MeshOption, check_mesh_option, check_tensor_parallel_size
from lightning_fsdp2.tensor_parallel import TensorParallelPlan, check_plan_option, check_tensor_parallel_options
from lightning_fsdp2.wrap import ModulePolicy

StateDictType = Literal["full", "sharded"]
"""How checkpoints are saved: one file from rank 0, or a directory of every rank's shards."""


@dataclass(frozen=True)
class LayoutOptions:
    """How the processes are arranged (``device_mesh``, ``tensor_parallel_size``); resolved into a
    :class:`~lightning_fsdp2.layout.Layout` once the world size is known, or, with ``device_mesh="auto"``, chosen
    once the model exists from the memory it needs (``memory_budget``, ``batch_shape``: ``auto_layout.py``)."""

    device_mesh: MeshOption | Literal["auto"] = None
    tensor_parallel_size: int = 1
    memory_budget: int | None = None
    batch_shape: BatchShape | None = None

    @classmethod
    def from_arguments(
        cls,
        *,
        device_mesh: MeshOption | Literal["auto"] = None,
        tensor_parallel_size: int = 1,
        memory_budget: int | str | None = None,
        batch_shape: BatchShape | None = None,
    ) -> LayoutOptions:
        auto = isinstance(device_mesh, str) and device_mesh == "auto"
        mesh = "auto" if auto else check_mesh_option(device_mesh)
        size = check_tensor_parallel_size(tensor_parallel_size)
        budget = check_memory_budget(memory_budget)
        if batch_shape is not None and not (
            isinstance(batch_shape, (tuple, list)) and len(batch_shape) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in batch_shape)
        ):
            raise (ValueError if isinstance(batch_shape, (tuple, list)) else TypeError)(
                f"FSDP2Strategy(batch_shape={batch_shape!r}): (sequences, tokens) of one rank's micro-batch, two"
                " positive ints, which device_mesh='auto' estimates the activations for."
            )
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
        return cls(mesh, size, budget, tuple(batch_shape) if batch_shape is not None else None)  # type: ignore[arg-type]

    @property
    def auto(self) -> bool:
        """The layout is chosen from the memory the run needs, once the model exists."""
        return self.device_mesh == "auto"

    def resolve(self, world_size: int, devices_per_node: int, device_type: str) -> Layout:
        assert not self.auto
        return Layout.resolve(self.device_mesh, world_size, devices_per_node, device_type,  # type: ignore[arg-type]
                              self.tensor_parallel_size)


@dataclass(frozen=True)
class TensorParallelOptions:
    """Which layers tensor parallelism splits, and how (``tensor_parallel_plan``; ``None``: the model's own plan)."""

    plan: TensorParallelPlan = None

    @classmethod
    def from_arguments(cls, *, tensor_parallel_plan: TensorParallelPlan = None) -> TensorParallelOptions:
        return cls(check_plan_option(tensor_parallel_plan))


@dataclass(frozen=True)
class ShardOptions:
    """What ``fully_shard`` is given: the groups, a precision policy overriding the plugin's, resharding after
    forward, and where the sharded parameters live (``cpu_offload``)."""

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
            raise ValueError(
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

    forward: int = 0
    backward: int = 1
    reshard_last_block: bool = True

    @classmethod
    def from_arguments(
        cls, *, forward_prefetch: int = 0, backward_prefetch: int = 1, reshard_last_block: bool = True
    ) -> PrefetchOptions:
        if not (_int_at_least(forward_prefetch, 0) and _int_at_least(backward_prefetch, 1)):
            raise ValueError(
                f"FSDP2Strategy(forward_prefetch={forward_prefetch!r}, backward_prefetch={backward_prefetch!r}): how many"
                " blocks ahead to start all-gathering, an int >= 0 in forward and >= 1 in backward (0 and 1 are FSDP2's"
                " own schedule)."
            )
        _check_flag("reshard_last_block", reshard_last_block)
        return cls(forward_prefetch, backward_prefetch, reshard_last_block)


@dataclass(frozen=True)
class ActivationOffloadOptions:
    """Activations saved for backward kept in pinned CPU memory between forward and backward (CUDA only)."""

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

    timeout: float | None = 60.0

    @classmethod
    def from_arguments(cls, *, unmatched_forward_timeout: float | None = 60.0) -> ForwardCheckOptions:
        timeout = unmatched_forward_timeout
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise ValueError(
                f"FSDP2Strategy(unmatched_forward_timeout={timeout!r}): seconds (> 0) a forward outside"
                " training waits for every rank to run it too, or None to turn the check off."
            )
        return cls(timeout)


@dataclass(frozen=True)
class PeerWatchOptions:
    """Seconds a rank waits in a collective for a peer, from the second training step on (``None``: the process
    group's ``timeout`` throughout, and no report of the peers' states)."""

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

    meta_init: bool = True

    @classmethod
    def from_arguments(cls, *, meta_init: bool = True) -> InitOptions:
        return cls(meta_init)


@dataclass(frozen=True)
class ProcessGroupOptions:
    """The default process group: its backend (``None``: from the device) and its collectives' timeout."""

    backend: str | None = None
    timeout: timedelta | None = default_pg_timeout

    @classmethod
    def from_arguments(
        cls, *, process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout
    ) -> ProcessGroupOptions:
        return cls(process_group_backend, timeout)


@dataclass(frozen=True)
class SaveOptions:
    """Checkpoints: one file or every rank's shards, trainable parameters only, written in the background; their
    checksums verified before a load."""

    state_dict_type: StateDictType = "full"
    save_trainable_only: bool = False
    async_save: bool = False
    verify_checkpoints: bool = True

    @classmethod
    def from_arguments(
        cls, *, state_dict_type: StateDictType = "full", save_trainable_only: bool = False, async_save: bool = False,
        verify_checkpoints: bool = True,
    ) -> SaveOptions:
        _check_flag("verify_checkpoints", verify_checkpoints)
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")
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


def _check_flag(name: str, flag: Any) -> None:
    if not isinstance(flag, bool):
        raise TypeError(f"FSDP2Strategy({name}={flag!r}): pass True or False.")
