"""How the processes are laid out: a device mesh whose dimensions have names.

Every part of the package that needs to know which ranks hold what asks a :class:`Layout` (for the processes) or a
tensor's own DTensor placements (:func:`split_dims`, for one tensor), never a position: "the last mesh dimension
shards" is not true with tensor parallelism (``device_mesh=(replicate, shard, tensor)``), and a ready mesh from the
user may name its dimensions as it likes.

The dimensions, outermost (slowest-varying rank) first:

* ``"replicate"``: HSDP's replicas; each holds every parameter, sharded within it; gradients are all-reduced across.
* ``"shard"``: FSDP's shard groups, consecutive ranks; each parameter is split over them.
* ``"tensor"``: tensor parallelism's groups, the innermost (adjacent ranks, so a group stays inside a node): the
  layers the plan names are split over them (``tensor_parallel.py``), and they compute one batch together.
* ``"context"``: context parallelism's groups, between ``"shard"`` and ``"tensor"`` (adjacent ranks after the tensor
  groups): the ranks of a group read the same batch and each keeps ``1/N`` of every sequence's tokens through the
  model's layers, attention seeing whole sequences (``context_parallel.py``); they hold different tokens, and so
  compute different gradients of every parameter: FSDP2 shards over ``"shard"`` and ``"context"`` together.
* ``"expert"``: expert parallelism's groups, carved out of the shard dimension (torchtitan's and transformers' way:
  not a factor of the world size): each shard group is split into groups of ``expert`` adjacent ranks, each rank of a
  group holding whole experts of every MoE layer and the tokens routed to them travelling within the group
  (``expert_parallel.py``); ranks at the same place in different groups hold the same experts, sharded over them.

``"replicate"`` and ``"shard"`` are *data-parallel*: ranks at different coordinates on them read different batches;
ranks that differ only on ``"context"`` or ``"tensor"`` read the same one. Where FSDP2 keeps each group's parameters (on which ranks,
split along which tensor dimension) is the layout's answer too (:meth:`Layout.storage`). A layout is resolved once
the processes are known (:meth:`Layout.resolve`, pure: no process group needed) and checked there, on every rank
alike, before any collective; :meth:`Layout.build_mesh` then makes the ``DeviceMesh`` (a collective).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

REPLICATE = "replicate"
SHARD = "shard"
TENSOR = "tensor"
CONTEXT = "context"
EXPERT = "expert"
EXPERT_SHARD = "expert_shard"  # the expert mesh's part of "shard" across expert groups: ranks holding the same experts


@dataclass(frozen=True)
class Dimension:
    """One named dimension of the layout: what its ranks share and what they split."""

    name: str
    data_parallel: bool
    """Ranks at different coordinates on it read different batches (a step's loss is averaged over them, the sampler
    splits the data over them, their random streams differ); ranks that differ only on the others share a batch."""
    within: str | None = None
    """The dimension whose ranks it splits into groups (``"expert"`` splits ``"shard"``), rather than a dimension of
    the mesh of its own: its size divides that one's and is no factor of the world size."""
    fsdp: Literal["replicate", "shard"] | None = None
    """What FSDP2 does over its ranks, which compute different gradients of every parameter: ``"replicate"`` (HSDP's
    replicas: each holds every parameter, gradients all-reduced) or ``"shard"`` (each parameter split over them,
    gradients reduce-scattered; several such dimensions are one shard group, flattened); ``None``: its ranks
    compute the same gradients (tensor parallelism's, whose split layers are DTensors of their own) or it lies
    within another dimension."""


DIMENSIONS = (Dimension(REPLICATE, data_parallel=True, fsdp="replicate"), Dimension(SHARD, data_parallel=True, fsdp="shard"),
              Dimension(EXPERT, data_parallel=True, within=SHARD), Dimension(CONTEXT, data_parallel=False, fsdp="shard"),
              Dimension(TENSOR, data_parallel=False))
"""Every dimension a layout may have, in mesh order (outermost, slowest-varying rank first). A new kind of parallelism
is one more entry here, one more option, and one more step of ``parallel.parallelize`` (see docs/how-it-works.md)."""

DATA_PARALLEL = tuple(d.name for d in DIMENSIONS if d.data_parallel and d.within is None)
"""The mesh dimensions over which ranks read different data (ranks that differ only on the others share a batch; a
dimension within another reads what that one does)."""

FSDP_SHARD = tuple(d.name for d in DIMENSIONS if d.fsdp == "shard")
"""The mesh dimensions FSDP2 splits every parameter over (one shard group, flattened when there are several)."""

MeshOption = tuple[int, int] | tuple[int, int, int] | Mapping[str, int] | DeviceMesh | None
"""What ``FSDP2Strategy(device_mesh=...)`` takes: ``None`` (shard over every process), ``(replicate, shard)``,
``(replicate, shard, tensor)``, the sizes by name (``{"replicate": 2, "shard": 4, "tensor": 2}``; a dimension left
out has one rank, ``"shard"`` left out takes the processes the others leave), or a ready 1-D (shard), 2-D
(replicate, shard) or 3-D (replicate, shard, tensor) ``DeviceMesh``."""


@dataclass(frozen=True)
class Storage:
    """Where FSDP2 keeps the parameters of one group: ``fully_shard``'s ``mesh`` and ``shard_placement_fn``."""

    mesh: DeviceMesh
    """1-D: each parameter split over its ranks; 2-D: HSDP (replicated over the first dimension, split over the
    second)."""
    placement: Callable[[nn.Parameter], Shard | None] | None = None
    """Along which dimension each parameter is split (``None``: its first, FSDP2's default). A dimension other than
    the first keeps a parameter whose first is short (a few experts over many ranks) from padding most ranks' pieces;
    the checkpoints, the loads and the initialization read each tensor's own placements, so any is saved, resumed and
    loaded alike."""
    divide_gradients_by: int | None = None
    """What the group's reduced gradients are divided by (``None``: FSDP2's default, the ranks of ``mesh``)."""


def check_mesh_option(device_mesh: Any) -> MeshOption:
    """``device_mesh`` as the strategies keep it, or a ``TypeError``/``ValueError`` saying what it takes (at
    construction)."""
    if device_mesh is None or isinstance(device_mesh, DeviceMesh):
        return device_mesh
    if isinstance(device_mesh, str):
        raise ValueError(
            f"FSDP2Strategy(device_mesh={device_mesh!r}): the one string it takes is 'auto' (the layout chosen from"
            " the memory the run needs); or pass a tuple, the sizes by name, a DeviceMesh, or None."
        )
    if isinstance(device_mesh, Mapping):
        known = [d.name for d in DIMENSIONS]
        unknown = [k for k in device_mesh if k not in known]
        if unknown:
            raise ValueError(
                f"FSDP2Strategy(device_mesh={dict(device_mesh)!r}): {unknown} name no dimension of the layout; the"
                f" dimensions are {known}."
            )
        bad = {k: v for k, v in device_mesh.items() if not _positive_int(v)}
        if bad:
            raise (ValueError if all(_int(v) for v in bad.values()) else TypeError)(
                f"FSDP2Strategy(device_mesh={dict(device_mesh)!r}): each size is a positive int (ranks along that"
                f" dimension); got {bad}."
            )
        return {d: device_mesh[d] for d in known if d in device_mesh}  # in mesh order
    if not (isinstance(device_mesh, (tuple, list)) and len(device_mesh) in (2, 3)
            and all(_positive_int(n) for n in device_mesh)):
        # Another type: TypeError; a tuple of ints of the wrong length or sign: a bad value, ValueError.
        of_ints = isinstance(device_mesh, (tuple, list)) and all(_int(n) for n in device_mesh)
        raise (ValueError if of_ints else TypeError)(
            f"FSDP2Strategy(device_mesh={device_mesh!r}): pass a tuple (replicate, shard) of two positive ints"
            " (HSDP: each parameter sharded over `shard` ranks, replicated `replicate` times; their product is"
            " the number of processes), (replicate, shard, tensor) with tensor parallelism over groups of `tensor`"
            " ranks, a DeviceMesh, or None to shard over every process."
        )
    return tuple(device_mesh)  # type: ignore[return-value]


def check_tensor_given_once(device_mesh: Any, tensor_parallel_size: int) -> None:
    """Refuse two different tensor-parallel sizes, one in ``device_mesh`` and one as ``tensor_parallel_size`` (at
    construction, and again by :meth:`Layout.resolve` for a caller that skips it)."""
    if isinstance(device_mesh, Mapping):
        given = device_mesh.get(TENSOR)
    elif isinstance(device_mesh, tuple) and len(device_mesh) == 3:
        given = device_mesh[2]
    else:
        return
    if given is not None and tensor_parallel_size not in (1, given):
        raise ValueError(
            f"FSDP2Strategy(device_mesh={device_mesh!r}, tensor_parallel_size={tensor_parallel_size}): give the"
            " tensor-parallel size once, in device_mesh or as tensor_parallel_size."
        )


def check_expert_given_once(device_mesh: Any, expert_parallel_size: int) -> None:
    """Refuse two different expert-parallel sizes, one in ``device_mesh`` and one as ``expert_parallel_size``, and an
    expert dimension a layout form cannot carry (a ready ``DeviceMesh``, ``"auto"``): at construction, and again by
    :meth:`Layout.resolve`."""
    _check_given_once(device_mesh, EXPERT, "expert_parallel_size", expert_parallel_size,
                      "expert parallelism carves its groups out of the layout's shard dimension")


def check_context_given_once(device_mesh: Any, context_parallel_size: int) -> None:
    """:func:`check_expert_given_once` for ``context_parallel_size``."""
    _check_given_once(device_mesh, CONTEXT, "context_parallel_size", context_parallel_size,
                      "context parallelism adds a dimension to the layout"
                      + (" ('auto' given batch_shape= may split sequences itself, when they do not fit otherwise)"
                         if device_mesh == "auto" else ""))


def _check_given_once(device_mesh: Any, name: str, option: str, size: int, why: str) -> None:
    given = device_mesh.get(name) if isinstance(device_mesh, Mapping) else None
    if given is not None and size not in (1, given):
        raise ValueError(
            f"FSDP2Strategy(device_mesh={dict(device_mesh)!r}, {option}={size}): give the {name}-parallel size once,"
            f" in device_mesh or as {option}."
        )
    if size > 1 and (isinstance(device_mesh, DeviceMesh) or device_mesh == "auto"):
        form = "a ready DeviceMesh" if isinstance(device_mesh, DeviceMesh) else "device_mesh='auto'"
        raise ValueError(
            f"FSDP2Strategy({option}={size}) with {form}: {why}, which it builds itself. Pass device_mesh=None or"
            f" the sizes (e.g. {{'shard': N, '{name}': {size}}}) instead."
        )


def check_parallel_size(size: Any, option: str, what: str) -> int:
    """A ``*_parallel_size`` option as the strategies keep it, or a ``TypeError`` (not an int) or ``ValueError``
    (below 1), at construction. ``what``: the ranks it counts, for the message."""
    if not _positive_int(size):
        raise (ValueError if _int(size) else TypeError)(
            f"FSDP2Strategy({option}={size!r}): a positive int, {what} (1, the default: none)."
        )
    return size


def check_tensor_parallel_size(size: Any) -> int:
    """``tensor_parallel_size`` as the strategies keep it (:func:`check_parallel_size`)."""
    return check_parallel_size(size, "tensor_parallel_size",
                               "the ranks each layer the tensor-parallel plan names is split over")


@dataclass(frozen=True)
class Layout:
    """The processes as a mesh with named dimensions (see the module's docstring): ``names[i]`` has ``sizes[i]``
    ranks; rank ``r`` sits at the row-major coordinates of ``r`` (what ``init_device_mesh`` makes, and what a ready
    mesh is checked to be)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    given: DeviceMesh | None = field(default=None, compare=False, repr=False)
    """The user's own mesh, used as it is by :meth:`build_mesh`."""
    expert: int = 1
    """Ranks per expert group (the ``"expert"`` dimension, within ``"shard"``; 1: no expert parallelism)."""

    @classmethod
    def resolve(
        cls, option: MeshOption, world_size: int, devices_per_node: int, device_type: str, tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1, context_parallel_size: int = 1,
    ) -> Layout:
        """The layout ``FSDP2Strategy(device_mesh=option, tensor_parallel_size=...)`` asks for on ``world_size``
        processes, ``devices_per_node`` of them per node; a ``ValueError`` that says what to change if it cannot
        work. Pure: the same on every rank, so every rank raises together, before any collective."""
        check_tensor_given_once(option, tensor_parallel_size)
        check_expert_given_once(option, expert_parallel_size)
        check_context_given_once(option, context_parallel_size)
        context = context_parallel_size
        shown = None  # the user's own form, for the messages
        if isinstance(option, Mapping):
            shown = f"device_mesh={dict(option)}" + (
                f", tensor_parallel_size={tensor_parallel_size}" if tensor_parallel_size > 1 else "")
            expert_parallel_size = max(option.get(EXPERT, 1), expert_parallel_size)  # given once (checked above)
            context = max(option.get(CONTEXT, 1), context)
            option, tensor_parallel_size = _positional(option, world_size, tensor_parallel_size, context)
        if isinstance(option, DeviceMesh):
            layout = cls._from_mesh(option, world_size, device_type)
            if tensor_parallel_size not in (1, layout.tensor_size):
                held = (f"its tensor dimension has {layout.tensor_size} rank(s)" if option.ndim == 3
                        else "a 1-D/2-D mesh has no tensor dimension")
                raise ValueError(
                    f"FSDP2Strategy(device_mesh=<{option.ndim}-D mesh>, tensor_parallel_size={tensor_parallel_size}):"
                    f" a ready mesh carries the tensor dimension itself, and {held}. Build it 3-D (replicate, shard,"
                    " tensor), or pass the tuple (replicate, shard) with tensor_parallel_size."
                )
            return layout
        tensor = tensor_parallel_size
        if option is not None and len(option) == 3:
            tensor = option[2]
        if option is None:
            if world_size % tensor:
                raise ValueError(
                    f"FSDP2Strategy(tensor_parallel_size={tensor}): {world_size} processes (devices x num_nodes) do"
                    f" not split into tensor-parallel groups of {tensor}. Choose a tensor_parallel_size that divides"
                    f" {world_size} (and the devices per node, {devices_per_node})."
                )
            if world_size % (tensor * context):
                sizes = f"context_parallel_size={context}" + (f", tensor_parallel_size={tensor}" if tensor > 1 else "")
                raise ValueError(
                    f"FSDP2Strategy({shown or sizes}): {world_size} processes (devices x num_nodes) do not split into"
                    f" groups of {tensor * context} ranks sharing a batch. Choose sizes whose product divides"
                    f" {world_size} (and the devices per node, {devices_per_node})."
                )
            replicate, shard = 1, world_size // (tensor * context)
        else:
            replicate, shard = option[0], option[1]
        cls._check_fits(option, replicate, shard, tensor, world_size, devices_per_node, shown, context)
        cls._check_expert(expert_parallel_size, shard, tensor, devices_per_node, shown, context)
        kept = [(name, n) for name, n in ((REPLICATE, replicate), (SHARD, shard), (CONTEXT, context), (TENSOR, tensor))
                if n > 1 or name == SHARD or (name == REPLICATE and option is not None)]
        return cls(tuple(n for n, _ in kept), tuple(k for _, k in kept), expert=expert_parallel_size)

    @staticmethod
    def _check_expert(expert: int, shard: int, tensor: int, devices_per_node: int, shown: str | None,
                      context: int = 1) -> None:
        if expert == 1:
            return
        shown = shown or f"expert_parallel_size={expert}"
        if context > 1:
            raise ValueError(
                f"FSDP2Strategy({shown}, context_parallel_size={context}): expert and context parallelism together do"
                " not run yet. Keep one of the two."
            )
        if tensor > 1:
            raise ValueError(
                f"FSDP2Strategy({shown}, tensor_parallel_size={tensor}): expert and tensor parallelism together do not"
                " run yet."
                " Keep one of the two: expert parallelism for a mixture-of-experts model, or tensor parallelism"
                " without expert_parallel_size."
            )
        if shard % expert:
            fits = [d for d in range(2, shard + 1) if shard % d == 0]
            advice = (f"Choose an expert_parallel_size among {fits}." if fits else
                      "With one rank per shard group there is no room for expert groups: give fewer replicas"
                      " (\"replicate\") so that the shard groups have ranks to carve them from, or drop the expert size.")
            raise ValueError(
                f"FSDP2Strategy({shown}): expert groups of {expert} ranks are carved out of the shard groups of"
                f" {shard} ranks (the ranks one replica spans), and {expert} does not divide {shard}. {advice}"
            )
        # The experts' tokens travel by all-to-all inside every MoE layer, forward and backward: across the slow link
        # between nodes each layer would wait on it. Groups of adjacent ranks stay in one node when their size divides
        # the devices per node.
        if devices_per_node % expert:
            raise ValueError(
                f"FSDP2Strategy({shown}): expert groups of {expert} ranks straddle nodes of {devices_per_node} devices,"
                " and their all-to-alls run inside every MoE layer. Choose an expert_parallel_size that divides the"
                f" devices per node ({devices_per_node})."
            )

    @staticmethod
    def _check_fits(
        option: MeshOption, replicate: int, shard: int, tensor: int, world_size: int, devices_per_node: int,
        shown: str | None = None, context: int = 1,
    ) -> None:
        shown = shown or ", ".join(
            ([f"device_mesh={option}"] if option is not None else [])
            + ([f"tensor_parallel_size={tensor}"] if tensor > 1 and (option is None or len(option) == 2) else [])
            + ([f"context_parallel_size={context}"] if context > 1 else []))
        inner = context * tensor  # the ranks that share a batch
        if replicate * shard * inner != world_size:
            others = (" x context" if context > 1 else "") + (" x tensor" if tensor > 1 else "")
            product = f"{replicate} x {shard}" + (f" x {context}" if context > 1 else "") + (
                f" x {tensor}" if tensor > 1 else "")
            named = shown.startswith("device_mesh={")  # the advice in the form the user wrote
            sizes = '{"replicate": ..., "shard": ...}' if named else "(replicate, shard)"
            raise ValueError(
                f"FSDP2Strategy({shown}): {product} = {replicate * shard * inner}, but there are {world_size}"
                f" processes (devices x num_nodes). Choose {sizes} with replicate x shard{others} = {world_size},"
                f" e.g. shard = the devices per node ({devices_per_node}{f' / {inner}' if inner > 1 else ''}) and"
                " replicate = the number of nodes"
                + (' (or leave "shard" out: it takes the processes the others leave).' if named else ".")
                + (' "expert" is no factor of the product: its groups are carved out of "shard".'
                   if named and f"'{EXPERT}'" in shown else "")
            )
        # Tensor parallelism talks inside every layer's forward and backward: on the slow link between nodes it would
        # stall each of them. Its groups are the innermost dimension (adjacent ranks): they stay in one node when
        # their size divides the devices per node. A ready DeviceMesh is taken as the user built it.
        if tensor > 1 and devices_per_node % tensor:
            raise ValueError(
                f"FSDP2Strategy({shown}): tensor-parallel groups of {tensor} ranks straddle nodes of"
                f" {devices_per_node} devices, and their collectives run inside every layer. Choose a tensor size that"
                f" divides the devices per node ({devices_per_node}), or pass a DeviceMesh you built to place them"
                " yourself."
            )
        # Context parallelism's all-to-alls run inside every attention layer too (adjacent ranks after the tensor
        # groups): its groups, with the tensor groups inside them, stay in one node likewise.
        if context > 1 and devices_per_node % inner:
            raise ValueError(
                f"FSDP2Strategy({shown}): context-parallel groups of {context}{f' x {tensor} tensor' if tensor > 1 else ''}"
                f" ranks straddle nodes of {devices_per_node} devices, and their all-to-alls run inside every"
                f" attention layer. Choose a context size{' (x tensor size)' if tensor > 1 else ''} that divides the"
                f" devices per node ({devices_per_node})."
            )
        # A shard group gathers every parameter in every step: inside one node (or over whole nodes) its traffic
        # stays off, or evenly on, the slow link between nodes. A group that straddles node boundaries unevenly is
        # almost always a mistake in the numbers.
        span = shard * inner  # consecutive ranks of one replica
        if replicate > 1 and devices_per_node % span and span % devices_per_node:
            raise ValueError(
                f"FSDP2Strategy({shown}): shard groups of {shard} ranks straddle nodes of {devices_per_node} devices."
                f" Make `shard`{' x context' if context > 1 else ''}{' x tensor' if tensor > 1 else ''} divide the"
                " devices per node (HSDP's usual layout:"
                f" shard = {devices_per_node // inner if devices_per_node % inner == 0 else devices_per_node},"
                " one shard group per node) or a multiple of it (groups of whole nodes)."
            )

    @classmethod
    def _from_mesh(cls, mesh: DeviceMesh, world_size: int, device_type: str) -> Layout:
        # Full checkpoints are gathered to rank 0 from the shard group of the first replica, pieces in rank order:
        # the ranks must be laid out in order (what init_device_mesh makes), rank 0 first. Its dimensions are named
        # by position, whatever the mesh calls them.
        if mesh.ndim not in (1, 2, 3) or mesh.mesh.flatten().tolist() != list(range(world_size)):
            raise ValueError(
                f"FSDP2Strategy(device_mesh=...) got a {mesh.ndim}-D mesh of ranks {mesh.mesh.tolist()}; it must be"
                f" 1-D (shard), 2-D (replicate, shard) or 3-D (replicate, shard, tensor) over all {world_size}"
                " processes in rank order, as `init_device_mesh(device_type, (replicate, shard[, tensor]))` makes it,"
                " or pass the tuple."
            )
        if mesh.device_type != device_type:
            raise ValueError(
                f"FSDP2Strategy(device_mesh=...) got a {mesh.device_type!r} mesh for a run on {device_type!r}:"
                f" build it with init_device_mesh({device_type!r}, ...), or pass the tuple (replicate, shard)."
            )
        if mesh.ndim == 3 and mesh.mesh_dim_names is None:
            raise ValueError(
                "FSDP2Strategy(device_mesh=...) got a 3-D mesh without dimension names: build it with"
                f" `init_device_mesh({device_type!r}, (replicate, shard, tensor), mesh_dim_names=(\"replicate\","
                " \"shard\", \"tensor\"))` (any names; they are taken by position), or pass the tuple."
            )
        names = ((SHARD,), (REPLICATE, SHARD), (REPLICATE, SHARD, TENSOR))[mesh.ndim - 1]
        return cls(names, tuple(mesh.shape), given=mesh)

    # ------------------------------------------------------------------------------------------- sizes and ranks
    def size(self, name: str) -> int:
        """Ranks along dimension ``name`` (1 for a dimension the layout does not have)."""
        if name == EXPERT:
            return self.expert
        return self.sizes[self.names.index(name)] if name in self.names else 1

    @property
    def shard_size(self) -> int:
        """How many ranks each parameter is split over by FSDP (the shard group: ``"shard"``, and ``"context"``
        whose ranks compute different gradients too)."""
        return math.prod(self.size(name) for name in FSDP_SHARD)

    @property
    def context_size(self) -> int:
        """How many ranks each sequence's tokens are split over (1: no context parallelism)."""
        return self.size(CONTEXT)

    @property
    def tensor_size(self) -> int:
        """How many ranks each tensor-parallel layer is split over (1: no tensor parallelism)."""
        return self.size(TENSOR)

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step reads (the product of the data-parallel dimensions)."""
        return math.prod(self.size(name) for name in DATA_PARALLEL)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global rank ``rank`` sits on each dimension."""
        coords: dict[str, int] = {}
        for name, size in zip(reversed(self.names), reversed(self.sizes)):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.names}

    def data_parallel_rank(self, rank: int) -> int:
        """Which of the :attr:`data_parallel_size` batches global rank ``rank`` reads."""
        coords = self.coordinates(rank)
        index = 0
        for name in DATA_PARALLEL:
            index = index * self.size(name) + coords.get(name, 0)
        return index

    # ------------------------------------------------------------------------------------------- meshes
    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The ``DeviceMesh`` of this layout, with its dimension names (the user's own mesh as it is). Every rank."""
        if self.given is not None:
            return self.given
        return init_device_mesh(device_type, self.sizes, mesh_dim_names=self.names)

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The part of ``mesh`` (:meth:`build_mesh`'s) that ``fully_shard`` takes: 1-D (shard) or 2-D (replicate,
        shard, HSDP), the dimensions whose ranks compute different gradients (:attr:`Dimension.fsdp`); ``"shard"``
        and ``"context"`` flattened into one shard dimension, ``"shard_context"``."""
        kept = tuple(name for name in self.names if name in DATA_PARALLEL)
        if self.context_size == 1:
            return mesh if kept == self.names else mesh[self._mesh_names(mesh, kept)]
        shard = tuple(name for name in self.names if name in FSDP_SHARD)
        flat = mesh[shard]._flatten("_".join(shard))  # torch keeps one per name: the same group every call
        return DeviceMesh._concatenate([mesh[REPLICATE], flat]) if REPLICATE in self.names else flat

    def storage(self, mesh: DeviceMesh, group: str, module: nn.Module, expert_mesh: DeviceMesh | None = None) -> Storage:
        """Where FSDP2 keeps the parameters group ``group`` (``module``, a qualified name under the model) claims:
        asked group by group by ``wrap.shard_groups``. Per group, because FSDP2 takes one mesh per group, and a
        dimension that places some parameters itself keeps those on other ranks than the dense ones.

        Dense groups: the data-parallel part of ``mesh`` (:meth:`fsdp_mesh`), each parameter split along its first
        dimension. A group whose own parameters the expert dimension splits (:meth:`holds_experts`; ``expert_mesh``,
        :meth:`expert_mesh`'s, which they live on): sharded over the ranks holding the same experts (and replicated
        over ``"replicate"``), its gradients divided by every data-parallel rank: each rank's expert gradient already
        sums the tokens of its whole expert group (they reached it by all-to-all), and FSDP would divide by its own
        ranks only."""
        if expert_mesh is None or not self.holds_experts(module):
            return Storage(self.fsdp_mesh(mesh))
        kept = tuple(name for name in (REPLICATE, EXPERT_SHARD) if name in (expert_mesh.mesh_dim_names or ()))
        sharing = expert_mesh[EXPERT_SHARD].size()  # ranks holding the same experts

        def placement(param: nn.Parameter) -> Shard:
            # A rank's experts split along the expert dimension again, unless there are fewer of them than ranks
            # sharing them: then by rows (torchtitan's choice), so that no rank's piece is padding only.
            local = param.shape[0] // self.expert
            return Shard(1) if local % sharing and param.ndim > 1 and param.shape[1] % sharing == 0 else Shard(0)

        return Storage(expert_mesh[kept], placement, divide_gradients_by=self.data_parallel_size)

    def holds_experts(self, module: nn.Module) -> bool:
        """Whether ``module``'s own parameters are split over the expert dimension (expert parallelism's experts)."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(p, DTensor) and EXPERT in (p.device_mesh.mesh_dim_names or ())
                   for p in module.parameters(recurse=False))

    def expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """``mesh`` with its shard dimension split into ``("expert_shard", "expert")`` (the ranks holding the same
        experts, then the expert groups' adjacent ranks) and a last dimension of one rank, ``"expert_alone"``
        (transformers' styles take the ranks sharing a batch as a mesh: none here), one root with ``mesh`` so that
        FSDP2 composes the experts' placements with its own; ``None`` without expert parallelism. Makes process
        groups: called once per set-up, by the expert step, on every rank."""
        if self.expert == 1:
            return None
        shard = self.names.index(SHARD)
        named = self._mesh_names(mesh, (SHARD,))[0] if mesh.mesh_dim_names else shard
        return mesh._unflatten(named, (self.size(SHARD) // self.expert, self.expert, 1),
                               (EXPERT_SHARD, EXPERT, "expert_alone"))

    def sub_mesh(self, mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh | None:
        """The part of ``mesh`` along the dimensions ``names`` (those of them this layout has with more than one
        rank), flattened to 1-D when there are several; ``None`` when there is none."""
        kept = tuple(name for name in names if self.size(name) > 1)
        if not kept:
            return None
        part = mesh[self._mesh_names(mesh, kept)]
        return part if len(kept) == 1 else part._flatten("_".join(kept))

    def tensor_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The 1-D part of ``mesh`` that tensor parallelism splits layers over, or ``None`` without it."""
        return self.sub_mesh(mesh, (TENSOR,))

    def shared_batch_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The ranks that compute one batch together and the same gradients (the dimensions that are neither
        data-parallel nor FSDP's: ``"tensor"``), as one 1-D mesh; ``None`` without such a dimension. What one of
        them holds whole, all of them must hold equal (a context group's ranks hold FSDP's pieces, each its own)."""
        return self.sub_mesh(mesh, tuple(d.name for d in DIMENSIONS if not d.data_parallel and d.fsdp is None))

    def context_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """The 1-D part of ``mesh`` whose ranks split each sequence, or ``None`` without context parallelism."""
        return self.sub_mesh(mesh, (CONTEXT,))

    def _mesh_names(self, mesh: DeviceMesh, names: tuple[str, ...]) -> tuple[str, ...]:
        """``names`` as ``mesh`` calls its dimensions (a ready mesh may name them otherwise; one that is sliced here
        has names: :meth:`resolve` refuses an unnamed 3-D mesh, and 1-D/2-D ones are used whole)."""
        assert mesh.mesh_dim_names is not None
        return tuple(mesh.mesh_dim_names[self.names.index(name)] for name in names)


def split_dims(tensor: Tensor) -> dict[int, int]:
    """For a DTensor, which tensor dimension each mesh dimension splits it along (``{mesh_dim: tensor_dim}``; the
    mesh dimensions that replicate it are absent); ``{}`` for a plain tensor. From the tensor's own placements, so
    it holds for any layout, whatever the mesh's dimensions are called."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return {}
    placements = tensor.placements
    return {mesh_dim: p.dim for mesh_dim, p in enumerate(placements) if is_split(p)}  # type: ignore[attr-defined]


def is_split(placement: Any) -> bool:
    """Whether a DTensor placement splits the tensor: ``Shard``, or the ``_StridedShard`` FSDP2 makes when it shards a
    dimension tensor parallelism split already (each rank's piece is still one contiguous block of the whole)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def pieces_coordinate(tensors: Iterable[Tensor]) -> int:
    """This rank's index among the distinct combinations of pieces ``tensors`` hold (0 for plain tensors; the init
    seed): row-major over every mesh dimension that splits any of them, by name, in the order they first appear (the
    data-parallel dimensions split every parameter, the tensor dimension those its plan names), so ranks that hold the
    same pieces of all of them (HSDP's replicas) share it and ranks that hold different pieces of any one differ."""
    dims: dict[str, tuple[int, int]] = {}
    for tensor in tensors:
        mesh = getattr(tensor, "device_mesh", None)
        for mesh_dim in split_dims(tensor):
            assert mesh is not None
            name = mesh.mesh_dim_names[mesh_dim] if mesh.mesh_dim_names else f"#{mesh_dim}"
            dims.setdefault(name, (mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim)))
    index = 0
    for rank, size in dims.values():
        index = index * size + rank
    return index


def local_slice(tensor: Tensor) -> tuple[slice, ...]:
    """The slice of the whole tensor that this rank's local piece of ``tensor`` holds (all of it if not a DTensor),
    from torch's own arithmetic for the tensor's placements (FSDP2's ``torch.chunk`` pieces: rank ``r`` holds rows
    ``[r * ceil(n / world), ...)``, the last ranks fewer or none)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    for placement in tensor.placements:
        # A partial (pending-reduction) piece is no slice of the whole: torch's arithmetic would call it all of it.
        if not (is_split(placement) or placement.is_replicate()):
            raise NotImplementedError(f"Loading into a DTensor placed as {placement} is not supported.")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(tensor.to_local().shape):
        raise NotImplementedError(
            f"Unexpected shard layout {tensor.placements} (local shape {tuple(tensor.to_local().shape)}, placements"
            f" say {tuple(shape)}): a DTensor whose local piece is not one contiguous block of the whole cannot be"
            " read slice by slice."
        )
    return tuple(slice(start, start + n) for start, n in zip(offset, shape))


def _positional(sizes: Mapping[str, int], world_size: int, tensor_parallel_size: int, context: int = 1
                ) -> tuple[Any, int]:
    """The sizes by name as the positional form and ``tensor_parallel_size``: without ``"replicate"``, ``None`` (one
    shard group of all processes, or of all but the tensor dimension's); else ``(replicate, shard)`` or ``(replicate,
    shard, tensor)``. ``"shard"`` left out takes the processes the others leave."""
    tensor = max(sizes.get(TENSOR, 1), tensor_parallel_size)  # given once (check_tensor_given_once)
    replicate = sizes.get(REPLICATE, 1)
    shard = sizes.get(SHARD)
    if shard is None:
        if world_size % (replicate * tensor * context):
            raise ValueError(
                f"FSDP2Strategy(device_mesh={dict(sizes)!r}): {world_size} processes (devices x num_nodes) do not"
                f" split into {replicate * tensor * context} ({replicate} replicate x {context} context x {tensor}"
                f" tensor); give sizes whose product is {world_size}."
            )
        shard = world_size // (replicate * tensor * context)
    if replicate == 1 and shard * tensor * context == world_size:  # {"replicate": 1} is {} (a dimension of one rank is none)
        return None, tensor
    return (replicate, shard) + ((tensor,) if tensor > 1 else ()), 1  # its product checked as the tuple's


def _int(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool)


def _positive_int(n: Any) -> bool:
    return _int(n) and n >= 1

