"""``FSDP2Strategy``: the Lightning strategy that runs a ``LightningModule`` sharded with FSDP2 ``fully_shard``.

This module holds the Trainer's plumbing only: its hooks, launcher and checkpoint entry points. The model's road
through ``setup`` is :func:`lightning_fsdp2.parallel.parallelize` (shared with Fabric's strategy, through
``_frontend.py``): ``configure_model`` runs under :meth:`FSDP2Strategy.tensor_init_context` (parameters on ``meta``,
storage dtype set), then ``setup`` converts, checkpoints, shards, materializes and loads the model, and Lightning's
``setup_optimizers`` makes the optimizers over the sharded ``DTensor`` parameters. Checkpoints are saved and loaded by
``checkpoint/formats.py``, in the format ``state_dict_type`` names.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.optim import Optimizer

from lightning_fsdp2 import averaging
from lightning_fsdp2._frontend import FrontEndCore, precision_property
from lightning_fsdp2.blocks import SavePolicy
from lightning_fsdp2.checkpoint import formats as ckpt
from lightning_fsdp2.checkpoint.files import remove as remove_checkpoint
from lightning_fsdp2.checkpoint.module_load import install_optimizer_load_hook
from lightning_fsdp2.checkpoint.plan import tied_aliases
from lightning_fsdp2.checkpoint.stream import sharded_entries
from lightning_fsdp2.lockstep import watched
from lightning_fsdp2.options import StateDictType, StrategyOptions
from lightning_fsdp2.parallel import Parallelized, check_not_rebuilt, no_gradient_sync
from lightning_fsdp2.precision import FSDP2Precision
from lightning_fsdp2.router_loss import RouterAuxLoss
from lightning_fsdp2.tensor_parallel import TensorParallelPlan
from lightning_fsdp2.wrap import ModulePolicy

if TYPE_CHECKING:
    import lightning.pytorch as pl

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
"""How Lightning starts the processes (``FSDP2Strategy(start_method=...)``): ``"popen"`` re-runs the script, the others
start them through ``torch.multiprocessing``."""


class FSDP2Strategy(FrontEndCore, ParallelStrategy):
    """Fully Sharded Data Parallel with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

    The user's ``LightningModule`` builds its network in ``configure_model``; the strategy builds it on ``meta``,
    shards it, and gives each rank real storage for its shard only. Nothing in user code calls ``fully_shard``.
    """

    strategy_name = "fsdp2"

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
        start_method: StartMethod = "popen",
        state_dict_type: StateDictType = "full",
        save_trainable_only: bool = False,
        async_save: bool = False,
        verify_checkpoints: bool = True,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be 'popen', 'spawn', 'fork' or 'forkserver', got {start_method!r}.")
        arguments = StrategyOptions.pick(locals())  # every option argument, forwarded in one place
        self._set_options(StrategyOptions.from_arguments(**arguments))
        if start_method in ("spawn", "forkserver"):
            _check_picklable(arguments, start_method)
        self._start_method = start_method
        self._background: ckpt.BackgroundWriter | None = None  # made in setup_environment (it makes a process group)
        self._failed = False  # an exception ended the run: teardown must not wait for the other ranks
        self._parallelized: Parallelized | None = None  # what parallelize did to the LightningModule
        self._parallelized_module: weakref.ref[nn.Module] | None = None  # ... and to which module
        self._torn_down = False
        self.num_nodes = 1

    def __repr__(self) -> str:
        # Lightning's "invalid strategy" message shows this when the object reaches Fabric: say which class Fabric takes.
        return ("lightning_fsdp2.FSDP2Strategy(...) (the Trainer's strategy; for Lightning Fabric use"
                " lightning_fsdp2.fabric.FSDP2Strategy)")

    # ---------------------------------------------------------------- Lightning plumbing: processes and devices
    _precision_class = FSDP2Precision
    _strategy_name = "FSDP2Strategy"
    _front_end = "Trainer"
    precision_plugin = precision_property(  # type: ignore[assignment]
        "_precision_plugin", "The :class:`FSDP2Precision` in use (Lightning's stock plugins are converted on assignment)."
    )

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to add a ``DistributedSampler`` and sync logged metrics (it only knows its own strategies)."""
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints are loaded into the sharded model, so after ``setup``."""
        return True

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _ShardedMultiProcessingLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        """Start the process group and build the device mesh."""
        self._adopt_averaging_callbacks()
        self._start_processes()
        if self._options.save.async_save and self._background is None:
            self._background = ckpt.BackgroundWriter()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # as ModelParallelStrategy: visible in configure_model

    def _adopt_averaging_callbacks(self) -> None:
        """Lightning's weight-averaging callbacks (``WeightAveraging``, ``EMAWeightAveraging``,
        ``StochasticWeightAveraging``, a user's subclass) would deep-copy the whole module, which FSDP2 refuses for a
        sharded one (and every rank would hold a whole copy): each is given the sharded behaviour of
        :mod:`lightning_fsdp2.averaging` in place, its arguments and overrides kept (see
        :func:`~lightning_fsdp2.averaging.adopt`), before any callback hook runs."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        for callback in getattr(trainer, "callbacks", []) or []:
            averaging.adopt(callback)

    # ---------------------------------------------------------------- the model's road
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where ``configure_model`` runs: parameters on ``meta`` (unless ``meta_init=False``), storage dtype set."""
        with self._init_context(empty_init, self.precision_plugin.tensor_init_context()):
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model built by ``configure_model``, then create the optimizers over the shards."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._failed = self._torn_down = False
        assert self.lightning_module is not None
        self.model = self.parallelize(self.lightning_module)
        # LightningModule.device is what users create tensors on; FSDP2 moved the storage itself.
        self.lightning_module._device = self.root_device
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:  # optimizer.load_state_dict of a one-device run's state
                install_optimizer_load_hook(getattr(optimizer, "_optimizer", optimizer))
        self.setup_precision_plugin()

    def parallelize(self, module: pl.LightningModule) -> pl.LightningModule:
        """Convert, checkpoint, shard, materialize and initialize ``module`` in place (see
        :func:`lightning_fsdp2.parallel.parallelize`); a no-op if already done."""
        # Lightning runs `configure_model` and `setup` again for every Trainer call (fit, then validate...).
        if self._parallelized_module is not None and self._parallelized_module() is module:
            check_not_rebuilt(module)
            return module
        trainer = getattr(module, "_trainer", None)
        training = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self._parallelized = self._parallelize(module, self.precision_plugin, training=training)
        self._parallelized_module = weakref.ref(module)
        module._device_mesh = self._device_mesh  # device_mesh="auto" built it just now
        return module

    def model_to_device(self) -> None:
        """Nothing to do: ``fully_shard`` and materialization placed every shard on its device."""

    # ---------------------------------------------------------------- steps
    # Usually the roots are the LightningModule's children (`self.model`), whose FSDP hooks fire when user code
    # calls them. Only when the LightningModule itself is the root (it holds parameters directly) must each step go
    # through its `__call__`, since Lightning calls `training_step`, not `forward`: the redirection does that.
    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        with self._peer_watch.phase(name), context:
            if isinstance(module, FSDPModule):
                return self._forward_redirection(module, module, name, *args, **kwargs)
            return getattr(module, name)(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``training_step``."""
        return self._step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``validation_step``."""
        return self._step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``test_step``."""
        return self._step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``predict_step``."""
        return self._step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward (the gradients' reduce-scatters run in it), as a phase other ranks can see."""
        with self._peer_watch.phase("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step (with automatic optimization the closure runs the training step in it)."""
        # With automatic optimization the step begins the batch: its closure runs the training step.
        with self._peer_watch.phase("optimizer_step", begins_batch=True):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient reduce-scatter on micro-batches that only accumulate (``accumulate_grad_batches``)."""
        with no_gradient_sync(self.lightning_module):
            yield

    # ---------------------------------------------------------------- collectives
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce a tensor over all processes (mean by default), e.g. for ``self.log(..., sync_dist=True)``."""
        return self._reduce(tensor, group, reduce_op)

    def on_exception(self, exception: BaseException) -> None:
        """After an error, teardown does not wait for a background save: the other ranks may never finish it; and the
        other ranks, should they wait for this one, learn why it stopped."""
        self._failed = True
        self._peer_watch.stop(f"stopped by {type(exception).__name__} ({str(exception).strip()[:100]}...)")

    def teardown(self) -> None:
        """Let a background save finish; release the cluster environment, checkpoint IO, precision plugin and
        accelerator."""
        if self._background is not None:
            if self._failed:
                self._background.forget()
            else:
                self.wait_for_checkpoint()
        self._torn_down = True
        self._peer_watch.stop("finished (its run ended)")
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.checkpoint_io.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---------------------------------------------------------------- checkpoints (checkpoint/formats.py)
    @watched
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state dict with clean names, as each rank's ``DTensor`` shards; a full save gathers them to
        rank 0 while it writes the file (so rank 0 never holds the whole model)."""
        assert self.model is not None
        return ckpt.model_state(self.model, trainable_only=self._trainable_only(self._parallelized))

    @watched
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state as shards: index-keyed as a single device writes it (``"full"``) or name-keyed."""
        assert self.model is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        return ckpt.optimizer_state(self.model, optimizer, sharded=self._sharded)

    @watched
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` atomically: one file streamed by rank 0 (``"full"``) or a directory from all ranks
        (``"sharded"``, in the background with ``async_save``). Every rank must call it (``trainer.save_checkpoint``
        does): the shards come from all of them, into rank 0's ``filepath`` (under Ray Train, each rank's into the
        ``filepath`` that rank was given: see docs/launching.md)."""
        assert self.model is not None
        self.wait_for_checkpoint()  # one save at a time: the previous one is complete (and in place) first
        trainable_only = self._trainable_only(self._parallelized)
        if trainable_only:  # also in what callbacks put there (weight averaging's two state dicts)
            frozen = {n for n, p in self.lightning_module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            for key in ("state_dict", *sharded_entries(checkpoint)):
                if isinstance(checkpoint.get(key), Mapping):
                    checkpoint[key] = {k: v for k, v in checkpoint[key].items() if k not in frozen}
        target, synchronous = self._checkpoint_target(filepath, self._sharded)
        ckpt.save(
            checkpoint,
            target,
            sharded=self._sharded,
            trainable_only=trainable_only,
            world_size=self.world_size,
            checkpoint_io=self.checkpoint_io,
            storage_options=storage_options,
            tied={"state_dict": tied_aliases(self.model, checkpoint.get("state_dict", {}))},
            background=self._background if self._trainer_running() and not synchronous else None,
        )
        self.barrier()

    def _trainer_running(self) -> bool:
        # Outside fit/validate (a `trainer.save_checkpoint` after `fit` returned, or in `on_fit_end`/`teardown` hooks,
        # which Lightning runs after the strategy's teardown) nothing would wait for a background save before the
        # script ends: save synchronously there.
        trainer = getattr(self.lightning_module, "_trainer", None)
        return not self._torn_down and trainer is not None and trainer.state.status == TrainerStatus.RUNNING

    def wait_for_checkpoint(self) -> None:
        """Wait until a checkpoint being written in the background (``async_save``) is complete and in place; raise
        on every rank if it failed. Call on every rank. Saving, loading and the end of ``fit`` call it for you."""
        if self._background is not None:
            self._background.wait()

    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Delete a checkpoint file or sharded directory (rank 0), e.g. one ``ModelCheckpoint`` no longer keeps.
        Anything at that path that is not a checkpoint is kept, with a warning."""
        in_flight = self._background.path if self._background is not None else None
        if in_flight is not None and in_flight.resolve() == Path(filepath).resolve():
            self._background.wait_here()  # still being written: let it land first (no collective: rank 0 alone may call)
        if not self.is_global_zero:
            return
        if type(self.checkpoint_io) is TorchCheckpointIO:
            remove_checkpoint(filepath)
        else:  # the user's plugin wrote it, in its own format: it knows how to remove it
            self.checkpoint_io.remove_checkpoint(filepath)

    @watched
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Read a checkpoint of either format (``weights_only=True`` unless you pass ``False``); its tensors stay
        on disk until :meth:`load_model_state_dict` and :meth:`load_optimizer_state_dict` copy them into shards."""
        self.wait_for_checkpoint()
        path = self.broadcast(str(checkpoint_path))
        return ckpt.load(path, weights_only=weights_only, checkpoint_io=self.checkpoint_io,
                         verify=self._options.save.verify_checkpoints)

    @watched
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the model's weights from a checkpoint of either format into the shards, at any world size."""
        assert self.model is not None
        initialized = self._parallelized.initialized if self._parallelized is not None else frozenset()
        ckpt.load_model(self.model, checkpoint, strict=strict, initialized=initialized)

    @watched
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load each optimizer's state into its sharded state, at any world size."""
        assert self.model is not None
        ckpt.load_optimizers(self.model, self.optimizers, checkpoint)


class _ShardedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, sending the trained weights back to the main process as it does for DDP.

    Under FSDP2 rank 0 holds only its shards, so after ``fit`` every rank takes part in gathering the full state to
    rank 0's CPU (DCP's ``get_model_state_dict``), which writes it to a temporary file. The main process loads it
    into its ``LightningModule``: as it is, when the model was built in ``__init__``; after running
    ``configure_model`` there (for real, on the CPU) when the model is built in that hook. If the file still does
    not fit, a warning says so, and where the weights are: the run's checkpoints.
    """

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        # Shut the process groups down, together, before the workers exit: left to the interpreter's exit, gloo's
        # threads were sometimes destroyed while running ("terminate called without an active exception", the worker
        # killed by SIGABRT and `fit` failing after it had finished). Only after a normal return: after an error a
        # rank may never reach the barrier.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # A collective: every rank sends its shards; only rank 0 keeps the (CPU) tensors.
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(trainer.lightning_module, options=options)
            if self._strategy.local_rank == 0:
                import tempfile

                weights_path = os.path.join(tempfile.mkdtemp(), "trained.pt")
                torch.save(state, weights_path)
            del state
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        path = worker_output.weights_path
        super()._recover_results_in_main_process(worker_output._replace(weights_path=None), trainer)
        if path is None:
            return
        try:
            _load_trained_in_main_process(trainer.lightning_module, torch.load(path, weights_only=True, mmap=True),
                                          self._strategy.precision_plugin)
        finally:
            import shutil

            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _load_trained_in_main_process(module: pl.LightningModule, state: dict[str, Any], precision: Precision) -> None:
    """The main process's module takes the trained weights: built in ``configure_model``, it is built here first."""
    if not set(state) <= set(module.state_dict()):
        try:
            with precision.module_init_context():
                module.configure_model()
        except Exception as error:  # noqa: BLE001 - reported below, with where the weights are
            rank_zero_warn(f"`configure_model` failed in the main process ({error}).")
    missing = sorted(set(state) - set(module.state_dict()))
    if missing:
        rank_zero_warn(
            f"The trained weights were not loaded into {type(module).__name__} in the main process: it has no"
            f" {missing[:3]}... after `configure_model`. They are in the run's checkpoints"
            " (trainer.save_checkpoint / ModelCheckpoint inside fit, or lora.save_adapter/save_merged)."
        )
        return
    module.load_state_dict(state, strict=False)


def _check_picklable(arguments: Mapping[str, Any], start_method: str) -> None:
    """``start_method="spawn"``/``"forkserver"`` pickle the strategy into each new process: refuse now, at
    construction, an option that cannot be pickled (ATen operator sets do not), rather than when ``fit`` starts."""
    import pickle

    for name, value in arguments.items():
        try:
            pickle.dumps(value)
        except Exception as err:  # noqa: BLE001 - pickle raises several types
            hint = ' Pass activation_checkpointing_save="matmuls" (matrix multiplications and attention kernels, chosen by name in each process).' if (
                name == "activation_checkpointing_save") else ""
            raise ValueError(
                f"FSDP2Strategy({name}={value!r}) cannot be pickled ({err}), and start_method={start_method!r}"
                f" pickles the strategy into each process it starts.{hint} Or use start_method='popen' (the default,"
                " which re-runs the script) or 'fork'."
            ) from None


_START_METHOD = (
    "how Lightning starts the processes: ``\"popen\"`` re-runs the script (default, as ``DDPStrategy``), or"
    " ``\"spawn\"``/``\"fork\"``/``\"forkserver\"`` through ``torch.multiprocessing``. With the latter the trained"
    " weights are gathered to rank 0 at the end of ``fit`` and loaded into the main process's module, as Lightning"
    " does for DDP (the main process then holds the whole model)."
)
# Each option described once, where it is declared (options.py); the docstring shows them all.
FSDP2Strategy.__doc__ = (FSDP2Strategy.__doc__ or "").rstrip() + "\n" + StrategyOptions.args_section(
    own={"start_method": _START_METHOD})
