"""Step code that reads or writes a sharded parameter's values, as it does in one process.

Code written for one device reads parameters in a step (``self.layer.weight.item()`` to log a scalar weight,
``.tolist()``) and writes them (``self.layer.weight.data = torch.ones_like(self.layer.weight.data)``, a reset after a
loss spike). Between forwards FSDP2's parameters are ``DTensor`` shards, and torch gives both a meaning of its own:
``.item()`` reads this rank's shard as if it held the whole tensor (a rank whose shard of a 1x1 weight is empty fails
with "_local_scalar_dense: Empty tensor not supported"), ``.tolist()`` is refused for tensor subclasses, and
``param.data = value`` on a ``DTensor`` changes nothing the next forward sees (FSDP2 all-gathers from the shard's own
storage, which the assignment does not reach): the model trains on, silently, with the old values.

So ``.item()`` (and ``float()``, ``int()``, ``bool()``, which call it) of a ``DTensor`` that is not replicated reads
the whole tensor, gathered from every rank (every rank runs the step, as in one process): a handler torch's
``DTensor`` dispatcher calls for that op (it otherwise reads the local shard as if it were the whole tensor). And
each sharded parameter's class becomes :class:`ShardedParameter`, a ``DTensor`` whose ``tolist()`` gathers too and
whose ``.data`` assignment copies the new values into the shards (each rank its slice). Everything else is
``DTensor``'s own. Printing a parameter shows its shape, this rank's shard and how to see the whole tensor (with
``param.full_tensor()`` on every rank): gathering there would make a ``print`` on rank 0 alone wait for the others.

Why not keep small parameters whole instead: FSDP2 manages only shards; a plain tensor beside them would need its
gradients reduced by hand, and torch's optimizers (``foreach``) and ``clip_grad_norm_`` fail on lists that mix
``Tensor`` and ``DTensor``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _foreach_supported_types as _optimizer_types
from torch.utils._foreach_utils import _foreach_supported_types as _foreach_types

from lightning_fsdp2.checkpoint.module_load import _shard_of, _whole
from lightning_fsdp2.quantize import is_nf4


class ShardedParameter(DTensor):
    """A sharded parameter whose values step code reads and writes as in one process (see the module's doc)."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        """A copy of the shard, as ``copy.deepcopy`` of a ``DTensor`` parameter gives (torch requires a subclass's
        ``clone()`` to keep the class; ``DTensor``'s ops return ``DTensor``)."""
        copy = nn.Parameter(self.detach().clone(), requires_grad=self.requires_grad)
        memo[id(self)] = copy
        return copy

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as the ``DTensor`` it is (so that ``torch.load(weights_only=True)`` knows the class)."""
        return DTensor.__reduce_ex__(self.detach(), protocol)

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        """Shape, layout and this rank's shard, and how to see the whole tensor: gathering here would make a
        ``print`` on rank 0 alone wait for ranks that never come."""
        return (
            f"Sharded parameter of shape {tuple(self.shape)}, {self.dtype}, {tuple(self.placements)} over"
            f" {self.device_mesh.size()} ranks; this rank's shard: {self.to_local().detach()!r}. For the whole tensor,"
            " compute `param.full_tensor()` on every rank (then print it where you like)."
        )

    __str__ = __repr__

    def tolist(self) -> Any:  # type: ignore[override]
        """The whole parameter as nested lists, gathered: call it on every rank."""
        return self.full_tensor().tolist()

    @property
    def data(self) -> Tensor:  # type: ignore[override]
        """The parameter's values (a ``DTensor`` without autograd history), as ``DTensor.data``."""
        return DTensor.data.__get__(self)  # type: ignore[attr-defined]

    @data.setter
    def data(self, value: Tensor) -> None:
        """New values, copied into this rank's shard: a ``DTensor`` (``torch.ones_like(param.data)``) or a whole
        tensor of the parameter's shape. A new shape cannot be given to a sharded parameter: refused by name."""
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(self.shape):
            found = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise RuntimeError(
                f"`param.data = value` with a value of shape {found} on a sharded parameter of shape"
                f" {tuple(self.shape)}: FSDP2Strategy can copy new values into a parameter's shards, not give it"
                " another shape. Assign a value of the same shape, or build the layer with its new shape in"
                " `configure_model`."
            )
        with torch.no_grad():
            if isinstance(value, DTensor) and (value.device_mesh, value.placements) == (
                self.device_mesh, self.placements
            ):
                self.to_local().copy_(value.to_local())
            else:
                self.to_local().copy_(_shard_of(self, lambda index: _whole(value)[index]).to_local())


# torch's optimizers take their fast `foreach` path only for the tensor types listed here (torch lists DTensor).
for _types in (_optimizer_types, _foreach_types):
    if ShardedParameter not in _types:
        _types.append(ShardedParameter)


def _whole_item(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``aten._local_scalar_dense`` (``.item()``) of a ``DTensor``: of the whole tensor. torch reads the local shard
    whatever the placements, right only for a replicated one (kept as it is: no communication)."""
    tensor = args[0]
    if all(p.is_replicate() for p in tensor.placements):
        return tensor._local_tensor.item()
    return tensor.full_tensor().item()


def make_step_accessible(module: nn.Module) -> None:
    """Give every sharded floating-point parameter of ``module`` the class :class:`ShardedParameter` (in place: the
    parameter objects, which FSDP2 and the optimizers hold, stay the same; NF4 weights keep their own), and
    ``DTensor.item()`` the whole tensor's value (the handler is process-wide: it changes only what torch got wrong)."""
    DTensor._op_dispatcher._custom_op_handlers[torch.ops.aten._local_scalar_dense.default] = _whole_item
    for param in module.parameters():
        if type(param) is DTensor and param.dtype.is_floating_point and not is_nf4(param):
            param.__class__ = ShardedParameter
