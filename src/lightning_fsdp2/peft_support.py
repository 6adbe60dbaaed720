"""Everything the package knows about peft, in one place: the names peft gives tensors (and how its
``save_pretrained`` writes them), which tensors are adapters, the peft options that cannot run on a meta-built sharded
model, peft's layers as FSDP2 must treat them, and the init rules that give peft's adapters the values peft would.

peft is imported inside the functions that need it: it is an optional dependency of a model, and a model without
adapters never imports it. Nothing here imports the rest of the package but :mod:`lightning_fsdp2.layout`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fsdp2.layout import local_slice


# =============================================================================================== names
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


# =============================================================================================== support checks
def peft_configs(module: nn.Module) -> dict[str, Any]:
    """Every peft adapter's config in ``module``, by adapter name."""
    try:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:
        return {}
    configs: dict[str, Any] = {}
    for sub in module.modules():
        if isinstance(sub, (BaseTuner, PeftModel)):  # prompt learning has no tuner: its config is on the PeftModel
            configs.update(sub.peft_config)
    return configs


def check_peft_supported(module: nn.Module, training: bool) -> None:
    """Refuse, before anything is allocated, the peft options that cannot run on a meta-built sharded model (or be
    trained sharded, when ``training``).

    Each names the option and what to use instead; the configs are the same on every rank, so every rank raises.
    """
    built_on_meta = any(p.is_meta for p in module.parameters())
    for adapter, config in peft_configs(module).items():
        init = getattr(config, "init_lora_weights", True)
        if built_on_meta and not (isinstance(init, bool) or (isinstance(init, str) and init.lower() == "gaussian")):
            # PiSSA, OLoRA, LoftQ, EVA, CorDA, LoRA-GA, ... compute the adapters from the base weights (an SVD, a QR)
            # and rewrite the base; "orthogonal" draws them jointly from one whole random matrix. Either needs whole
            # real tensors when `get_peft_model` runs, which sees meta tensors here.
            raise ValueError(
                f"peft adapter {adapter!r} uses init_lora_weights={init!r}, which peft computes from whole weights"
                " when get_peft_model runs (the base weights, or one whole random matrix); on a meta-built sharded"
                " model there are none yet. Build the model for real (FSDP2Strategy(meta_init=False)) and call"
                " load_pretrained before get_peft_model, or use init_lora_weights=True or 'gaussian'."
            )
        prompt_init = getattr(config, "prompt_tuning_init", None)
        prompt_init = str(getattr(prompt_init, "value", prompt_init))
        if built_on_meta and prompt_init.upper() not in ("NONE", "RANDOM") and not config.inference_mode:
            # peft reads the word embeddings at construction (`TEXT`, `SAMPLE_VOCAB`; not in inference mode): meta
            # here, so the prompt would silently start at random.
            raise ValueError(
                f"peft adapter {adapter!r} uses prompt_tuning_init={prompt_init!r}, which copies word embeddings when"
                " get_peft_model runs; on a meta-built sharded model they are not loaded yet. Use"
                " prompt_tuning_init='RANDOM', or build the model for real (FSDP2Strategy(meta_init=False)) and call"
                " load_pretrained before get_peft_model."
            )
        if training and getattr(config, "peft_type", None) == "ADALORA":
            # AdaLoraModel.forward adds a regularization computed from every lora_A/lora_B *after* the model's
            # forward pass (whenever it returns a loss, even with orth_reg_weight=0), when FSDP2 has resharded them:
            # each rank holds its slice only, and peft's code fails on it.
            raise ValueError(
                f"AdaLoRA adapter {adapter!r} cannot be trained sharded: peft's AdaLoraModel.forward computes its"
                " orthogonal regularization from the whole lora_A/lora_B after the forward pass, when FSDP2 holds"
                " only each rank's slice. Train AdaLoRA with another strategy (e.g. 'ddp'); FSDP2Strategy initializes,"
                " loads, evaluates and exports it."
            )


def untrainable_reason(module: nn.Module) -> str | None:
    """Why nothing in ``module`` is trainable, when the reason is its peft adapters made in inference mode
    (``PeftConfig.from_pretrained`` returns the saved config, with ``inference_mode=True``); else ``None``. Without
    this the run ends in torch's bare "optimizer got an empty parameter list", or trains nothing silently."""
    if any(p.requires_grad for p in module.parameters()):
        return None
    configs = [getattr(sub, "peft_config", None) for sub in module.modules()]
    frozen = sorted({name for config in configs if isinstance(config, Mapping)
                     for name, c in config.items() if getattr(c, "inference_mode", False)})
    if not frozen:
        return None
    return (
        f"Nothing in {type(module).__name__} is trainable: its peft adapter(s) {frozen} were made with"
        " inference_mode=True (what PeftConfig.from_pretrained / LoraConfig.from_pretrained return for saved"
        " adapters), which freezes them, and the base is frozen too. Set `config.inference_mode = False` before"
        " `get_peft_model`, or load saved adapters with `lightning_fsdp2.lora.load_adapter` into a model made from a"
        " fresh config."
    )


# =============================================================================================== layers
def is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft tuner layer (a base layer wrapped with its adapters, e.g. ``lora.Linear``)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return isinstance(module, BaseTunerLayer)


def is_peft_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer peft put in place of the model's: a tuner layer, or a wrapper holding a trained
    copy of it (``modules_to_save``)."""
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:
        return is_tuner_layer(module)
    return is_tuner_layer(module) or isinstance(module, AuxiliaryTrainingWrapper)


def names_inside_adapter_layers(model: nn.Module) -> set[str]:
    """Qualified names of the modules strictly below a peft tuner layer (e.g. ``...q_proj.lora_A.default``)."""
    inside: set[str] = set()
    for name, module in model.named_modules():
        if is_tuner_layer(module):
            inside.update(f"{name}.{sub}" for sub, _ in module.named_modules() if sub)
    return inside


def check_tensor_parallel_adapter(layer: nn.Module, name: str, style: Any) -> None:
    """Refuse, before anything is allocated, a peft layer on a layer the tensor-parallel plan splits that peft's TP
    code does not split with it: anything but LoRA (no DoRA, no LoRA on embeddings) behind a ``"colwise"`` or
    ``"rowwise"`` base."""
    from peft.tuners.lora import Linear as LoraLinear

    dora = isinstance(layer, LoraLinear) and any(layer.use_dora.values())
    if isinstance(layer, LoraLinear) and style in ("colwise", "rowwise") and not dora:
        return
    if isinstance(layer, LoraLinear) and not dora and not isinstance(style, str):
        raise ValueError(
            f"{name}: a LoRA layer is given a torch ParallelStyle ({type(style).__name__}) in tensor_parallel_plan; its"
            " adapters are split by peft's TP code, which follows transformers' styles: give it by name, 'colwise' or"
            " 'rowwise'."
        )
    what = "DoRA" if dora else ("LoRA" if isinstance(layer, LoraLinear) else f"peft's {type(layer).__name__}")
    raise ValueError(
        f"{name}: {what} on a layer the tensor-parallel plan splits ({style!r}) is not supported; peft splits LoRA"
        " adapters (without DoRA) behind 'colwise' and 'rowwise' layers only. Leave this layer out of the adapter's"
        " target_modules, or out of the plan (tensor_parallel_plan={...} without it)."
    )


def shard_lora_adapters(layer: nn.Module, style: str, mesh: Any, name: str) -> None:
    """Split ``layer``'s LoRA adapters as peft does behind a tensor-parallel base (``add_lora_tp_hooks_dtensor``):
    behind a colwise base (output features split) ``lora_B`` is split the same way and ``lora_A`` stays whole;
    behind a rowwise base (input features split) ``lora_A`` is split and ``lora_B`` stays whole, so the adapter's
    output has the base's layout and the two add up."""
    from peft.tuners.lora.model import add_lora_tp_hooks_dtensor

    half = "lora_B" if style == "colwise" else "lora_A"
    for adapter, module in getattr(layer, half).items():
        add_lora_tp_hooks_dtensor(module, style, mesh, base_layer=layer.get_base_layer(),
                                  module_name=f"{name}.{half}.{adapter}")


# =============================================================================================== init rules
def modules_holding(module: nn.Module, materialized: set[str]) -> set[str]:
    """Names of modules with a materialized tensor at or below them."""
    holders: set[str] = set()
    for name in materialized:
        parts = name.split(".")[:-1]
        holders.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    return holders


def peft_lora_rule(module: nn.Module, materialized: set[str]) -> None:
    """Initialize LoRA adapters as peft does, with each adapter's own ``init_lora_weights`` setting (AdaLoRA too, with
    its own ``reset_lora_parameters`` and its rank counter)."""
    try:
        from peft.tuners.adalora import AdaLoraLayer
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return
    configs = peft_configs(module)
    holders = modules_holding(module, materialized)
    for name, sub in module.named_modules():
        if not isinstance(sub, LoraLayer) or name not in holders:
            continue
        for adapter in list(sub.lora_A.keys()) + list(sub.lora_embedding_A.keys()):
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            if isinstance(sub, AdaLoraLayer):
                sub.ranknum[adapter].fill_(float(sub.r[adapter]))  # a constant, built on meta like the rest
                if init:
                    sub.reset_lora_parameters(adapter)
                else:  # peft keeps the standard-normal draws it created them with
                    for tensor in (sub.lora_A[adapter], sub.lora_E[adapter], sub.lora_B[adapter]):
                        tensor.normal_()
                continue
            sub.reset_lora_parameters(adapter, init)


def peft_tuner_rule(module: nn.Module, materialized: set[str]) -> None:
    """Initialize the adapters of peft's other tuners with their own reset methods, as their ``update_layer`` does:
    IA3 ``reset_ia3_parameters`` (ones; a normal draw with ``init_ia3_weights=False``), LoHa/LoKr
    ``reset_adapter_parameters`` (``_random``, LoKr's ``_lycoris_way``, by ``init_weights``), VeRA
    ``reset_vera_parameters`` (``d_initial``)."""
    try:
        from peft.tuners.ia3 import IA3Layer
        from peft.tuners.loha import LoHaLayer
        from peft.tuners.lokr import LoKrLayer
        from peft.tuners.vera import VeraLayer
    except ImportError:
        return
    configs = peft_configs(module)
    holders = modules_holding(module, materialized)
    for name, sub in module.named_modules():
        if name not in holders:
            continue
        if isinstance(sub, IA3Layer):
            for adapter, vector in sub.ia3_l.items():
                if getattr(configs.get(adapter), "init_ia3_weights", True):
                    sub.reset_ia3_parameters(adapter)
                else:
                    vector.normal_()
        elif isinstance(sub, (LoHaLayer, LoKrLayer)):
            for adapter in sorted(sub._available_adapters):  # a set: the same order (of random draws) on every rank
                init = getattr(configs.get(adapter), "init_weights", True)
                if init == "lycoris" and isinstance(sub, LoKrLayer):
                    sub.reset_adapter_parameters_lycoris_way(adapter)
                elif init:
                    sub.reset_adapter_parameters(adapter)
                else:
                    sub.reset_adapter_parameters_random(adapter)
        elif isinstance(sub, VeraLayer):
            for adapter in sub.vera_lambda_d.keys():
                config = configs.get(adapter)
                if getattr(config, "init_weights", True):
                    sub.reset_vera_parameters(adapter, d_initial=getattr(config, "d_initial", 0.1))
                else:  # what peft's update_layer created them with
                    sub.vera_lambda_b[adapter].fill_(1.0)
                    sub.vera_lambda_d[adapter].normal_()
    _vera_projections(module, materialized)


def _vera_projections(module: nn.Module, materialized: set[str]) -> None:
    """VeRA's frozen random projections, shared by all its layers, drawn from the config's ``projection_prng_key``.
    peft moves them to the base layers' device, ``meta`` here; they are drawn again the way peft's
    ``VeraModel._init_vera_A_vera_B`` draws them (its ``_kaiming_init`` on a CPU generator seeded with the key, A then
    B; that method itself cannot run again on the wrapped model), and every layer's copy gets those values."""
    from peft.tuners.vera import VeraLayer, VeraModel
    from peft.tuners.vera.model import _kaiming_init

    for prefix, model in module.named_modules():
        if not isinstance(model, VeraModel):
            continue
        for adapter, config in model.peft_config.items():
            shared = model.vera_A[adapter], model.vera_B[adapter]
            generator = torch.Generator(device="cpu").manual_seed(config.projection_prng_key)
            drawn = [_kaiming_init(tuple(t.shape), generator=generator) for t in shared]
            for name, layer in model.named_modules():
                if not isinstance(layer, VeraLayer) or adapter not in layer.vera_A:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                for attr, values in zip(("vera_A", "vera_B"), drawn):
                    if f"{full}.{attr}.{adapter}" in materialized:
                        getattr(layer, attr)[adapter].copy_(values)


def peft_dora_rule(module: nn.Module, materialized: set[str]) -> None:
    """DoRA's magnitude vectors, by peft's own ``DoraLinearLayer.update_layer`` on the whole (loaded) base weight and
    adapters, of which each rank keeps the rows of its shard. Runs after the pretrained load (see
    :func:`initialize_from_loaded`)."""
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.lora.dora import DoraLinearLayer
    except ImportError:
        return

    for name, sub in module.named_modules():
        if not isinstance(sub, LoraLayer):
            continue
        for adapter, magnitude in sub.lora_magnitude_vector.items():
            if f"{name}.lora_magnitude_vector.{adapter}.weight" not in materialized:
                continue
            if type(magnitude) is not DoraLinearLayer:
                raise ValueError(
                    f"DoRA adapter {adapter!r} at {name!r} is on a {type(sub.get_base_layer()).__name__}; on a"
                    " meta-built sharded model its magnitudes can be computed for linear layers only. Start from"
                    " saved adapters (`lora.load_adapter`), target linear layers only, or pass"
                    " FSDP2Strategy(meta_init=False)."
                )
            base = nn.Module()
            base.weight = nn.Parameter(_whole(sub.get_base_layer().weight), requires_grad=False)
            fresh = DoraLinearLayer(fan_in_fan_out=magnitude.fan_in_fan_out)
            fresh.update_layer(
                base_layer=base,
                lora_A=_whole(sub.lora_A[adapter].weight),
                lora_B=_whole(sub.lora_B[adapter].weight),
                scaling=sub.scaling[adapter],
            )
            target = magnitude.weight
            local = target.to_local() if hasattr(target, "to_local") else target
            local.copy_(fresh.weight[local_slice(target)])


def _whole(tensor: Tensor) -> Tensor:
    """The whole of a (sharded) tensor on this rank; a collective for a ``DTensor``."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
