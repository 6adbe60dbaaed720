"""Lightning precision plugin for FSDP2.

Two families, two mechanisms:

* ``"*-true"`` (``"bf16-true"``, ``"16-true"``): parameters are *stored* in the low dtype. The plugin converts the
  module with ``module.to(dtype)`` before sharding (cheap on ``meta``) and sets the default dtype while
  ``configure_model`` runs, so ``LightningModule.dtype`` reports the real dtype.
* ``"*-mixed"`` (``"bf16-mixed"``, ``"16-mixed"``): parameters stay fp32 (the sharded master weights the optimizer
  updates); FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy` casts them to the low dtype when it
  all-gathers them, and reduces gradients in fp32. The steps (Fabric: the forwards) also run under ``torch.autocast``
  in that dtype, as under Lightning's ``MixedPrecision``: code written for it computes its ops outside the sharded
  modules (a loss in the step) as it would there, losses and the like upcast to fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ClassVar, Literal, cast, get_args

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.plugins import precision as fabric_precision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins import precision as trainer_precision
from lightning.pytorch.plugins.precision.precision import Precision
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn import Module
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning_fsdp2.layout import is_split
from lightning_fsdp2.peft_support import adapter_tensors

FSDP2PrecisionType = Literal["32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed"]
"""The precisions FSDP2 runs in, as Lightning names them: ``*-true`` stores the parameters in that dtype, ``*-mixed``
stores them in fp32 and computes in the low dtype."""

_LOW_DTYPE: dict[str, torch.dtype] = {
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}


class PrecisionCore:
    """What both front-ends' ``FSDP2Precision`` plugins share: the dtypes, the FSDP2 policy, the module conversion and
    the contexts. The Trainer's (:class:`FSDP2Precision`) and Fabric's (:class:`lightning_fsdp2.fabric.FSDP2Precision`)
    add their front-end's backward and optimizer-step hooks."""

    def __init__(
        self,
        precision: FSDP2PrecisionType = "32-true",
        scaler: Any | None = None,
        adapter_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        supported = get_args(FSDP2PrecisionType)
        if precision not in supported:
            raise ValueError(
                f"FSDP2Strategy does not support precision={precision!r}. Choose one of: {', '.join(supported)}."
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(f"A gradient scaler is only used with precision='16-mixed', not {precision!r}.")
        if adapter_dtype is not None and not adapter_dtype.is_floating_point:
            raise ValueError(f"adapter_dtype must be a floating dtype (or None), got {adapter_dtype}.")
        self.precision = cast(FSDP2PrecisionType, precision)
        self._low_dtype = _LOW_DTYPE.get(precision)
        self.adapter_dtype = adapter_dtype
        if precision == "16-mixed" and scaler is None:
            # fp16 gradients overflow; the sharded scaler all-reduces its inf check so every rank skips together.
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            # Its default device is "cuda", and without CUDA it silently disables itself: name the device.
            scaler = ShardedGradScaler(device="cuda" if torch.cuda.is_available() else "cpu")
        self.scaler = scaler
        # As Lightning's MixedPrecision plugin: the device type its computation targets ("cuda" where there is one).
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # Where and in what `*-mixed` autocasts; `compute_as` corrects both when a model is sharded.
        self._autocast_device = self.device
        self._autocast_dtype = self._low_dtype

    @property
    def is_true_precision(self) -> bool:
        """Whether parameters are stored in a low dtype (``"bf16-true"``, ``"16-true"``)."""
        return self.precision in ("bf16-true", "16-true")

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the sharded parameters are stored in (the optimizer's dtype). Not FSDP2's
        ``MixedPrecisionPolicy.param_dtype``, which is the dtype they are gathered and computed in."""
        return self._low_dtype if self.is_true_precision and self._low_dtype is not None else torch.float32

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The FSDP2 policy for this precision: low-dtype compute with fp32 reduction for ``*-mixed``."""
        if self.precision in ("bf16-mixed", "16-mixed"):
            return MixedPrecisionPolicy(param_dtype=self._low_dtype, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def convert_module(self, module: Module) -> Module:
        """Store parameters (and floating buffers) in the low dtype for ``*-true``, peft's adapters in
        ``adapter_dtype``; leave them otherwise.

        Called before sharding, so on a meta-built model this only changes metadata and no memory is touched.
        """
        if self.is_true_precision:
            module = module.to(dtype=self._low_dtype)
            if self.adapter_dtype is not None and self.adapter_dtype != self._low_dtype:
                _cast_adapters(module, self.adapter_dtype)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        """Default dtype while ``configure_model`` runs, so tensors are born in the storage dtype."""
        if self.is_true_precision:
            return _DtypeContextManager(self._low_dtype)
        return nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        """Same as :meth:`tensor_init_context`."""
        return self.tensor_init_context()

    def compute_as(self, policy: MixedPrecisionPolicy, device: torch.device) -> None:
        """Autocast ``*-mixed`` on ``device``'s type in the dtype FSDP2 gathers parameters in: ``policy``'s (the one
        in use, a user's ``FSDP2Strategy(mixed_precision=...)`` too), or the precision's without one. Called when a
        model is sharded, so autocast never computes in a dtype other than the parameters' (or on another device)."""
        self._autocast_device = device.type
        self._autocast_dtype = policy.param_dtype or self._low_dtype

    def autocast_context_manager(self) -> AbstractContextManager:
        """``torch.autocast`` under ``*-mixed``, as Lightning's ``MixedPrecision`` (no autocast cache: it would keep
        cast copies of parameters for the whole step); nothing under ``*-true`` and ``"32-true"``."""
        if self.precision not in ("bf16-mixed", "16-mixed"):
            return nullcontext()
        return torch.autocast(self._autocast_device, dtype=self._autocast_dtype, cache_enabled=False)

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """``*_step`` under autocast with ``*-mixed``, as with Lightning's ``MixedPrecision``; under ``*-true`` the
        tensors created there get the storage dtype, as with ``HalfPrecision``."""
        with self.tensor_init_context(), self.autocast_context_manager():
            yield

    def convert_input(self, data: Any) -> Any:
        """Cast floating inputs to the storage dtype under ``*-true``; FSDP2 casts them itself under ``*-mixed``."""
        if self.is_true_precision:
            return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self._low_dtype)
        return data

    def convert_output(self, data: Any) -> Any:
        """Return floating outputs in the default dtype under ``*-true`` and ``*-mixed``, as Lightning's
        ``HalfPrecision`` and Fabric's ``MixedPrecision`` do (only Fabric calls it, on its forwards' outputs)."""
        if self._low_dtype is not None:
            return apply_to_collection(
                data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype()
            )
        return data

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, saved in checkpoints under ``"16-mixed"``."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state."""
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def _cast_adapters(module: Module, dtype: torch.dtype) -> None:
    """Store the floating tensors peft added to ``module`` (adapters, ``modules_to_save`` copies, prompt encoders) in
    ``dtype``, as peft's own ``autocast_adapter_dtype=True`` does: a low-rank update applied in bf16 loses the small
    steps. FSDP2 gathers each tensor in its own dtype, so a group may hold a bf16 base and fp32 adapters. peft casts
    an adapter's input to the adapter's dtype and its output back, so the forward needs nothing else."""
    names = adapter_tensors(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name in names and param.is_floating_point():
                param.data = param.data.to(dtype)


class FSDP2Precision(PrecisionCore, Precision):
    """Precision plugin for :class:`~lightning_fsdp2.FSDP2Strategy`.

    The strategy swaps Lightning's stock plugin (chosen from ``Trainer(precision=...)``) for this one, so users
    normally never construct it. Pass it explicitly (``Trainer(plugins=FSDP2Precision("16-mixed"))``) to pick a
    mode Lightning would otherwise rewrite, such as ``"16-mixed"`` on CPU.

    Args:
        precision: one of ``"32-true"``, ``"bf16-true"``, ``"16-true"``, ``"bf16-mixed"``, ``"16-mixed"``.
        scaler: gradient scaler for ``"16-mixed"``; defaults to FSDP's ``ShardedGradScaler``, which agrees on
            "found inf" across ranks (each rank sees only its shard of the gradients).
        adapter_dtype: under ``"bf16-true"``/``"16-true"``, the dtype peft's adapters (and ``modules_to_save``, prompt
            encoders) are stored, trained and optimized in, while the base is stored in the low dtype. Default fp32,
            as peft's own ``autocast_adapter_dtype=True``; ``None`` stores them in the low dtype too.

    Like Lightning's own plugins it has ``precision``, ``scaler`` (``None`` but for ``"16-mixed"``) and ``device``
    (``"cuda"`` where CUDA is available, else ``"cpu"``).
    """

    replaces: ClassVar[tuple[type, ...]] = (
        Precision, trainer_precision.HalfPrecision, trainer_precision.MixedPrecision, trainer_precision.DoublePrecision
    )
    """The Trainer's stock plugins (from ``Trainer(precision=...)``) that the strategy turns into this one."""

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        """Scale the loss under ``"16-mixed"``."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Step the optimizer; under ``"16-mixed"`` unscale before clipping and let the scaler skip inf steps."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        # Unscale before `_after_closure`, which runs gradient clipping: clipping must see true gradient values.
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if not model.automatic_optimization or closure_result is not None:
            step_output = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return step_output
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the norm of the *whole* gradient, not of this rank's shard (see :func:`clip_grad_norm_`)."""
        clip_grad_norm_(self.main_params(optimizer), clip_val)


class FabricFSDP2Precision(PrecisionCore, FabricPrecision):
    """Fabric's precision plugin for :class:`lightning_fsdp2.fabric.FSDP2Strategy` (imported from there as
    ``lightning_fsdp2.fabric.FSDP2Precision``): the same modes as the Trainer's
    :class:`lightning_fsdp2.FSDP2Precision` (``"32-true"``, ``"bf16-true"``, ``"16-true"``, ``"bf16-mixed"``,
    ``"16-mixed"``), with Fabric's backward and optimizer-step hooks.

    The strategy swaps the plugin Fabric picked from ``Fabric(precision=...)`` for this one, so users normally never
    construct it. ``*-true`` stores parameters in that dtype; ``*-mixed`` keeps them fp32 and FSDP2's
    ``MixedPrecisionPolicy`` computes in the low dtype, the forwards under ``torch.autocast`` and their floating outputs
    returned in fp32, as Fabric's ``MixedPrecision``. Under ``"16-mixed"`` the loss is scaled by a
    ``ShardedGradScaler``, which ``fabric.clip_gradients`` and the optimizer step unscale. ``adapter_dtype``: as for
    the Trainer's plugin, peft's adapters are stored in fp32 on a ``*-true`` base by default.
    """

    replaces: ClassVar[tuple[type, ...]] = (
        FabricPrecision, fabric_precision.HalfPrecision, fabric_precision.MixedPrecision, fabric_precision.DoublePrecision
    )
    """Fabric's stock plugins (from ``Fabric(precision=...)``) that the strategy turns into this one."""

    peer_watch: Any = None
    """The strategy's ``PeerWatch``, given by the strategy when its processes start: Fabric's forwards (which run
    inside :meth:`forward_context`, the one hook Fabric's module wrapper calls) are then phases the other ranks see,
    and a collective failing in one raises ``PeerLostError``. (The Trainer's strategy marks its steps itself.)"""

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """As the Trainer's (autocast under ``*-mixed``), and the forward a phase of the strategy's peer watch (see
        :attr:`peer_watch`)."""
        with self.peer_watch.phase("forward") if self.peer_watch is not None else nullcontext():
            with super().forward_context():
                yield

    def pre_backward(self, tensor: Tensor, module: Module | None) -> Tensor:  # type: ignore[override]
        """Scale the loss under ``"16-mixed"``."""
        return self.scaler.scale(tensor) if self.scaler is not None else tensor

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step; under ``"16-mixed"`` through the scaler, which skips steps whose gradients overflowed on any rank."""
        if self.scaler is None:
            return optimizer.step(**kwargs)
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale the gradients before clipping under ``"16-mixed"``."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """Clip gradients of (possibly sharded) parameters by their global norm; return that norm.

    With FSDP2 each rank holds a shard of every gradient (a ``DTensor``). The norm that decides the clipping factor
    must be the norm over all shards, or ranks would scale their pieces of one gradient differently. The norm of
    sharded gradients is a partial ``DTensor``; ``full_tensor()`` reduces it into the global norm. With tensor
    parallelism the gradients live on two meshes (data-parallel x tensor for the split layers, data-parallel for the
    rest), which one norm cannot mix: each kind's norm is reduced over its own mesh, then they are combined, so every
    element counts once. ``error_if_nonfinite`` raises when that norm is NaN or infinite, as torch's own clipping
    does (a host sync).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    kinds: dict[Any, list[Tensor]] = {}
    for grad in grads:  # same mesh and same split mesh dimensions: norms that stack and reduce alike
        key = (grad.device_mesh, tuple(is_split(p) for p in grad.placements)) if isinstance(grad, DTensor) else None
        kinds.setdefault(key, []).append(grad)
    norms = []
    for kind in kinds.values():
        norm = torch.nn.utils.get_total_norm(kind, norm_type=norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total_norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} of the gradients is non-finite, so they cannot be clipped."
            " Set `error_if_nonfinite=False` to clip anyway (the gradients then become NaN)."
        )
    # The factor stays a tensor on the device (no host sync per step, as torch's own clipping). Multiplying sharded
    # gradients by a plain 0-dim tensor is allowed as an implicitly replicated value.
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).to(grads[0].dtype)
    with implicit_replication():
        for kind in kinds.values():  # one foreach per mesh: DTensor ops do not mix meshes
            torch._foreach_mul_(kind, clip_coef)
    return total_norm


def convert_stock_precision(plugin: Any, target: type, strategy: str, front_end: str) -> Any:
    """The plugin a front-end picked from ``precision=...`` as ``target`` (its ``FSDP2Precision``): Lightning's stock
    plugins (``target.replaces``) become ``target(plugin.precision)`` (which validates the value); ``target`` instances
    and ``None`` stay; anything else is refused, naming the choices."""
    if plugin is None or isinstance(plugin, target):
        return plugin
    if type(plugin) in target.replaces:
        return target(plugin.precision)
    raise TypeError(
        f"{strategy} works with FSDP2Precision, not {type(plugin).__name__}. Pass `{front_end}(precision=...)` with one"
        " of '32-true', 'bf16-true', '16-true', 'bf16-mixed', '16-mixed', or an FSDP2Precision plugin."
    )
