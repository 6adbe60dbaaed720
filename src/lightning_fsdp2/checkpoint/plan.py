"""Which source tensor goes into which model tensor: matching names, checking shapes, then copying slices."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_fsdp2.checkpoint.shards import copy_into
from lightning_fsdp2.checkpoint.sources import TensorSource

def align_prefixes(source: Iterable[str], target: Iterable[str]) -> tuple[str, str]:
    """The prefix to strip from source names, or from target names, so that the most names match.

    A base model's checkpoint (``layers.0...``) fits its ``...ForCausalLM`` (``model.layers.0...``); a Lightning
    checkpoint's names carry the ``LightningModule`` attribute (``model.model.layers.0...``). Ties keep names as
    they are.
    """
    source, target = set(source), set(target)

    def prefixes(names: set[str]) -> set[str]:
        out = set()
        for name in names:
            parts = name.split(".")
            out.update(".".join(parts[:i]) + "." for i in range(1, min(3, len(parts))))
        return out

    def matches(strip_source: str, strip_target: str) -> int:
        return len({_strip(n, strip_source) for n in source} & {_strip(n, strip_target) for n in target})

    best, best_score = ("", ""), matches("", "")
    for candidate in [(p, "") for p in prefixes(source)] + [("", p) for p in prefixes(target)]:
        score = matches(*candidate)
        if score > best_score:
            best, best_score = candidate, score
    return best


def _strip(name: str, prefix: str) -> str:
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


@dataclass
class LoadPlan:
    """Which source tensor goes into which of the model's tensors (names relative to the module loaded into)."""

    copies: dict[str, str] = field(default_factory=dict)  # model name -> source key
    missing: list[str] = field(default_factory=list)  # model tensors the source does not cover
    unexpected: list[str] = field(default_factory=list)  # source keys that fit nothing in the model
    mismatched: list[str] = field(default_factory=list)  # descriptions of shape mismatches
    mistyped: list[str] = field(default_factory=list)  # descriptions of integer/bool <-> floating-point pairs


def loadable_tensors(module: nn.Module) -> dict[str, list[str]]:
    """Parameters and persistent buffers: first name -> all names it goes by (tied weights have several)."""
    non_persistent = {
        f"{prefix}.{b}" if prefix else b
        for prefix, sub in module.named_modules()
        for b in getattr(sub, "_non_persistent_buffers_set", ())
    }
    aliases: dict[int, list[str]] = {}
    tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        if name not in non_persistent:
            aliases.setdefault(id(tensor), []).append(name)
    return {names[0]: names for names in aliases.values()}


def tied_aliases(module: nn.Module, state: dict) -> dict[str, str]:
    """For the keys of ``state`` that are a second name of a tied weight, the key of its first name (also in
    ``state``): what ``gather_to_rank0(..., same_as=...)`` needs to send a tied weight once."""
    return {
        alias: names[0]
        for names in loadable_tensors(module).values()
        if names[0] in state
        for alias in names[1:]
        if alias in state
    }


def plan_load(
    module: nn.Module,
    source: TensorSource,
    *,
    rename_source: Callable[[str], str] | None = None,
    rename_target: Callable[[str], str] | None = None,
) -> LoadPlan:
    """Match the source's keys to ``module``'s parameters and persistent buffers, checking shapes.

    The ``rename_*`` functions map each side to the names compared (default: exact names). A tied weight is loaded
    once, from the first of its names the source holds; the source's keys for its other names are not unexpected.
    Non-persistent buffers are never loaded (no single-device checkpoint holds them), but a source that has them
    is not faulted for it.
    """
    rename_source = rename_source or (lambda name: name)
    rename_target = rename_target or (lambda name: name)
    index: dict[str, str] = {}
    for key in source.keys():
        index.setdefault(rename_source(key), key)
    tensors: dict[str, Tensor] = dict(module.named_parameters()) | dict(module.named_buffers())
    plan = LoadPlan()
    used: set[str] = set()
    groups = {name: [rename_target(a) for a in aliases] for name, aliases in loadable_tensors(module).items()}
    all_names = {w: wanted for wanted in groups.values() for w in wanted}  # a name -> every name of its tensor
    for name, wanted in groups.items():
        # A peft `modules_to_save` copy starts as the base module's weights when the source has no copy of its own;
        # under any name of that weight (a copied head tied to the embedding is in the checkpoint as the embedding).
        originals = [".".join(p for p in w.split(".") if p != "modules_to_save") for w in wanted if "modules_to_save" in w]
        wanted = wanted + [n for w in originals for n in all_names.get(w, [w])]
        found = [index[w] for w in wanted if w in index]
        used.update(found)
        if not found:
            plan.missing.append(name)
            continue
        key = found[0]
        expected, actual = tuple(tensors[name].shape), source.shape(key)
        if expected != actual:
            plan.mismatched.append(
                f"{key!r} has shape {actual} in {source.where(key)} but {name!r} has shape {expected} in the model"
            )
            continue
        plan.copies[name] = key
        stored, wanted_dtype = source.dtype(key), tensors[name].dtype
        if stored is not None and _is_float(stored) != _is_float(wanted_dtype):
            plan.mistyped.append(f"{key!r} is {str(stored).removeprefix('torch.')} in {source.where(key)} but"
                                 f" {name!r} is {str(wanted_dtype).removeprefix('torch.')} in the model")
    ignorable = {rename_target(n) for n, _ in module.named_buffers(remove_duplicate=False)}  # non-persistent ones
    plan.unexpected = [k for k in source.keys() if k not in used and rename_source(k) not in ignorable]
    return plan


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def run_plan(module: nn.Module, source: TensorSource, plan: LoadPlan, *, check_finite: bool = False) -> list[str]:
    """Copy every planned tensor's slice into ``module``, in file order; with ``check_finite``, return the names of
    the parameters whose slice on this rank holds a NaN or an infinity (buffers may: a mask of ``-inf``)."""
    tensors: dict[str, Tensor] = dict(module.named_parameters()) | dict(module.named_buffers())
    parameters = {name for name, _ in module.named_parameters()}
    non_finite = []
    for name, key in sorted(plan.copies.items(), key=lambda item: source.where(item[1])):
        local = copy_into(tensors[name], source, key)
        if (check_finite and name in parameters and local is not None and _is_float(local.dtype)
                and not torch.isfinite(local).all()):
            non_finite.append(name)
    return non_finite


def listing(names: list[str], limit: int = 20) -> str:
    """``'a', 'b' and 3 more``: names for an error message."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
