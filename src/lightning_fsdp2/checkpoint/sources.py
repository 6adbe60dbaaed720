"""Named tensors in files or in memory, read one slice at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, Union

import torch
from torch import Tensor

from lightning_fsdp2.checkpoint.files import CheckpointFileError, load_torch_file, missing_checkpoint, reading

PretrainedSource = Union[str, os.PathLike, Mapping[str, Tensor]]
"""A Hugging Face model directory, a ``.safetensors``/``.bin``/``.pt``/``.ckpt`` file, or a state dict."""


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "BOOL": torch.bool, "C64": torch.complex64,
}
"""safetensors' header dtype names (``get_slice(key).get_dtype()``) as torch dtypes."""


class TensorSource(Protocol):
    """Named tensors whose shapes are known up front and whose values are read a slice at a time."""

    def keys(self) -> list[str]:
        """The tensor names."""
        ...

    def shape(self, key: str) -> tuple[int, ...]:
        """The whole tensor's shape."""
        ...

    def dtype(self, key: str) -> torch.dtype | None:
        """The stored dtype (``None`` where the file's type has no torch equivalent)."""
        ...

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        """The part ``tensor[index]`` of the tensor, reading no more than that."""
        ...

    def where(self, key: str) -> str:
        """The file (or description) the tensor comes from, for error messages."""
        ...


class StateDictSource:
    """Tensors in memory, or ``mmap``-ed by ``torch.load(mmap=True)`` (slicing touches only those pages)."""

    def __init__(self, tensors: Mapping[str, Any], origin: str) -> None:
        self._tensors = {k: v for k, v in tensors.items() if isinstance(v, Tensor)}
        self._origin = origin

    def keys(self) -> list[str]:
        """The tensor names."""
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        """The whole tensor's shape."""
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype | None:
        """The tensor's dtype."""
        return self._tensors[key].dtype

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        """A view of ``tensor[index]``; the copy into a shard reads only its pages."""
        return self._tensors[key][index]

    def where(self, key: str) -> str:
        """Where the tensors came from."""
        return self._origin


class SafetensorsSource:
    """One or more safetensors files, read a slice at a time.

    Each read maps the file, copies out only the requested slice and unmaps it again. Mapped pages count towards a
    process's resident memory for as long as the mapping lives; keeping one file mapped for the whole load would
    add up to this rank's share of that file on top of its shards. Re-opening costs one header parse per tensor.
    """

    def __init__(self, files: dict[str, Path]) -> None:
        from safetensors import safe_open

        self._files = files  # key -> file
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for path in sorted(set(files.values())):
            with reading(path), safe_open(str(path), framework="pt") as f:
                names = set(f.keys())
                for key, where in files.items():
                    if where == path:
                        if key not in names:
                            raise CheckpointFileError(f"{path} does not hold {key!r}, which its index says it does.")
                        piece = f.get_slice(key)
                        self._shapes[key] = tuple(piece.get_shape())
                        self._dtypes[key] = piece.get_dtype()

    def keys(self) -> list[str]:
        """The tensor names."""
        return list(self._files)

    def shape(self, key: str) -> tuple[int, ...]:
        """The whole tensor's shape, from the file's header."""
        return self._shapes[key]

    def dtype(self, key: str) -> torch.dtype | None:
        """The stored dtype, from the file's header."""
        return _SAFETENSORS_DTYPES.get(self._dtypes[key])

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        """``tensor[index]`` through safetensors ``get_slice``: only those bytes are read from the file."""
        from safetensors import safe_open

        path = self._files[key]
        with reading(path), safe_open(str(path), framework="pt") as f:
            if not index:  # a 0-d tensor: nothing to slice
                return f.get_tensor(key)
            return f.get_slice(key)[index]

    def where(self, key: str) -> str:
        """The file holding ``key``."""
        return str(self._files[key])

    def files(self) -> list[Path]:
        """The files read, in order."""
        return sorted(set(self._files.values()))


def safetensors_files(source: TensorSource) -> list[Path]:
    """The safetensors files ``source`` reads (none for other formats), for verifying their checksums."""
    return source.files() if isinstance(source, (SafetensorsSource, ConvertedSource)) else []


def open_source(source: PretrainedSource) -> TensorSource:
    """Open a state dict, a checkpoint file or a Hugging Face model directory for slice-wise reading."""
    if isinstance(source, Mapping):
        return StateDictSource(_model_weights(source), "the given state dict")
    path = Path(source)
    if path.is_dir():
        return _open_directory(path)
    if not path.exists():
        raise missing_checkpoint(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with reading(path), safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
        return SafetensorsSource(dict.fromkeys(keys, path))
    if path.name.endswith(".index.json"):
        return _open_index(path)
    return StateDictSource(_model_weights(load_torch_file(path)), str(path))


def _model_weights(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """A Lightning checkpoint's ``state_dict``; a Fabric checkpoint's one module (``{"model": {name: tensor},
    "optimizer": ..., "step": ...}``: the only entry that is a mapping of tensors, beside no tensor of its own); else
    the mapping itself."""
    if isinstance(obj.get("state_dict"), Mapping) and "pytorch-lightning_version" in obj:
        return obj["state_dict"]
    modules = [v for v in obj.values() if isinstance(v, Mapping) and v and all(isinstance(t, Tensor) for t in v.values())]
    if len(modules) == 1 and not any(isinstance(v, Tensor) for v in obj.values()):
        return modules[0]
    return obj


def _open_directory(path: Path) -> TensorSource:
    names = [
        "model.safetensors.index.json",
        "model.safetensors",
        "pytorch_model.bin.index.json",
        "pytorch_model.bin",
        "adapter_model.safetensors",
        "adapter_model.bin",
    ]
    for name in names:
        if (path / name).is_file():
            return open_source(path / name)
    present = sorted(p.name for p in path.iterdir())[:10]
    raise FileNotFoundError(
        f"{path} holds no model weights: expected model.safetensors, model.safetensors.index.json,"
        f" pytorch_model.bin or pytorch_model.bin.index.json (found {present})."
    )


def _open_index(index: Path) -> TensorSource:
    with reading(index):
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    # Every entry must be a plain relative path (no `..`) to a file inside the index's directory. The directory is
    # resolved, the entry only normalised: the files of a Hugging Face cache snapshot are links to blobs outside it.
    root = Path(os.path.realpath(index.parent))
    for key, name in weight_map.items():
        relative = isinstance(name, str) and name != "" and not os.path.isabs(name) and ".." not in Path(name).parts
        target = Path(os.path.normpath(root / name)) if relative else root
        if target == root or not target.is_relative_to(root):
            raise CheckpointFileError(
                f"{index} maps {key!r} to {name!r}, which is not a file inside {index.parent}: the index may be"
                " malicious. Refusing to read it."
            )
    files = {key: index.parent / name for key, name in weight_map.items()}
    missing = sorted({str(f) for f in files.values() if not f.is_file()})
    if missing:
        raise FileNotFoundError(f"{index} lists files that do not exist: {missing}.")
    if all(f.suffix == ".safetensors" for f in files.values()):
        return SafetensorsSource(files)
    tensors: dict[str, Tensor] = {}
    for file in sorted(set(files.values())):
        tensors.update(load_torch_file(file))
    return StateDictSource(tensors, str(index))


class ConvertedSource:
    """A source seen through transformers' own checkpoint conversions for ``model``: what ``from_pretrained`` reads.

    transformers 5 converts some checkpoints while loading them: renamed keys, and MoE experts stored one tensor per
    expert on disk but fused into one tensor in memory (``experts.*.gate_proj.weight`` + ``experts.*.up_proj.weight``
    -> ``experts.gate_up_proj``). Its ``conversion_mapping`` lists those transforms for each model; here the same
    transforms rename the source's keys (``core_model_loading.rename_source_key``) and build each fused tensor with
    the converter's own operations. A renamed tensor is read a slice at a time as before. A fused tensor of stacked
    experts is built from the experts of the slice asked for (each rank reads only its experts' tensors); any other
    fused tensor is built whole on each rank that needs part of it, then sliced.
    """

    def __init__(self, source: TensorSource, model: Any) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        self._source = source
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._renamed: dict[str, str] = {}  # target -> source key
        self._fused: dict[str, tuple[Any, list[tuple[str, str]]]] = {}  # target -> (converter, [(pattern, key)])
        for key in sorted(source.keys(), key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters)
            if pattern is None:
                self._renamed.setdefault(target, key)
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            self._fused.setdefault(target, (converter, []))[1].append((pattern, key))
        self._shapes = {t: tuple(source.shape(k)) for t, k in self._renamed.items()}
        for target in self._fused:  # the fused shape, from the converter's operations on meta tensors
            self._shapes[target] = tuple(self._build(target, meta=True).shape)

    @property
    def converts(self) -> bool:
        """Whether any key is renamed or fused (else the plain source serves as well)."""
        return bool(self._fused) or any(t != k for t, k in self._renamed.items())

    def keys(self) -> list[str]:
        """The converted names."""
        return [*self._renamed, *self._fused]

    def describe(self) -> str:
        """What the conversions did, with an example of each kind: for error messages, whose source names are the
        converted ones."""
        renamed = [(t, k) for t, k in self._renamed.items() if t != k]
        parts = []
        if renamed:
            parts.append(f"{len(renamed)} renamed (e.g. {renamed[0][1]!r} -> {renamed[0][0]!r})")
        if self._fused:
            target, (_, fused) = next(iter(self._fused.items()))
            parts.append(
                f"{len(self._fused)} fused from {sum(len(p) for _, p in self._fused.values())} stored tensors"
                f" (e.g. {fused[0][1]!r} and {len(fused) - 1} more -> {target!r})"
            )
        return (
            "The source's names above are those after transformers' checkpoint conversions for this model, as"
            f" from_pretrained reads them: {' and '.join(parts)}"
        )

    def shape(self, key: str) -> tuple[int, ...]:
        """The converted tensor's shape."""
        return self._shapes[key]

    def dtype(self, key: str) -> torch.dtype | None:
        """The converted tensor's dtype (of a fused one, what the converter's operations make of the stored ones)."""
        if key in self._renamed:
            return self._source.dtype(self._renamed[key])
        return self._build(key, meta=True).dtype

    def read(self, key: str, index: tuple[slice, ...]) -> Tensor:
        """``tensor[index]``: a slice of a renamed tensor; of a fused tensor, built from the experts in the slice
        when the fusion stacks experts along dim 0 (FSDP2 shards dim 0, so a rank reads only its experts), else built
        whole."""
        if key in self._renamed:
            return self._source.read(self._renamed[key], index)
        if index and self._stacks_experts(key):
            first = index[0]
            experts = range(self._shapes[key][0])[first]
            if len(experts) > 0 and first.step in (None, 1):
                rest = (slice(None), *index[1:])
                return self._build(key, experts=slice(experts.start, experts.stop))[rest]
        return self._build(key)[index]

    def files(self) -> list[Path]:
        """The safetensors files of the converted source (see :func:`safetensors_files`)."""
        return safetensors_files(self._source)

    def where(self, key: str) -> str:
        """Where the tensor (or the first of those it is fused from) comes from."""
        return self._source.where(self._renamed[key] if key in self._renamed else self._fused[key][1][0][1])

    def _stacks_experts(self, target: str) -> bool:
        """Whether the fused tensor's dim 0 is the list of experts, untouched by the later operations: its first
        operation stacks one tensor per expert along a new dim 0 (``MergeModulelist(dim=0)``) and the others
        concatenate along other dims (gate and up projections side by side). Then rows ``a:b`` of the result are the
        same operations on experts ``a:b`` alone."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        first, *rest = self._fused[target][0].operations or [None]
        return (
            type(first) is MergeModulelist and first.dim == 0
            and all(type(op) is Concatenate and op.dim != 0 for op in rest)
        )

    def _build(self, target: str, meta: bool = False, experts: slice | None = None) -> Tensor:
        import copy

        converter, parts = self._fused[target]
        if experts is not None:  # of each pattern's tensors (one per expert, in expert order), those in the slice
            by_pattern: dict[str, list[tuple[str, str]]] = {}
            for pattern, key in parts:
                by_pattern.setdefault(pattern, []).append((pattern, key))
            parts = [part for group in by_pattern.values() for part in group[experts]]
        converter = copy.copy(converter)  # its tensor collections are per use
        converter.collected_tensors = type(converter.collected_tensors)(list)
        converter.layer_targets = type(converter.layer_targets)(set)

        def reader(key: str) -> Any:
            shape = self._source.shape(key)
            if meta:
                return lambda: torch.empty(shape, device="meta", dtype=self._source.dtype(key) or torch.float32)
            return lambda: self._source.read(key, tuple(slice(0, n) for n in shape))

        for pattern, key in parts:
            converter.add_tensor(target, key, pattern, reader(key))
        (tensor,) = converter.convert(target).values()
        return tensor
