"""QLoRA's frozen base: linear weights stored in 4-bit NF4 (torchao's ``NF4Tensor``), quantized as they are loaded.

``load_pretrained(model, source, quantize="nf4")`` names the weights; when the model is sharded
(:func:`shard_quantizing`, one step of ``parallel.parallelize``), just before the ``fully_shard`` of each group, that
group's weights are read whole from the source (one at a time: at most one tensor in high precision), cast to the
parameter's dtype, quantized by torchao's ``to_nf4`` and put in place of the parameter.
The ranks share the work: each reads and quantizes every N-th weight of the group and broadcasts the NF4 bytes.
``fully_shard`` then splits the quantized tensor along dim 0 at block boundaries (torchao implements the split FSDP2
uses), so every rank keeps only its shard of the very bytes one process would hold: quantizing each whole tensor
once and sharding the result is what makes world size N identical to one process (NF4's double quantization has a
per-tensor mean, so quantizing slices separately would differ). Beyond its shards, each rank holds one group's
whole NF4 weights at a time (about a quarter of their bf16 bytes), never the whole NF4 base.

torchao is an optional dependency: ``pip install lightning-fsdp2[qlora]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_fsdp2.peft_support import adapter_tensors
from lightning_fsdp2.wrap import Where, shard_groups, shard_model

QUANTIZATIONS = ("nf4",)
NF4_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
__all__ = ["is_nf4", "nf4_misfits"]


def nf4_module() -> Any:
    """torchao's NF4 module (``to_nf4``, ``NF4Tensor``), or an ImportError naming the extra that installs it."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as err:
        raise ImportError(
            "load_pretrained(..., quantize='nf4') stores the base in torchao's NF4Tensor, but torchao is not"
            " installed. Install the extra: `pip install lightning-fsdp2[qlora]` (or `pip install torchao`)."
        ) from err
    return nf4_tensor


def check_quantize(quantize: str | None, skip: Sequence[str]) -> None:
    """Refuse an unknown ``quantize`` (and, for ``"nf4"``, a missing torchao) when ``load_pretrained`` is called."""
    if quantize is None:
        return
    if quantize not in QUANTIZATIONS:
        raise ValueError(f"load_pretrained(quantize={quantize!r}): the supported quantization is 'nf4' (or None).")
    if isinstance(skip, str):
        raise TypeError(f"load_pretrained(skip={skip!r}) takes a list of module names, e.g. skip=['mlp.down_proj'].")
    nf4_module()


def is_nf4(tensor: Tensor) -> bool:
    """Whether ``tensor`` (or a ``DTensor``'s local shard) is an NF4 tensor."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return type(local).__name__ == "NF4Tensor"


def nf4_targets(module: nn.Module, candidates: Sequence[str], skip: Sequence[str]) -> list[str]:
    """Of ``candidates`` (parameter names relative to ``module`` that a load covers), the ``nn.Linear`` weights to
    quantize: not peft's adapters, not the output head (the ``get_output_embeddings()`` of a Hugging Face model, or
    a module named ``lm_head``), not in a module whose name ends with one of ``skip`` (as transformers'
    ``modules_to_not_convert``)."""
    adapters = adapter_tensors(module)
    heads = {id(m) for m in _output_heads(module)}
    linear = {
        f"{name}.weight" if name else "weight": name
        for name, sub in module.named_modules()
        if isinstance(sub, nn.Linear) and id(sub) not in heads and name.rsplit(".", 1)[-1] != "lm_head"
    }
    clean = [s.strip(".") for s in skip]

    def skipped(module_name: str) -> bool:
        return any(module_name == s or module_name.endswith(f".{s}") or f".{s}." in f".{module_name}." for s in clean)

    return [n for n in candidates if n in linear and n not in adapters and not skipped(linear[n])]


def nf4_misfits(module: nn.Module, shard_size: int) -> list[str]:
    """The short names (``"q_proj"``) of the linear layers whose weights NF4 cannot split evenly over ``shard_size``
    ranks (their elements a multiple of 16,384 x ``shard_size``, their rows of ``shard_size``), among those
    ``quantize="nf4"`` would quantize: ``load_pretrained(model, source, quantize="nf4", skip=nf4_misfits(model,
    world_size))`` quantizes the rest. A weight that fits over N ranks fits over any divisor of N (replicas, HSDP's
    smaller shard groups), so the world size is the safe ``shard_size`` before the layout is known. Works on a model
    on ``meta``."""
    weights = {f"{name}.weight" if name else "weight": name for name, sub in module.named_modules()
               if isinstance(sub, nn.Linear)}
    params = dict(module.named_parameters())
    misfits = set()
    for weight in nf4_targets(module, list(weights), ()):
        if not _fits_nf4(tuple(params[weight].shape), shard_size):
            parts = weights[weight].split(".")
            while len(parts) > 1 and parts[-1] == "base_layer":  # peft's: named by the layer it adapts
                parts.pop()
            misfits.add(parts[-1])
    return sorted(misfits)


def _output_heads(module: nn.Module) -> list[nn.Module]:
    heads = []
    for sub in module.modules():
        get = getattr(sub, "get_output_embeddings", None)
        if callable(get) and hasattr(sub, "config"):
            try:
                head = get()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(head, nn.Module):
                heads.append(head)
    return heads


def check_nf4_targets(
    module: nn.Module,
    names: Sequence[str],
    shapes: dict[str, tuple[int, ...]],
    world_size: int,
    require_frozen: bool = True,
) -> None:
    """Raise one short error for the weights that cannot be stored in NF4 here, grouped by cause: trainable (NF4
    weights are frozen; peft's ``get_peft_model`` freezes the base), of a dtype ``to_nf4`` does not take, or of a
    shape NF4's blocks cannot split into ``world_size`` equal shards (with, per shape, the smallest one that fits and
    the world sizes that would take it). Called before anything is allocated; the same on every rank."""
    if not names:
        return  # nothing to quantize: torchao is not needed (it is an optional dependency)
    nf4_module()
    params = dict(module.named_parameters())
    trainable = [n for n in names if params[n].requires_grad and require_frozen]
    dtypes = [n for n in names if n not in trainable and params[n].dtype not in NF4_DTYPES]
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for name in names:
        if name not in trainable and name not in dtypes and not _fits_nf4(shapes[name], world_size):
            by_shape.setdefault(tuple(shapes[name]), []).append(name)
    bad = trainable + dtypes + [n for group in by_shape.values() for n in group]
    if not bad:
        return
    problems = []
    if trainable:
        problems.append(f"{_are(trainable)} trainable (NF4 weights are frozen: wrap the model with peft's"
                        " get_peft_model, which freezes the base, or set requires_grad=False)")
    if dtypes:
        kinds = sorted({str(params[n].dtype) for n in dtypes})
        problems.append(f"{_are(dtypes)} {'/'.join(kinds)}; torchao's to_nf4 takes float32, bfloat16 or float16")
    if by_shape:
        block = _BLOCK_SIZE * _SCALER_BLOCK_SIZE
        shapes_said = "; ".join(f"{len(group)} of shape {shape} ({_fit_note(shape, world_size)})"
                                for shape, group in by_shape.items())
        problems.append(
            f"weights that do not split evenly into NF4 shards over {world_size} rank(s) (the shard group: the world"
            f" size, or device_mesh's shard size under HSDP): {shapes_said}; e.g."
            f" {_some([g[0] for g in by_shape.values()])}. NF4 quantizes blocks of {_BLOCK_SIZE} values with one scale"
            f" per {_SCALER_BLOCK_SIZE} blocks and FSDP2 splits each weight along dim 0, so a 2-D weight needs a"
            f" multiple of {block} x {world_size} elements and rows divisible by {world_size}"
        )
    way_out = _skip_suggestion(module, names, bad) or (
        "Fix those weights (or the shard group's size), or leave their modules out with"
        " load_pretrained(..., skip=[...])")
    if len(bad) == len(names):
        way_out = "No weight of this model can be quantized as it is: fix the above, or load without quantize='nf4'"
    raise ValueError(
        f"load_pretrained(quantize='nf4') cannot quantize {len(bad)} of {len(names)} weight(s): "
        + "; ".join(problems) + f". {way_out}."
    )


def _fits_nf4(shape: Sequence[int], world_size: int) -> bool:
    numel = 1
    for size in shape:
        numel *= size
    return len(shape) == 2 and not numel % (_BLOCK_SIZE * _SCALER_BLOCK_SIZE * world_size) and not shape[0] % world_size


def _fit_note(shape: tuple[int, ...], world_size: int) -> str:
    """Where a shape would fit and the smallest one like it that fits here, in a few words."""
    if len(shape) != 2:
        return "not 2-D"
    worlds = _worlds_that_fit(shape, world_size)
    numel = shape[0] * shape[1]
    where = (f"fits at {', '.join(map(str, worlds))} rank(s)" if worlds else
             f"fits at no size: its {numel} elements are not a multiple of {_BLOCK_SIZE * _SCALER_BLOCK_SIZE}")
    return f"{where}; the smallest with its columns that fits here: {_smallest_fit(shape, world_size)}"


def _smallest_fit(shape: tuple[int, ...], world_size: int) -> tuple[int, int]:
    """The 2-D shape with ``shape``'s columns and the fewest rows (at least its own) that NF4 splits over
    ``world_size`` ranks: rows a multiple of the world size and of what makes rows x columns a multiple of NF4's
    per-rank blocks."""
    rows, cols = shape[0], shape[1]
    step = _BLOCK_SIZE * _SCALER_BLOCK_SIZE * world_size
    multiple = math.lcm(world_size, step // math.gcd(step, cols))
    return (-(-rows // multiple) * multiple, cols)


def _skip_suggestion(module: nn.Module, names: Sequence[str], bad: Sequence[str]) -> str | None:
    """A ``skip`` that leaves out exactly the failing weights' modules and keeps some weights quantized, checked with
    :func:`nf4_targets`' own matching: short names first (``down_proj``; a peft ``base_layer`` is named by its
    adapted layer), else the modules' full names; None if neither works."""
    wrappers = {"base_layer"}  # peft's: the weight of an adapted layer lives in <layer>.base_layer

    def module_of(weight: str) -> str:
        parts = weight.split(".")[:-1]
        while parts and parts[-1] in wrappers:
            parts.pop()
        return ".".join(parts)

    full = sorted({module_of(n) for n in bad})
    for skip in (sorted({m.rsplit(".", 1)[-1] for m in full}), full):
        left = nf4_targets(module, list(names), skip)
        if left and not set(left) & set(bad):
            return (f"Fix those weights, or leave their modules out with load_pretrained(..., skip={skip!r})"
                    f" ({len(left)} weight(s) would still be quantized)")
    return None


def _worlds_that_fit(shape: tuple[int, ...], world_size: int) -> list[int]:
    return [w for w in range(1, world_size + 1) if _fits_nf4(shape, w)]


def _some(names: Sequence[str]) -> str:
    """Up to three names, then how many more: one weight per kind is enough to find the rest."""
    return ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _are(names: Sequence[str]) -> str:
    return f"{_some(names)} {'are' if len(names) > 1 else 'is'}"


def to_nf4(param: Tensor, whole: Tensor) -> Tensor:
    """``whole`` (the full values of the parameter ``param``), cast to ``param``'s dtype and quantized to NF4."""
    return nf4_module().to_nf4(whole.to(param.dtype).contiguous(), _BLOCK_SIZE, _SCALER_BLOCK_SIZE)


def put_in_place(module: nn.Module, name: str, quantized: Tensor) -> None:
    """Replace the parameter ``name`` of ``module`` by the NF4 tensor ``quantized``, frozen."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    owner._parameters[leaf] = nn.Parameter(quantized, requires_grad=False)


def broadcast_nf4(quantized: Tensor | None, src: int, device: torch.device) -> Tensor:
    """The NF4 tensor rank ``src`` quantized (``quantized`` there, ``None`` elsewhere), on every rank, as the same
    bytes: its inner tensors (codes, scales, their factors) are broadcast through torch's subclass protocol
    (``__tensor_flatten__``/``__tensor_unflatten__``), so no rank quantizes it again. Through ``device`` for
    backends that move only device memory (NCCL); the result stays in CPU memory, as a locally quantized one."""
    owner = dist.get_rank() == src
    layout: list[Any] = [None]
    if owner:
        assert quantized is not None
        names, context = quantized.__tensor_flatten__()
        inner = {n: getattr(quantized, n) for n in names}
        layout = [(context, tuple(quantized.shape), quantized.stride(),
                   [(n, tuple(t.shape), t.dtype) for n, t in inner.items()])]
    # Our own processes' metadata (shapes, dtypes, block sizes), never data from a file.
    dist.broadcast_object_list(layout, src=src, device=device if device.type != "cpu" else None)
    context, shape, stride, specs = layout[0]  # what the owner put in `layout` above
    received = {}
    for name, size, dtype in specs:
        tensor = inner[name].contiguous() if owner else torch.empty(size, dtype=dtype)
        staged = tensor if tensor.device == device else tensor.to(device)
        dist.broadcast(staged, src=src)
        received[name] = inner[name] if owner else staged.to(tensor.device)
    return quantized if owner else nf4_module().NF4Tensor.__tensor_unflatten__(received, context, shape, stride)


@dataclass(frozen=True)
class NF4Weight:
    """A weight to store in NF4: its module (``owner``) and name there, where its values are (``source[key]``), and
    its name in the model."""

    owner: nn.Module
    name: str
    source: Any  # a checkpoint.sources.TensorSource
    key: str
    full_name: str


class NF4Loads(Protocol):
    """What the sharding step needs of the planned loads (``checkpoint.pretrained.PlannedLoads``)."""

    def check_quantize(self, root: nn.Module, world_size: int, require_frozen: bool = True) -> None: ...

    def take_nf4(self, root: nn.Module, within: str = "") -> list[NF4Weight]: ...


def shard_quantizing(
    module: nn.Module, where: Where, loads: NF4Loads, shard_size: int, device: torch.device, **shard: Any
) -> set[str]:
    """``fully_shard`` ``module`` group by group (``wrap.shard_groups``, with ``shard``'s arguments), storing each
    group's NF4 weights just before its ``fully_shard``, which splits them: beyond its shards a rank holds one group's
    whole NF4 weights, never the whole base. Return the names of the weights stored in NF4. Every rank together."""
    loads.check_quantize(module, shard_size)
    if shard_size == 1:
        # With one rank per shard group (world size 1, or HSDP with `shard=1`) there is nothing to split, and
        # torchao's NF4 does not take FSDP2's single-rank all-gather (fsdp_post_all_gather receives one output): NF4
        # weights then stay plain, unmanaged by FSDP2.
        alone = quantize_weights(loads.take_nf4(module), device)
        shard_model(module, where, ignored_params={p for n, p in module.named_parameters() if n in alone}, **shard)
        return alone
    quantized: set[str] = set()
    turn = 0  # the ranks' turns go on from group to group, so the work stays spread when groups are small
    for name, _ in shard_groups(module, where, **shard):  # each group is sharded once the loop moves on
        weights = loads.take_nf4(module, within=name)
        quantized |= quantize_weights(weights, device, first_turn=turn)
        turn += len(weights)
    return quantized


def quantize_weights(weights: Sequence[NF4Weight], device: torch.device | None = None, first_turn: int = 0) -> set[str]:
    """Store ``weights`` in NF4 now: each read whole, one at a time, cast, quantized, put in place of its parameter.
    Return their names in the model.

    With a ``device``, on every rank of the process group together: rank r reads and quantizes the weights whose
    turn (``first_turn``, ``first_turn + 1``...) is r modulo the world size, and each is broadcast from the rank that
    made it, so every rank ends with the same whole NF4 tensors for 1/N of the reading and quantizing (which, at 7B,
    is most of the set-up)."""
    if not weights:  # the same on every rank: a group (or a model) with nothing to quantize needs no collective
        return set()
    shared = device is not None and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if shared else (0, 1)
    made = {}  # this rank's share, quantized first: the ranks then work at the same time
    failure: BaseException | None = None
    try:
        for i, weight in enumerate(weights, start=first_turn):
            if i % world == rank:
                shape = weight.source.shape(weight.key)
                whole = weight.source.read(weight.key, tuple(slice(None) for _ in shape))
                made[i] = to_nf4(weight.owner.get_parameter(weight.name), whole)
                del whole  # one weight in high precision at a time
    except BaseException as err:  # noqa: BLE001 - raised below, on every rank together
        failure = err
    if shared:
        assert device is not None
        # A rank that failed would never broadcast its share: the others would wait for it until the timeout.
        failed = torch.tensor([failure is not None], dtype=torch.int32, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item() and failure is None:
            raise RuntimeError(
                "load_pretrained(quantize='nf4'): another rank failed to read or quantize its share of the weights"
                " (its own error is in its output); nothing was sharded."
            )
    if failure is not None:
        raise failure
    for i, weight in enumerate(weights, start=first_turn):
        nf4 = broadcast_nf4(made.pop(i, None), i % world, device) if shared else made.pop(i)
        put_in_place(weight.owner, weight.name, nf4)
    return {weight.full_name for weight in weights}


def dequantized(tensor: Tensor) -> Tensor:
    """An NF4 tensor (or ``DTensor`` of NF4 shards) back in its original dtype; other tensors as they are. Blocks are
    independent, so each shard dequantizes to the same values as the whole tensor would."""
    from torch.distributed.tensor import DTensor

    if not is_nf4(tensor):
        return tensor
    if isinstance(tensor, DTensor):
        local = tensor.to_local().get_original_weight()
        return DTensor.from_local(local, tensor.device_mesh, tensor.placements, shape=tensor.shape,
                                  stride=tensor.stride())
    return tensor.get_original_weight()


class Dequantizing(Mapping):
    """A state dict whose NF4 tensors read back dequantized (:func:`dequantized`), one at a time as they are read:
    what ``lora.save_merged`` gathers, so that no rank holds more than one dequantized tensor beyond its shards."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self._state = state

    def __getitem__(self, key: str) -> Any:
        value = self._state[key]
        return dequantized(value) if isinstance(value, Tensor) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


# torchao's defaults (QLoRA's): 64 values per block, one fp8 scale per block, the scales quantized in blocks of 256.
_BLOCK_SIZE = 64
_SCALER_BLOCK_SIZE = 256
