"""Weight averaging of a sharded model: Lightning's ``WeightAveraging``, ``EMAWeightAveraging`` and SWA callbacks, with
the averaged copy sharded like the model.

Lightning's callbacks deep-copy the whole ``LightningModule`` into a ``torch.optim.swa_utils.AveragedModel``. FSDP2
refuses to deep-copy a sharded module, and a copy made before sharding would be whole on every rank. Here the copy
is made after sharding, of the tensors only: each parameter (and buffer) is cloned as it is, a ``DTensor`` holding
this rank's shard, into a plain module of the same structure and names. torch's own ``AveragedModel`` code then
averages shard by shard (its updates are elementwise), with no communication, and Lightning's own callback logic
(when to update, the swap around validation, the copy at the end of ``fit``, what a checkpoint holds) runs
unchanged. The checkpoint formats of :class:`~lightning_fsdp2.FSDP2Strategy` write the averaged and current weights
in either format, and a resume at any world size restores both.

Lightning's own callbacks (``lightning.pytorch.callbacks.WeightAveraging``, ``EMAWeightAveraging``,
``StochasticWeightAveraging``, and a user's subclass of them) need nothing from here: ``FSDP2Strategy`` gives each
one this behaviour at the start of a run (:func:`adopt`), keeping its arguments and overrides (``should_update``).
The classes below are the same callbacks, adopted from the start.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging as _LightningEMA
from lightning.pytorch.callbacks import StochasticWeightAveraging as _LightningSWA
from lightning.pytorch.callbacks import WeightAveraging as _LightningWeightAveraging
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim.swa_utils import AveragedModel

from lightning_fsdp2.checkpoint.formats import has_entry, load_entry

__all__ = ["EMAWeightAveraging", "StochasticWeightAveraging", "WeightAveraging", "adopt"]


class _ShardedAveraging:
    """What changes in Lightning's callbacks for a sharded model: how the averaged copy is made, that the model's
    parameters are resharded before values are copied between the two, and how a checkpoint is read back."""

    _average_model: AveragedModel | None
    _kwargs: dict[str, Any]
    _use_buffers: bool

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Nothing yet: the model is built and sharded after this hook (see :meth:`on_fit_start`)."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Make the averaged copy of the sharded model: its tensors cloned, shard by shard."""
        _reshard(pl_module)
        self._average_model = _ShardedAveragedModel(pl_module, use_buffers=self._use_buffers, **self._kwargs)
        super().on_fit_start(trainer, pl_module)  # type: ignore[misc]  # a subclass's own hook, if any

    def _swap_models(self, pl_module: LightningModule) -> None:
        _reshard(pl_module)  # after a forward the root's parameters may be gathered; values live in the shards
        super()._swap_models(pl_module)  # type: ignore[misc]

    def _copy_average_to_current(self, pl_module: LightningModule) -> None:
        _reshard(pl_module)
        super()._copy_average_to_current(pl_module)  # type: ignore[misc]

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Restore both models. The strategy has already loaded ``state_dict`` (the averaged weights, as Lightning's
        callback saves them) into the model: the averaged copy takes them from there, and the model its own weights
        from ``current_model_state`` (either checkpoint format, each rank its slices)."""
        if self._average_model is None:
            rank_zero_warn(
                f"{type(self).__name__}: a checkpoint was loaded outside `fit`; the averaging state is not restored."
            )
            return
        _reshard(pl_module)
        with torch.no_grad():
            for averaged, current in zip(_tensors(self._average_model.module), _tensors(pl_module), strict=True):
                averaged.copy_(current)
        if has_entry(checkpoint, "current_model_state"):
            load_entry(pl_module, checkpoint, "current_model_state")
            state = checkpoint.get("averaging_state", {})
            if "n_averaged" in state:
                self._average_model.n_averaged.copy_(state["n_averaged"])
        else:
            rank_zero_warn(
                "The checkpoint was not written with weight averaging: the averaged copy starts from its weights."
            )


class WeightAveraging(_ShardedAveraging, _LightningWeightAveraging):
    """Lightning's ``WeightAveraging`` for a model sharded by ``FSDP2Strategy``: the same arguments (``device`` must
    stay unset; ``avg_fn``/``multi_avg_fn`` and the rest go to torch's ``AveragedModel``) and the same
    ``should_update`` to override."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _check_device(self, self._device)


class EMAWeightAveraging(_ShardedAveraging, _LightningEMA):
    """Lightning's ``EMAWeightAveraging`` (``decay``, ``update_every_n_steps``, ``update_starting_at_step``,
    ``update_starting_at_epoch``) for a model sharded by ``FSDP2Strategy``; ``device`` must stay unset. Unlike
    Lightning's, it can be pickled (``start_method="spawn"``)."""

    def __init__(self, *args: Any, decay: float = 0.999, **kwargs: Any) -> None:
        super().__init__(*args, decay=decay, **kwargs)
        _check_device(self, self._device)
        self._kwargs["avg_fn"] = _EMA(decay)  # torch's, behind a picklable object (torch's is a local closure)


class _EMA:
    """torch's ``get_ema_avg_fn(decay)``, made when called, so that the callback pickles."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    def __call__(self, averaged: torch.Tensor, current: torch.Tensor, num_averaged: Any) -> torch.Tensor:
        from torch.optim.swa_utils import get_ema_avg_fn

        return get_ema_avg_fn(self.decay)(averaged, current, num_averaged)


class _ShardedSWA:
    """What changes in Lightning's ``StochasticWeightAveraging`` for a sharded model: the running average is a clone of
    each rank's shards, made at ``on_fit_start``; the model's parameters are resharded before values are copied; the
    average is saved with the checkpoint as a state dict of its own (``swa_average_model_state``, sharded or gathered
    like the model) rather than inside the callback's state.

    Lightning's callback restores its learning-rate scheduler on the assumption that the checkpoint is loaded before
    the model is set up, which is not so with FSDP2: here the schedulers are cleared when the callback's state is
    loaded, so that the SWA scheduler's saved state is the one restored.
    """

    _average_model: Any
    _trainer: Trainer | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Nothing yet: the model is built and sharded after this hook (see :meth:`on_fit_start`)."""

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        _reshard(pl_module)
        self._average_model = _mirror(pl_module)
        self._trainer = trainer
        super().on_fit_start(trainer, pl_module)  # type: ignore[misc]

    def update_parameters(self, average_model: Any, model: LightningModule, n_averaged: Any, avg_fn: Any) -> None:
        _reshard(model)
        _LightningSWA.update_parameters(average_model, model, n_averaged, avg_fn)

    def transfer_weights(self, src_pl_module: Any, dst_pl_module: Any) -> None:
        _reshard(dst_pl_module)
        _LightningSWA.transfer_weights(src_pl_module, dst_pl_module)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # type: ignore[misc]
        state["average_model_state"] = None  # in the checkpoint beside the model's (on_save_checkpoint)
        return state

    def _load_average_model_state(self, model_state: Any) -> None:
        """Loaded from ``swa_average_model_state`` by :meth:`on_load_checkpoint`, not from the callback's state."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        if self._scheduler_state is not None and self._trainer is not None:  # type: ignore[attr-defined]
            _LightningSWA._clear_schedulers(self._trainer)  # before the trainer restores the schedulers' state

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._average_model is not None:
            checkpoint["swa_average_model_state"] = self._average_model.state_dict()

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._average_model is not None and has_entry(checkpoint, "swa_average_model_state"):
            load_entry(self._average_model, checkpoint, "swa_average_model_state")


class StochasticWeightAveraging(_ShardedSWA, _LightningSWA):
    """Lightning's ``StochasticWeightAveraging`` (``swa_lrs``, ``swa_epoch_start``, ``annealing_epochs``,
    ``annealing_strategy``, ``avg_fn``) for a model sharded by ``FSDP2Strategy``: the running average is a clone of each
    rank's shards (``device`` must stay unset), and it is saved with the checkpoint as a state dict of its own
    (``swa_average_model_state``, sharded or gathered like the model) rather than inside the callback's state.
    Lightning's own class, given to the Trainer, gets the same behaviour."""

    def __init__(self, swa_lrs: float | list[float], *args: Any, device: Any = None, **kwargs: Any) -> None:
        _check_device(self, device)
        super().__init__(swa_lrs, *args, device=None, **kwargs)
        self._trainer = None


_ADOPTED: dict[type, type] = {}
_REPLACED = {
    _ShardedAveraging: ("setup", "on_load_checkpoint"),
    _ShardedSWA: ("setup", "update_parameters", "transfer_weights", "on_save_checkpoint", "on_load_checkpoint",
                  "_load_average_model_state"),
}


def adopt(callback: Any) -> bool:
    """Give one of Lightning's weight-averaging callbacks (``WeightAveraging``, ``EMAWeightAveraging``,
    ``StochasticWeightAveraging`` or a subclass of them, a user's included) the sharded behaviour of this module, in
    place: the instance's class becomes a subclass of its own class with the sharded mixin in front, so that its
    arguments, state and overrides (``should_update`` and the rest) still apply, but for overrides of the hooks the
    mixin runs in sharded form (``setup``, ``on_load_checkpoint`` and the like: named in a warning). ``FSDP2Strategy``
    calls it on the Trainer's callbacks at the start of each run. Returns whether ``callback`` was adopted now (``False`` for another
    callback or one already sharded).

    The averaged copy stays with the shards, on the model's device: a ``device`` given to the callback is ignored,
    with a warning (but for SWA's default, the CPU, which it ignores silently).
    """
    if isinstance(callback, (_ShardedAveraging, _ShardedSWA)):
        return False
    if isinstance(callback, _LightningWeightAveraging):
        mixin: type = _ShardedAveraging
    elif isinstance(callback, _LightningSWA):
        mixin = _ShardedSWA
    else:
        return False
    cls = type(callback)
    if cls not in _ADOPTED:
        # The same names as the user's class: Lightning keys the callback's state in a checkpoint by its
        # __qualname__, which thus stays that of the class the user gave.
        _ADOPTED[cls] = type(cls.__name__, (mixin, cls), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
            "__reduce_ex__": _reduce_adopted,
        })
    callback.__class__ = _ADOPTED[cls]
    # The mixin's hooks that do not call on to the user's class (the others, on_fit_start and the like, do).
    replaced = _REPLACED[mixin]
    users = [base for base in cls.__mro__ if base is not object
             and not base.__module__.startswith(("lightning.", "pytorch_lightning."))]
    bypassed = sorted({name for base in users for name in vars(base) if name in replaced})
    if bypassed:
        rank_zero_warn(
            f"{cls.__name__} overrides {', '.join(bypassed)}, which FSDP2Strategy runs in its sharded form instead (the"
            " averaged copy is made and restored shard by shard): those overrides are not called. Move that code to"
            " other hooks (`should_update`, `on_train_batch_end`, ...), which run as written."
        )
    device = getattr(callback, "_device", None)
    default = isinstance(callback, _LightningSWA) and device is not None and torch.device(device).type == "cpu"
    if device is not None and not default:
        rank_zero_warn(
            f"{cls.__name__}(device={device!r}) is ignored with FSDP2Strategy: the averaged copy is sharded like the"
            " model (1/N of it on each rank) and stays on the model's device."
        )
    callback._device = None
    if mixin is _ShardedSWA:
        callback._trainer = None
    return True


def _reduce_adopted(self: Any, protocol: int) -> tuple:
    """Pickle an adopted callback as its user's class (which pickle can find by name), adopted again when loaded."""
    return _unpickle_adopted, (type(self).__bases__[1], self.__dict__)


def _unpickle_adopted(cls: type, state: dict[str, Any]) -> Any:
    callback = cls.__new__(cls)
    callback.__dict__.update(state)
    adopt(callback)
    return callback


class _ShardedAveragedModel(AveragedModel):
    """torch's ``AveragedModel`` around a copy of the model's tensors only (no deep copy of the sharded module)."""

    def __init__(self, model: nn.Module, use_buffers: bool = False, avg_fn: Any = None, multi_avg_fn: Any = None):
        nn.Module.__init__(self)
        if avg_fn is not None and multi_avg_fn is not None:
            raise ValueError("Only one of avg_fn and multi_avg_fn should be provided.")
        self.module = _mirror(model)
        device = next(itertools.chain(model.parameters(), model.buffers())).device
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long, device=device))
        self.avg_fn, self.multi_avg_fn, self.use_buffers = avg_fn, multi_avg_fn, use_buffers

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("The averaged copy holds tensors only; the model runs with them after the swap.")


def _check_device(callback: Any, device: Any) -> None:
    if device is not None:
        raise ValueError(
            f"{type(callback).__name__}(device={device!r}): the averaged copy is sharded like the model and stays on"
            " its device. Leave `device` unset."
        )


def _mirror(model: nn.Module) -> nn.Module:
    """A plain module with ``model``'s structure and names holding clones of its tensors (``DTensor`` shards stay
    ``DTensor`` shards), registered in ``model``'s order, so that ``parameters()`` and ``buffers()`` pair up."""
    modules: dict[str, nn.Module] = {"": nn.Module()}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            parent, _, leaf = name.rpartition(".")
            modules[parent].add_module(leaf, nn.Module())
            modules[name] = modules[parent].get_submodule(leaf)
    with torch.no_grad():
        clones: dict[int, nn.Parameter] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            # A tied weight is one clone under each of its names, as it is one parameter under each in the model.
            if id(param) not in clones:
                clones[id(param)] = nn.Parameter(param.detach().clone(), requires_grad=False)
            owner, _, leaf = name.rpartition(".")
            modules[owner].register_parameter(leaf, clones[id(param)])
        for name, buffer in model.named_buffers():
            owner, _, leaf = name.rpartition(".")
            persistent = leaf not in model.get_submodule(owner)._non_persistent_buffers_set
            modules[owner].register_buffer(leaf, buffer.detach().clone(), persistent=persistent)
    return modules[""]


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t.data for t in itertools.chain(module.parameters(), module.buffers())]


def _reshard(module: nn.Module) -> None:
    """Put every FSDP2 group in ``module`` back to its sharded parameters (a no-op for groups already sharded)."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
