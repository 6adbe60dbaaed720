"""Which source tensor goes into which model tensor: matching names, checking shapes, then copying slices."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_fsdp2.checkpoint.shards import copy_into
from lightning_fsdp2.checkpoint.sources import TensorSource

# peft renames a wrapped layer's weight (`q_proj.weight` -> `q_proj.base_layer.weight`), prefixes the model
# (`base_model.model.`) and keys adapters by adapter name (`lora_A.default.weight`; saved adapters drop the name).
# Comparing canonical names lets one checkpoint fit the model before and after `get_peft_model`.
_ADAPTER_CONTAINERS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "modules_to_save"}
)


def canonical_name(name: str, adapter_names: frozenset[str] = frozenset({"default"})) -> str:
    """``name`` without peft's wrapping: no ``base_model.model.`` (at the start, or after the name of the attribute
    holding the peft model), adapter-name segments, and no
    ``base_layer``/``original_module`` segments on the way to a base weight. A plain Hugging Face name is returned as
    it is.

    A ``base_layer`` followed by an adapter's own tensor stays: when peft wraps a layer twice (LoRA ``all-linear`` on
    fused MoE experts wraps the experts module and its inner projection), ``experts.base_layer.lora_A`` (the inner
    wrapper's adapter) and ``experts.lora_A`` (the outer one's) are different tensors and keep different names, as in
    peft's own saved adapters.
    """
    parts = name.split(".")
    for i in range(len(parts) - 1):  # the peft model's own wrapping, wherever it sits (`model.base_model.model.`
        if parts[i : i + 2] == ["base_model", "model"]:  # under a LightningModule holding it as `self.model`)
            parts = parts[:i] + parts[i + 2 :]
            break
    out: list[str] = []
    for i, part in enumerate(parts):
        if part in ("base_layer", "original_module") and not _ADAPTER_CONTAINERS.intersection(parts[i + 1 :]):
            continue
        if out and out[-1] in _ADAPTER_CONTAINERS and part in adapter_names:
            continue
        out.append(part)
    return ".".join(out)


def adapter_names(module: nn.Module) -> frozenset[str]:
    """The peft adapter names configured anywhere in ``module`` (always including ``"default"``)."""
    names = {"default"}
    for sub in module.modules():
        config = sub.__dict__.get("peft_config")
        if isinstance(config, dict):
            names.update(config)
    return frozenset(names)


def _peft_saved(module: nn.Module) -> Iterator[tuple[str, str, str]]:
    """For each adapter tensor peft's ``save_pretrained`` writes, from each peft model in ``module``: (the peft
    model's name in ``module``, the key peft saves it under, its name in the peft model's state dict).

    peft's own ``get_peft_model_state_dict`` makes the saved keys from the model's state dict and keeps the tensors:
    matching them by identity gives the correspondence, for every tuner, without a table of ours.
    """
    try:
        from peft import PeftModel
    except ImportError:
        return
    for prefix, sub in module.named_modules():
        if not isinstance(sub, PeftModel):
            continue
        state = sub.state_dict()
        by_id = {id(v): k for k, v in state.items()}
        for adapter in sub.peft_config:
            for key, value in peft_state_dict(sub, state, adapter).items():
                if id(value) in by_id:
                    yield prefix, key, by_id[id(value)]


def peft_state_dict(peft_model: nn.Module, state: dict[str, Tensor], adapter: str) -> dict[str, Tensor]:
    """peft's ``get_peft_model_state_dict``: the tensors of ``state`` (``peft_model``'s state dict) that peft saves
    for ``adapter``, under the keys it saves them under.

    For prompt learning peft runs the prompt encoder, unless the config is in inference mode, when it takes the
    encoder's weight: the same values for the methods allowed (see :func:`prompt_embedding_name`). Inference mode
    is set for the call (as peft's own ``save_pretrained`` does around its config), and the weight taken from
    ``state``.
    """
    from peft.utils import get_peft_model_state_dict

    prompt = prompt_embedding_name(peft_model, adapter)
    if prompt is None:
        return get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter)
    config = peft_model.peft_config[adapter]
    mode, config.inference_mode = config.inference_mode, True
    try:
        picked = get_peft_model_state_dict(peft_model, state_dict=state, adapter_name=adapter)
    finally:
        config.inference_mode = mode
    return {**picked, "prompt_embeddings": state[prompt]}


def prompt_embedding_name(peft_model: nn.Module, adapter: str) -> str | None:
    """For a prompt-learning adapter, the name (in ``peft_model``'s state dict) of the tensor peft saves as
    ``prompt_embeddings``; None for the other methods.

    peft saves the prompt encoder's *output* on its virtual tokens and loads it back into the encoder's embedding
    weight. For prompt tuning, and prefix tuning without ``prefix_projection``, that output is the embedding weight
    itself (its rows in order), so the weight is what is gathered and what is loaded. Other prompt-learning methods
    (p-tuning, projected prefixes) save the output of a network that loading does not restore: refused.
    """
    config = peft_model.peft_config[adapter]
    if not getattr(config, "is_prompt_learning", False):
        return None
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind == "PROMPT_TUNING" or (kind == "PREFIX_TUNING" and not getattr(config, "prefix_projection", False)):
        return f"prompt_encoder.{adapter}.embedding.weight"
    raise ValueError(
        f"peft adapter {adapter!r} is {kind}{' with prefix_projection' if kind == 'PREFIX_TUNING' else ''}: peft saves"
        " the output of its prompt encoder, which loading does not turn back into the encoder's weights, so it cannot"
        " be saved or loaded sharded. Use PromptTuningConfig, or PrefixTuningConfig(prefix_projection=False)."
    )


def peft_saved(module: nn.Module, adapters: frozenset[str]) -> tuple[dict[str, str], set[str]]:
    """How peft's ``save_pretrained`` writes the adapters of the peft models in ``module``: (the canonical name it
    writes a tensor under -> the tensor's canonical name in the model, where the two differ: DoRA's
    ``lora_magnitude_vector`` without ``.weight``, IA3's ``ia3_l`` without the adapter name, ``modules_to_save`` under
    the original layer's name, ...; the names, relative to ``module``, of the parameters it writes)."""
    renamed: dict[str, str] = {}
    written: set[str] = set()
    for prefix, saved, name in _peft_saved(module):
        renamed.setdefault(canonical_name(saved, adapters), canonical_name(name, adapters))
        written.add(f"{prefix}.{name}" if prefix else name)
    return {k: v for k, v in renamed.items() if k != v}, written


def is_adapter_key(name: str) -> bool:
    """Whether a checkpoint key names a peft adapter tensor: a segment is one of the adapter layer names peft's
    tuner layers declare (``lora_A``, ``ia3_l``, ``hada_w1_a``, ...), ``modules_to_save``, or prompt learning's."""
    return bool(_adapter_segments().intersection(name.split("."))) or name.startswith("prompt_encoder.") \
        or ".prompt_encoder." in name or name == "prompt_embeddings"


@functools.cache
def _adapter_segments() -> frozenset[str]:
    names = set(_ADAPTER_CONTAINERS)
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return frozenset(names)
    classes = [BaseTunerLayer]
    while classes:
        cls = classes.pop()
        names.update(getattr(cls, "adapter_layer_names", ()))
        classes.extend(cls.__subclasses__())
    return frozenset(names)


def adapter_tensors(module: nn.Module) -> set[str]:
    """Names of the tensors peft added to ``module``: everything inside a peft tuner layer except its base layer,
    every name with a LoRA or ``modules_to_save`` segment, and the prompt encoders of prompt learning. Whatever the
    tuner (LoRA, IA3, ...)."""
    names = {n for n, _ in module.named_parameters() if any(p in _ADAPTER_CONTAINERS for p in n.split("."))}
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return names
    for prefix, sub in module.named_modules():
        if isinstance(sub, PeftModel):  # prompt learning: the virtual tokens' encoder, beside the base model
            lead = f"{prefix}.prompt_encoder." if prefix else "prompt_encoder."
            encoder = sub._modules.get("prompt_encoder")  # absent for the other tuners
            if encoder is not None:
                names.update(lead + name for name, _ in encoder.named_parameters())
        if isinstance(sub, BaseTunerLayer):
            for name, _ in sub.named_parameters():
                if not name.startswith(("base_layer.", "original_module.")):
                    names.add(f"{prefix}.{name}" if prefix else name)
    return names


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
    ignorable = {rename_target(n) for n, _ in module.named_buffers(remove_duplicate=False)}  # non-persistent ones
    plan.unexpected = [k for k in source.keys() if k not in used and rename_source(k) not in ignorable]
    return plan


def run_plan(module: nn.Module, source: TensorSource, plan: LoadPlan) -> None:
    """Copy every planned tensor's slice into ``module``, in file order."""
    tensors: dict[str, Tensor] = dict(module.named_parameters()) | dict(module.named_buffers())
    for name, key in sorted(plan.copies.items(), key=lambda item: source.where(item[1])):
        copy_into(tensors[name], source, key)


def listing(names: list[str], limit: int = 20) -> str:
    """``'a', 'b' and 3 more``: names for an error message."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
