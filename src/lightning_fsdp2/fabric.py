"""``FSDP2Strategy`` for Lightning Fabric: the same sharding, initialization and checkpoints as the Trainer's strategy.

``Fabric(strategy=FSDP2Strategy(), precision="bf16-true")`` (or ``strategy="fsdp2"`` after ``import lightning_fsdp2``)
shards the model given to ``fabric.setup_module`` (or ``fabric.setup``). Build it under ``fabric.init_module()``: its
parameters are then created on ``meta`` and each rank allocates only its shard, as the Trainer strategy does for
``configure_model``; ``load_pretrained`` called there reads each rank's slices after sharding. Both strategies run
the same code (:mod:`lightning_fsdp2.parallel`, :mod:`lightning_fsdp2.checkpoint`); this module only adapts it to
Fabric's hooks.

Checkpoints (``fabric.save``/``fabric.load``) hold what a single-device Fabric run holds: an entry per module (its
state dict, clean names) and per optimizer (``torch.optim``'s index-keyed form in a full file), the other objects as
they are. ``state_dict_type="full"`` writes one file, gathered tensor by tensor to rank 0, which a one-device
``Fabric`` reads with ``fabric.load`` and ``load_pretrained`` reads into a Trainer's model; ``"sharded"`` writes a
``torch.distributed.checkpoint`` directory, every rank its shards. Both load at any world size.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _apply_filter, _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH, ReduceOp, _Stateful
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.optim import Optimizer

from lightning_fsdp2._frontend import FrontEndCore, precision_property
from lightning_fsdp2.blocks import SavePolicy
from lightning_fsdp2.checkpoint import formats, integrity
from lightning_fsdp2.checkpoint.safe_dcp import check_sharded_files
from lightning_fsdp2.checkpoint.files import (
    FORMAT_KEY,
    CheckpointFileError,
    is_sharded_checkpoint,
    load_torch_file,
)
from lightning_fsdp2.checkpoint.module_load import install_optimizer_load_hook
from lightning_fsdp2.checkpoint.plan import tied_aliases
from lightning_fsdp2.checkpoint.pretrained import load_pretrained
from lightning_fsdp2.lockstep import watched
from lightning_fsdp2.options import StateDictType, StrategyOptions
from lightning_fsdp2.parallel import Parallelized, check_not_rebuilt, no_gradient_sync, reshard, untrainable_reason
from lightning_fsdp2.precision import FabricFSDP2Precision as FSDP2Precision
from lightning_fsdp2.precision import clip_grad_norm_
from lightning_fsdp2.router_loss import RouterAuxLoss
from lightning_fsdp2.tensor_parallel import TensorParallelPlan
from lightning_fsdp2.wrap import ModulePolicy, root_names

__all__ = ["FSDP2Precision", "FSDP2Strategy"]


class FSDP2Strategy(FrontEndCore, ParallelStrategy):
    """Fully Sharded Data Parallel with FSDP2 (``fully_shard``) for Lightning Fabric.

    Takes the sharding and checkpoint arguments of the Trainer's :class:`lightning_fsdp2.FSDP2Strategy`, with the
    same meaning: ``auto_wrap_policy``, ``activation_checkpointing_policy``, ``activation_checkpointing_every``,
    ``activation_checkpointing_save``, ``mixed_precision``, ``reshard_after_forward``, ``cpu_offload``,
    ``device_mesh`` (``"auto"`` too), ``memory_budget``, ``batch_shape``, ``tensor_parallel_size``, ``tensor_parallel_plan``,
    ``expert_parallel_size``, ``router_aux_loss``, ``context_parallel_size``, ``compile``, ``forward_prefetch``,
    ``backward_prefetch``, ``reshard_last_block``,
    ``offload_activations``, ``unmatched_forward_timeout``, ``peer_timeout`` (from the second ``fabric.backward``
    on; the phases seen are the model's forward, ``backward``, the optimizer step, saving and loading), ``meta_init`` (what ``fabric.init_module()`` does when
    ``empty_init`` is not given), ``process_group_backend``, ``timeout``, ``state_dict_type``,
    ``save_trainable_only`` and ``verify_checkpoints`` (``fabric.load`` and ``fabric.load_raw``). Not here: ``start_method`` (Fabric starts processes by re-running the script, or
    runs under torchrun/SLURM) and ``async_save``.

    Use::

        fabric = L.Fabric(devices=2, strategy=FSDP2Strategy(), precision="bf16-true")
        fabric.launch()
        with fabric.init_module():  # parameters on meta: nothing allocated yet
            model = AutoModelForCausalLM.from_config(config)
            load_pretrained(model, "path/to/hf-model")  # read after sharding, each rank its slices
            model = get_peft_model(model, LoraConfig(...))
        model = fabric.setup_module(model)  # sharded, materialized, loaded
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    """

    def __init__(
        self,
        *,
        auto_wrap_policy: ModulePolicy | None = None,
        activation_checkpointing_policy: ModulePolicy | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool | int = True,
        cpu_offload: bool | CPUOffloadPolicy = False,
        device_mesh: tuple[int, int] | tuple[int, int, int] | Mapping[str, int] | DeviceMesh | Literal["auto"] | None = None,
        memory_budget: int | str | None = None,
        batch_shape: tuple[int, int] | None = None,
        tensor_parallel_size: int = 1,
        tensor_parallel_plan: TensorParallelPlan = None,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        router_aux_loss: RouterAuxLoss = "per_rank",
        activation_checkpointing_every: int = 1,
        activation_checkpointing_save: SavePolicy | None = None,
        compile: bool | dict[str, Any] = False,
        forward_prefetch: int = 0,
        backward_prefetch: int = 1,
        reshard_last_block: bool = True,
        offload_activations: bool = False,
        unmatched_forward_timeout: float | None = 60.0,
        peer_timeout: float | None = 300.0,
        meta_init: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        state_dict_type: StateDictType = "full",
        save_trainable_only: bool = False,
        verify_checkpoints: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._set_options(StrategyOptions.from_arguments(**StrategyOptions.pick(locals())))  # forwarded in one place
        self._num_nodes = 1
        # The modules set up here, and what parallelize did to each (the names it initialized at random).
        self._parallelized: weakref.WeakKeyDictionary[nn.Module, Parallelized] = weakref.WeakKeyDictionary()
        self._originals: weakref.WeakKeyDictionary[nn.Module, list[tuple[weakref.ref, str]]] = (
            weakref.WeakKeyDictionary()
        )
        self._backward_sync_control = _NoGradientSync()

    def __repr__(self) -> str:
        # Lightning's "invalid strategy" message shows this when the object reaches the Trainer: say which it takes.
        return ("lightning_fsdp2.fabric.FSDP2Strategy(...) (Lightning Fabric's strategy; for the Trainer use"
                " lightning_fsdp2.FSDP2Strategy)")

    # ---------------------------------------------------------------- Fabric plumbing: processes and devices
    _precision_class = FSDP2Precision
    _strategy_name = "lightning_fsdp2.fabric.FSDP2Strategy"
    _front_end = "Fabric"
    precision = precision_property(  # type: ignore[assignment]
        "_precision", "The :class:`FSDP2Precision` in use (Fabric's stock plugins are converted on assignment)."
    )

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Checkpoints are written by the strategy itself (streamed, atomic); a ``CheckpointIO`` plugin is not used."""
        return TorchCheckpointIO()

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if io is not None:
            raise ValueError(
                f"lightning_fsdp2.fabric.FSDP2Strategy writes its checkpoints itself and does not use a CheckpointIO"
                f" plugin ({type(io).__name__}). Remove it from `Fabric(plugins=...)`."
            )

    @property
    def num_nodes(self) -> int:
        """Nodes (machines) in the run."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        """Start the process group and build the device mesh (``fabric.launch()`` calls this on every rank)."""
        self._start_processes()
        self.precision.peer_watch = self._peer_watch  # Fabric's forwards run in the plugin's forward_context

    # ---------------------------------------------------------------- the model's road
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module()``: parameters on ``meta`` (``empty_init`` not ``False`` and ``meta_init``), buffers
        built for real, the storage dtype set, and ``load_pretrained`` deferred to :meth:`setup_module`. With
        ``empty_init=False`` (or ``meta_init=False``) the model is built for real on the CPU and sharded afterwards."""
        return self._init_context(empty_init, self.precision.module_init_context())

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place and give each rank's shards their values (initialization by the model's own
        rules, then the ``load_pretrained`` calls made under ``fabric.init_module()``); see
        :func:`lightning_fsdp2.parallel.parallelize`. A ``LightningModule`` is sharded as the Trainer strategy shards
        it (its children are the roots, so its ``training_step`` can call them); any other module is itself the
        root, since the loop calls it."""
        if module in self._parallelized:
            check_not_rebuilt(module)
            return module
        from lightning.pytorch import LightningModule

        reason = untrainable_reason(module)  # Fabric cannot tell whether it will be trained: say it, once
        if reason is not None:
            rank_zero_warn(reason)
        # An optimizer made over these before set-up is re-pointed at the shards in `setup_optimizer`.
        self._originals[module] = [(weakref.ref(p), n) for n, p in module.named_parameters(remove_duplicate=False)]
        # Fabric does not say whether the model will be trained: it will if anything in it is trainable.
        self._parallelized[module] = self._parallelize(
            module, self.precision, training=any(p.requires_grad for p in module.parameters()),
            module_is_root=not isinstance(module, LightningModule),
        )
        if isinstance(module, LightningModule):
            # Fabric converts the inputs of a LightningModule's `training_step` (to bf16 under "bf16-true") only
            # through a wrapper module, and an in-place sharded module has none: its roots convert them instead.
            for name in root_names(module):
                module.get_submodule(name).register_forward_pre_hook(self._convert_inputs, with_kwargs=True)
        return module

    def _convert_inputs(self, _module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return self.precision.convert_input((args, kwargs))

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers``: the optimizer's parameters must be those of a model set up here. Made over
        the model before ``setup_module`` (its ``meta`` or unsharded parameters), or after an evaluation left the
        root's parameters unsharded, it is pointed at the sharded parameters by name (if it has not stepped yet)."""
        where: dict[int, tuple[nn.Module, str]] = {}
        for module in self._parallelized:
            for ref, name in self._originals.get(module, []):
                original = ref()
                if original is not None:
                    where[id(original)] = (module, name)
            where.update({id(p): (module, n) for n, p in module.named_parameters(remove_duplicate=False)})
            reshard(module)
        current = {(m, n): p for m in self._parallelized for n, p in m.named_parameters(remove_duplicate=False)}
        groups = [[current[where[id(p)]] if id(p) in where else None for p in g["params"]] for g in optimizer.param_groups]
        foreign = sum(p is None for group in groups for p in group)
        moved = any(q is not p for g, group in zip(optimizer.param_groups, groups) for p, q in zip(g["params"], group))
        if foreign:
            raise ValueError(
                f"The {type(optimizer).__name__} holds {foreign} parameter(s) of no model set up with FSDP2Strategy."
                " Set the model up first (`model = fabric.setup_module(model)`, or `fabric.setup(model, optimizer)`)"
                " and make the optimizer over its parameters."
            )
        if moved and optimizer.state:
            raise ValueError(
                "FSDP2Strategy re-points the optimizer at the sharded parameters, which needs an optimizer that has not"
                f" stepped yet ({type(optimizer).__name__} has state). Set the model up first and make the optimizer"
                " afterwards: `model = fabric.setup_module(model)`, then"
                " `optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`."
            )
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params
        install_optimizer_load_hook(optimizer)  # optimizer.load_state_dict of a one-device run's state
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing to do: ``fully_shard`` and materialization place every shard on its device."""

    # ---------------------------------------------------------------- gradients
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm of the *whole* gradient (all ranks' shards), without a host sync unless
        ``error_if_nonfinite`` asks to check the norm."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(
            self.precision.main_params(optimizer), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """``fabric.backward`` (the gradients' reduce-scatters run in it), as a phase other ranks can see."""
        with self._peer_watch.phase("backward"):
            super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer's step, as a phase other ranks can see."""
        with self._peer_watch.phase("optimizer_step"):
            return super().optimizer_step(optimizer, **kwargs)

    def teardown(self) -> None:
        """Tell the other ranks this one is done; then Lightning's teardown."""
        self._peer_watch.stop("finished (its run ended)")
        super().teardown()

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """Reduce a tensor over all processes (mean by default)."""
        return self._reduce(tensor, group, reduce_op)

    # ---------------------------------------------------------------- checkpoints
    @watched
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, nn.Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save``: modules and optimizers as shards, written as one file streamed by rank 0 (``"full"``) or a
        directory from every rank (``"sharded"``), atomically, to rank 0's ``path`` (under Ray Train, each rank's
        shards to its own); call on every rank."""
        if storage_options is not None:
            raise TypeError("lightning_fsdp2.fabric.FSDP2Strategy does not take `storage_options`: it uses no CheckpointIO.")
        checkpoint: dict[str, Any] = {}
        tied: dict[str, Mapping[str, str]] = {}
        trainable_only = self._trainable_only(*(self._parallelized.get(obj) for obj in state.values()
                                                if isinstance(obj, nn.Module)))
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                value = formats.model_state(obj, trainable_only=trainable_only)
                tied[key] = tied_aliases(obj, value)
            elif isinstance(obj, Optimizer):
                value = formats.optimizer_state(self._owner(obj, state), obj, sharded=self._sharded)
            elif isinstance(obj, _Stateful):
                value = obj.state_dict()
            else:
                value = obj
            _apply_filter(key, filter or {}, value, checkpoint)
        target, _ = self._checkpoint_target(path, self._sharded)  # Fabric's sharded saves are synchronous
        formats.save(
            checkpoint,
            target,
            sharded=self._sharded,
            trainable_only=trainable_only,
            world_size=self.world_size,
            checkpoint_io=self.checkpoint_io,
            tied=tied,
        )
        self.barrier()

    @watched
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """``fabric.load``: restore the modules, optimizers and objects in ``state`` from a checkpoint of either format,
        at any world size (each rank reads its slices); return what ``state`` did not ask for. ``fabric.load_raw``
        (a module or optimizer as ``state``) reads a plain state dict instead (see :meth:`load_raw`)."""
        path = self.broadcast(str(path))
        if isinstance(state, (nn.Module, Optimizer)):
            self.load_raw(path, state, strict=strict, weights_only=weights_only)
            return {}
        checkpoint = formats.load(path, weights_only=weights_only, checkpoint_io=self.checkpoint_io,
                                  verify=self._options.save.verify_checkpoints)
        if state is None:
            if checkpoint.sharded:
                raise ValueError(
                    f"{path} is a sharded checkpoint: its tensors are read into the objects they belong to. Pass them:"
                    " `fabric.load(path, {'model': model, 'optimizer': optimizer, ...})`, or convert it to one file"
                    " with `lightning-fsdp2-convert`."
                )
            return dict(checkpoint)
        saved = set(checkpoint) | set(checkpoint.get(FORMAT_KEY, {}).get("entries", []))
        missing = [key for key in state if key not in saved]
        if missing and strict:
            raise KeyError(
                f"The checkpoint {path} has no {missing} (it holds {sorted(k for k in saved if k != FORMAT_KEY)})."
                " Load with `strict=False` to restore only what it holds."
            )
        for key, obj in state.items():
            if key in missing:
                continue
            if isinstance(obj, nn.Module):
                initialized = self._parallelized[obj].initialized if obj in self._parallelized else frozenset()
                formats.load_entry(obj, checkpoint, key, strict=strict, initialized=initialized)
            elif isinstance(obj, Optimizer):
                formats.load_optimizer_entry(self._owner(obj, state), obj, checkpoint, key)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint[key])
            else:
                state[key] = checkpoint[key]
        return {k: v for k, v in checkpoint.items() if k not in state and k != FORMAT_KEY}

    def load_raw(
        self, path: _PATH, obj: nn.Module | Optimizer, strict: bool = True, weights_only: bool | None = None
    ) -> None:
        """``fabric.load_raw``: a module's weights from anything :func:`~lightning_fsdp2.load_pretrained` reads (a state
        dict file, a Hugging Face directory, a Lightning or Fabric checkpoint) or from a sharded checkpoint directory
        holding them under one entry, each rank its slices; or an optimizer's state from a file holding
        ``optimizer.state_dict()`` (index-keyed)."""
        path = self.broadcast(str(path))
        if self._options.save.verify_checkpoints:  # a checkpoint of ours (or any torch.save file): its checksums
            integrity.verify(path, together=True)
        if isinstance(obj, nn.Module) and is_sharded_checkpoint(path):
            formats.load_sharded_model(obj, Path(path), strict=strict, key=_entry_of(obj, Path(path)))
            return
        if isinstance(obj, nn.Module):
            load_pretrained(obj, path, strict=strict)  # the model is real (sharded) here: loaded at once
            return
        owners = [m for m in self._parallelized if _holds(m, obj)]
        if not owners:
            raise ValueError("Set up the model whose parameters the optimizer holds before loading the optimizer's state.")
        formats.load_full_optimizer(owners[0], obj, load_torch_file(path, weights_only=weights_only is not False))

    def _owner(self, optimizer: Optimizer, state: Mapping[str, Any]) -> nn.Module:
        """The set-up module whose parameters ``optimizer`` holds (in ``state``, else any set up here)."""
        candidates = [m for m in state.values() if isinstance(m, nn.Module)] + list(self._parallelized)
        for module in candidates:
            if _holds(module, optimizer):
                return module
        raise CheckpointFileError(
            f"The {type(optimizer).__name__} in the checkpoint's state holds parameters of no model set up with"
            " FSDP2Strategy. Put the model in the state too (`{'model': model, 'optimizer': optimizer}`), set up with"
            " `fabric.setup_module(model)` before the optimizer is made."
        )


def _entry_of(module: nn.Module, path: Path) -> str:
    """The entry of a sharded checkpoint that holds ``module``'s tensors (``"model"`` in a Fabric one)."""
    saved = list(check_sharded_files(path).state_dict_metadata)
    names = [n for n, _ in module.named_parameters()]
    entries = sorted({key.split(".", 1)[0] for key in saved})
    fitting = [e for e in entries if any(f"{e}.{n}" in saved for n in names)]
    if len(fitting) != 1:
        raise CheckpointFileError(
            f"The sharded checkpoint {path} holds {entries}, and {'none' if not fitting else 'several'} of them has"
            f" {type(module).__name__}'s parameter names. Load it with `fabric.load(path, {{'model': model, ...}})`"
            " under the names it was saved with."
        )
    return fitting[0]


def _holds(module: nn.Module, optimizer: Optimizer) -> bool:
    params = {id(p) for p in module.parameters()}
    return any(id(p) in params for group in optimizer.param_groups for p in group["params"])


class _NoGradientSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: micro-batches that only accumulate skip the gradient reduce-scatter."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        return no_gradient_sync(module, enabled)


# Each option described once, where it is declared (options.py); the docstring shows them all (Fabric has no
# background saves).
FSDP2Strategy.__doc__ = (FSDP2Strategy.__doc__ or "").rstrip() + "\n" + StrategyOptions.args_section(
    leave_out=("async_save",))
