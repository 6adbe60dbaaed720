"""LoRA adapters in and out of a sharded model: peft's adapter format, a merged Hugging Face model, a callback.

Under FSDP2 every rank holds a slice of each adapter matrix, so peft's own ``save_pretrained`` called on a rank
would write that rank's slice. Here the adapters are gathered whole to rank 0 first (one tensor at a time, see
``checkpoint.gather_to_rank0``), and then peft writes them, in its own format, under its own names: the result
loads with ``PeftModel.from_pretrained(base, directory)`` anywhere.

- :func:`save_adapter`: ``adapter_model.safetensors`` + ``adapter_config.json``, the adapters only.
- :func:`save_merged`: the base model with the adapters merged in (peft's ``merge_and_unload``), as a Hugging Face
  model directory for ``AutoModelForCausalLM.from_pretrained``.
- :func:`load_adapter`: start a fine-tune from saved adapters (deferred like ``load_pretrained``).
- :class:`AdapterExport`: a Lightning callback that saves the adapters every N steps and at the end.

All writes go to a temporary directory beside the target; each file is then renamed into the target directory, so
every file is either the old one or the complete new one, and files of yours already in that directory are kept.
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lightning_fsdp2.checkpoint.files import (
    CheckpointFileError,
    check_export_directory,
    export_into,
    on_rank0,
    stale_safetensors_weights,
)
from lightning_fsdp2.checkpoint.integrity import add_checksums, checksum_metadata
from lightning_fsdp2.checkpoint.plan import tied_aliases
from lightning_fsdp2.checkpoint.pretrained import declare_load
from lightning_fsdp2.checkpoint.shards import gather_to_rank0
from lightning_fsdp2.checkpoint.sources import PretrainedSource
from lightning_fsdp2.peer_lost import called_by_every_rank
from lightning_fsdp2.quantize import Dequantizing
from lightning_fsdp2.peft_support import peft_state_dict

__all__ = ["AdapterExport", "find_peft_model", "load_adapter", "save_adapter", "save_merged"]


def find_peft_model(module: nn.Module) -> Any:
    """The (outermost) ``peft.PeftModel`` in ``module``, e.g. the ``LightningModule``'s ``self.model``."""
    from peft import PeftModel

    for sub in module.modules():
        if isinstance(sub, PeftModel):
            return sub
    raise ValueError(
        f"{type(module).__name__} holds no peft model. Wrap the model with `peft.get_peft_model(model, LoraConfig(...))`"
        " in configure_model."
    )


@called_by_every_rank("lora.save_adapter")
def save_adapter(module: nn.Module, directory: str | os.PathLike, *, adapter_name: str = "default") -> Path:
    """Write the peft adapter ``adapter_name`` of ``module`` in peft's format; call on every rank.

    Each adapter tensor is gathered whole to rank 0 (the other ranks send their slices and keep nothing), and
    rank 0 writes ``adapter_model.safetensors`` and ``adapter_config.json`` with peft's ``save_pretrained``, then
    records each tensor's CRC-32 in the safetensors header (verified by :func:`load_adapter`). Prompt tuning and prefix tuning (without ``prefix_projection``) save their encoder's weight, as peft does.
    """
    peft_model = find_peft_model(module)
    if adapter_name not in peft_model.peft_config:
        raise ValueError(f"The model has no adapter {adapter_name!r}; it has {sorted(peft_model.peft_config)}.")
    directory = Path(directory)
    on_rank0(lambda: check_export_directory(directory), f"write the adapter to {directory}")  # before any work
    sharded = peft_model.state_dict()  # FSDP2: each rank's shards, clean names, no communication
    # peft picks the tensors that belong to the adapter (and renames them); gather exactly those.
    picked = peft_state_dict(peft_model, sharded, adapter_name)
    name_of = {id(t): name for name, t in sharded.items()}
    to_gather = {name_of[id(t)]: t for t in picked.values() if id(t) in name_of}
    if len(to_gather) != len(picked):
        raise NotImplementedError(
            f"peft computes {len(picked) - len(to_gather)} of adapter {adapter_name!r}'s tensors instead of taking them"
            " from the model; save_adapter can only gather tensors the model holds."
        )
    adapter = gather_to_rank0(to_gather)

    def write(tmp: Path) -> None:
        if (directory / "README.md").is_file():  # peft updates an existing model card rather than replacing it
            shutil.copy2(directory / "README.md", tmp / "README.md")
        if peft_model.peft_config[adapter_name].is_prompt_learning:
            # peft's save_pretrained ignores a given state dict for prompt learning and runs the sharded encoder
            # again: write its two files, as it names them, from the gathered tensors under peft's keys.
            from peft.utils import SAFETENSORS_WEIGHTS_NAME
            from safetensors.torch import save_file

            weights = {key: adapter[name_of[id(t)]].contiguous() for key, t in picked.items()}
            metadata = {"format": "pt", **checksum_metadata(weights)}
            save_file(weights, tmp / SAFETENSORS_WEIGHTS_NAME, metadata=metadata)
            config = copy.deepcopy(peft_model.peft_config[adapter_name])
            config.inference_mode = True  # as peft writes it, with the base model's name and a model card
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = peft_model.get_base_model().__dict__.get("name_or_path")
            config.save_pretrained(str(tmp))
            peft_model.create_or_update_model_card(str(tmp))
            return
        peft_model.save_pretrained(str(tmp), state_dict=adapter, selected_adapters=[adapter_name])
        if adapter_name != "default":  # peft puts a non-default adapter in a subdirectory of that name
            for file in (tmp / adapter_name).iterdir():
                file.rename(tmp / file.name)
            (tmp / adapter_name).rmdir()
        # peft's writer takes no metadata: its (small) file is written again with the checksums in its header.
        add_checksums(tmp / "adapter_model.safetensors")

    _write_directory(directory, write, "write the adapter", supersedes=None)
    return directory


@called_by_every_rank("lora.save_merged")
def save_merged(
    module: nn.Module,
    directory: str | os.PathLike,
    *,
    adapter_name: str = "default",
    dtype: torch.dtype | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Write the base model with the adapter merged into its weights, as a Hugging Face model directory.

    Call on every rank. The whole model is gathered to rank 0's CPU memory one tensor at a time; rank 0 rebuilds the
    peft model around those tensors (no copy), lets peft merge (``merge_and_unload``) and writes it with
    ``save_pretrained``, so ``AutoModelForCausalLM.from_pretrained(directory)`` loads it without peft. ``dtype``
    converts the weights (default: as trained). A base stored in NF4 (QLoRA) is written dequantized, in the dtype it
    was quantized from (bf16 under ``"bf16-true"``).
    """
    peft_model = find_peft_model(module)
    if adapter_name not in peft_model.peft_config:
        raise ValueError(f"The model has no adapter {adapter_name!r}; it has {sorted(peft_model.peft_config)}.")
    directory = Path(directory)
    on_rank0(lambda: check_export_directory(directory), f"write the merged model to {directory}")  # before any work
    sharded = peft_model.state_dict()
    # Tied weights (embedding and head) are sent once and stay one tensor. An NF4 base (QLoRA) is dequantized shard by
    # shard as it is gathered: rank 0 receives its original dtype, one tensor at a time.
    full = gather_to_rank0(Dequantizing(sharded), same_as=tied_aliases(peft_model, sharded))
    base = peft_model.get_base_model()
    configs = copy.deepcopy(dict(peft_model.peft_config))

    def write(tmp: Path) -> None:
        from peft import get_peft_model

        # The same structure (every adapter, so the names match), on meta: the gathered tensors are assigned below.
        (first, first_config), *rest = configs.items()
        with torch.device("meta"):
            rebuilt = get_peft_model(type(base)(base.config), first_config, adapter_name=first)
            for name, config in rest:
                rebuilt.add_adapter(name, config)
        rebuilt.load_state_dict(full, assign=True)
        merged = rebuilt.merge_and_unload(adapter_names=[adapter_name])  # the other adapters are dropped
        if dtype is not None:
            merged = merged.to(dtype)
        merged.save_pretrained(str(tmp), max_shard_size=max_shard_size)

    _write_directory(directory, write, "write the merged model", supersedes=stale_safetensors_weights)
    return directory


def load_adapter(
    module: nn.Module, source: PretrainedSource, *, strict: bool = True, check_config: bool = True, verify: bool = True
) -> None:
    """Start from saved peft adapters: declare that ``module``'s adapter weights come from ``source``.

    ``source`` is what :func:`save_adapter` (or peft's ``save_pretrained``) wrote, or its
    ``adapter_model.safetensors``. Call it in ``configure_model`` after ``get_peft_model`` (with the saved
    ``PeftConfig.from_pretrained(source)``, which returns the saved ``LoraConfig``, ``IA3Config``, ...); like
    ``load_pretrained`` it is deferred on ``meta`` and each rank reads only its slices. Every adapter parameter must
    be in ``source``; the base model's weights are not needed (load them with ``load_pretrained``).

    The saved configuration is the right one, as for peft's ``PeftModel.from_pretrained``: the weights were trained
    under its scaling. So where ``adapter_config.json`` beside them differs from the model's active adapter in what
    the adapter computes (``lora_alpha``, ``r``, ``use_rslora``, ``use_dora``, the rank and alpha patterns, the
    method), the load raises, naming both values; ``check_config=False`` loads the tensors into the model's
    configuration as it is. An adapter :func:`save_adapter` wrote carries the CRC-32 of each tensor, verified before
    the load (``verify=False`` skips it; adapters written by peft itself have none and load as before).
    """
    if check_config:
        _check_saved_config(module, source)
    declare_load(module, source, strict=strict, adapters_only=True, verify=verify)


_COMPUTES = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
             "fan_in_fan_out", "lora_bias")
"""Fields of a peft config that change what a loaded adapter computes (not only how it starts)."""


def _check_saved_config(module: nn.Module, source: PretrainedSource) -> None:
    """Raise if the adapter config saved beside ``source`` differs from ``module``'s active adapter's in
    :data:`_COMPUTES` (no saved config, a state dict: nothing to compare)."""
    if not isinstance(source, (str, os.PathLike)):
        return
    directory = Path(source) if Path(source).is_dir() else Path(source).parent
    if not (directory / "adapter_config.json").is_file():
        return
    from peft import PeftConfig

    try:
        peft = find_peft_model(module)
    except ValueError:
        return  # declare_load names a model without adapters
    saved = PeftConfig.from_pretrained(str(directory))
    name = peft.active_adapter if isinstance(peft.active_adapter, str) else peft.active_adapters[0]
    ours = peft.peft_config[name]
    differ = [f"{field}={getattr(saved, field)!r} saved, {getattr(ours, field)!r} in the model" for field in _COMPUTES
              if hasattr(saved, field) and hasattr(ours, field) and getattr(saved, field) != getattr(ours, field)]
    if differ:
        raise CheckpointFileError(
            f"The adapter in {directory} was saved with another configuration than the model's adapter {name!r}: "
            + "; ".join(differ) + ". Its weights were trained under the saved one, so loaded into this one they would"
            " compute something else. Build the adapter from the saved configuration,"
            f" get_peft_model(base, PeftConfig.from_pretrained({str(directory)!r})) (with inference_mode=False to"
            " train it), or pass check_config=False to load the weights into the model's configuration anyway."
        )


def _write_directory(
    directory: Path, write: Callable[[Path], None], what: str, supersedes: Callable[[str, set[str]], bool] | None
) -> None:
    """Rank 0 writes the export (:func:`files.export_into`); files already in ``directory`` that the export does not
    write are left alone, except the ones ``supersedes`` names (weights of an earlier export that the new ones
    replace). Every rank raises if it fails."""
    on_rank0(lambda: export_into(directory, write, supersedes=supersedes), f"{what} to {directory}")


class AdapterExport(Callback):
    """Save the peft adapters in peft's format during and after training.

    Writes ``dirpath/step=<N>`` every ``every_n_train_steps`` optimizer steps (if set) and ``dirpath/final`` when
    training ends (if ``at_end``); each loads with ``PeftModel.from_pretrained(base, path)``.

    Args:
        dirpath: where the adapter directories go.
        every_n_train_steps: save every N optimizer steps; ``None`` for only at the end.
        at_end: save ``final`` when ``fit`` ends.
        adapter_name: which peft adapter to save.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        every_n_train_steps: int | None = None,
        at_end: bool = True,
        adapter_name: str = "default",
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be a positive integer or None, got {every_n_train_steps}.")
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.at_end = at_end
        self.adapter_name = adapter_name
        self.saved: list[Path] = []
        self._last_step = -1

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        """Save every ``every_n_train_steps`` optimizer steps (once per step, also with gradient accumulation)."""
        step = trainer.global_step
        if self.every_n_train_steps and step and step % self.every_n_train_steps == 0 and step != self._last_step:
            self._last_step = step
            self.saved.append(save_adapter(pl_module, self.dirpath / f"step={step}", adapter_name=self.adapter_name))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Save ``final``."""
        if self.at_end:
            self.saved.append(save_adapter(pl_module, self.dirpath / "final", adapter_name=self.adapter_name))
