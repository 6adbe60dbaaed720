"""Convert checkpoints offline: a sharded checkpoint into a full one, or any checkpoint into Hugging Face safetensors.

From the command line (one process, no GPU, no process group)::

    lightning-fsdp2-convert last.ckpt/ last-full.ckpt          # sharded directory -> full .ckpt
    lightning-fsdp2-convert last.ckpt/ hf-model/ --to hf --config-from base-model/
                                                                         # sharded or full -> safetensors directory

The conversion holds the whole model in memory (and, for ``--to full``, the optimizer state): run it on a machine
with that much RAM, not inside training. The full file is exactly what ``state_dict_type="full"`` would have
written, so a plain ``Trainer`` can load it; the Hugging Face directory holds ``model.safetensors`` (or shards with
an index) under the model's own parameter names.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from lightning_fsdp2.checkpoint.files import (
    FORMAT_KEY,
    CheckpointFileError,
    atomic_save,
    check_replaceable,
    export_into,
    is_sharded_checkpoint,
    load_torch_file,
    stale_safetensors_weights,
)
from lightning_fsdp2.checkpoint import integrity, safe_dcp
from lightning_fsdp2.checkpoint.formats import read_sharded_meta
from lightning_fsdp2.checkpoint.optimizer_keys import optimizer_state_by_index
from lightning_fsdp2.peft_support import canonical_name, is_adapter_key

__all__ = ["read_full_checkpoint", "sharded_to_full", "to_hf_safetensors", "main"]


def read_full_checkpoint(src: str | os.PathLike, weights_only: bool = True, verify: bool = True) -> dict[str, Any]:
    """A checkpoint of either format as one in-memory full checkpoint (the dict a ``"full"`` file holds).

    ``weights_only=False`` unpickles arbitrary objects: only for files you trust. ``verify``: check the checksums
    written with it first (a ``CheckpointFileError`` names damaged data).
    """
    src = Path(src)
    if verify:
        integrity.verify(src, together=False)
    if not src.is_dir():
        return load_torch_file(src, weights_only=weights_only)
    from torch.distributed.checkpoint.format_utils import _load_state_dict

    checkpoint = read_sharded_meta(src, weights_only=weights_only)
    checkpoint.pop("optimizer_states", None)  # placeholders; the states themselves follow
    tensors: dict[str, Any] = {}
    # The empty-state-dict planner loads everything the checkpoint holds, whole, into this one process. It is what
    # torch's own `dcp_to_torch_save` does; the public `dcp.load` would not add keys to an empty dict. Ours read the
    # index and the non-tensor items without unpickling code.
    reader, planner = safe_dcp.SafeFileSystemReader(src), safe_dcp.SafeEmptyStateDictLoadPlanner(origin=str(src))
    with safe_dcp.checkpoint_errors(reader):
        _load_state_dict(tensors, storage_reader=reader, planner=planner, no_dist=True)
    checkpoint["state_dict"] = tensors.pop("state_dict", {})
    for key in checkpoint.get(FORMAT_KEY, {}).pop("entries", []):  # other state dicts of shards (callbacks')
        checkpoint[key] = tensors.pop(key, {})
    optimizers = sorted((k for k in tensors if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        checkpoint["optimizer_states"] = [optimizer_state_by_index(tensors[k]) for k in optimizers]
    checkpoint[FORMAT_KEY] = {**checkpoint.get(FORMAT_KEY, {}), "state_dict_type": "full"}
    return checkpoint


def sharded_to_full(src: str | os.PathLike, dst: str | os.PathLike, *, verify: bool = True) -> Path:
    """Write the sharded checkpoint ``src`` as one full Lightning checkpoint file ``dst`` (atomically; its records
    carry CRC-32s, as ``torch.save``'s do). ``verify``: check ``src``'s checksums first."""
    if not Path(src).exists():
        raise FileNotFoundError(f"No checkpoint at {src}: no such file or directory.")
    if not is_sharded_checkpoint(src):
        raise ValueError(f"{src} is not a sharded checkpoint directory (it needs '.metadata' and 'meta.pt').")
    check_replaceable(dst)  # before the (long) read: never replace what is not a checkpoint
    atomic_save(read_full_checkpoint(src, verify=verify), dst)
    return Path(dst)


def to_hf_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    prefix: str | None = None,
    config_from: str | os.PathLike | None = None,
    max_shard_size: str = "5GB",
    keep_peft_names: bool = False,
    verify: bool = True,
) -> Path:
    """Write the model weights of checkpoint ``src`` (either format) as a Hugging Face safetensors directory.

    ``prefix`` is stripped from every name and names without it are left out: pass the ``LightningModule``
    attribute that holds the Hugging Face model, e.g. ``"model."``. By default, the first name segment if every
    name shares it. Tied weights are written once. ``config_from``: a Hugging Face model directory whose
    ``config.json`` (and generation config and tokenizer files) are copied along, so that ``from_pretrained(dst)``
    works; a checkpoint does not hold the model's configuration.

    A checkpoint of a peft model (adapter tensors, ``base_layer`` names) is refused: ``from_pretrained`` would not
    find its weights under those names, and merging needs the adapter's configuration, which the checkpoint does not
    hold. Export merged weights or adapters from the run (``lora.save_merged``, ``lora.save_adapter``), or pass
    ``keep_peft_names=True`` to write peft's names anyway, for ``load_pretrained`` (which reads them).

    The CRC-32 of each tensor is recorded under ``"lightning_fsdp2.crc32"`` in the file's header metadata (one file),
    or in the index's metadata (several: huggingface_hub puts given metadata there when it splits); ``from_pretrained``
    ignores it, ``load_pretrained`` verifies it before reading.
    """
    import shutil

    from huggingface_hub import save_torch_state_dict

    state = read_full_checkpoint(src, verify=verify)["state_dict"]
    if prefix is None:
        heads = {name.split(".", 1)[0] for name in state}
        prefix = f"{heads.pop()}." if len(heads) == 1 and all("." in n for n in state) else ""
    weights = {name[len(prefix) :]: t.contiguous() for name, t in state.items() if name.startswith(prefix)}
    if not weights:
        raise ValueError(f"No parameter name in {src} starts with {prefix!r}.")
    adapters = [name for name in weights if is_adapter_key(canonical_name(name))]
    if adapters and not keep_peft_names:
        raise ValueError(
            f"{src} is a checkpoint of a peft model ({len(adapters)} adapter tensors, e.g. {adapters[0]!r}):"
            " from_pretrained would not find its weights under peft's names, and merging the adapters needs their"
            " configuration, which the checkpoint does not hold. Export from the run with"
            " lightning_fsdp2.lora.save_merged (a model from_pretrained loads) or save_adapter (for"
            " PeftModel.from_pretrained), or pass --keep-peft-names to write peft's names for load_pretrained."
        )
    dst = Path(dst)

    # Each tensor's CRC-32 in the file's header, or the index's when split (safetensors has none): load_pretrained
    # verifies them.
    checksums = integrity.checksum_metadata(weights)

    def write(tmp: Path) -> None:
        save_torch_state_dict(weights, tmp, max_shard_size=max_shard_size, metadata=checksums)
        if config_from is not None:
            for file in Path(config_from).iterdir():
                if file.is_file() and (file.name in _CONFIG_FILES or file.name.startswith("tokenizer")):
                    shutil.copy2(file, tmp / file.name)

    # Into the directory file by file: other files there stay; weights of an earlier export are superseded.
    export_into(dst, write, supersedes=stale_safetensors_weights)
    return dst


_CONFIG_FILES = {"config.json", "generation_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"}


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: ``lightning-fsdp2-convert SRC DST [--to full|hf] [--prefix P]`` (the console
    script; ``python -m lightning_fsdp2.convert`` is the same)."""
    parser = argparse.ArgumentParser(prog="lightning-fsdp2-convert", description=__doc__.split("\n")[0])
    parser.add_argument("src", help="a sharded checkpoint directory (or, for --to hf, a full .ckpt file)")
    parser.add_argument("dst", help="the full .ckpt file or Hugging Face directory to write")
    parser.add_argument("--to", choices=["full", "hf"], default="full", help="output format (default: full)")
    parser.add_argument("--prefix", default=None, help="for --to hf: name prefix to strip, e.g. 'model.'")
    parser.add_argument("--config-from", default=None, help="for --to hf: model directory to copy config.json from")
    parser.add_argument("--max-shard-size", default="5GB", help="for --to hf: largest safetensors file")
    parser.add_argument("--keep-peft-names", action="store_true",
                        help="for --to hf: write a peft model's weights under peft's names (for load_pretrained)")
    parser.add_argument("--no-verify", action="store_true",
                        help="read SRC without checking the checksums written with it")
    args = parser.parse_args(argv)
    try:
        if args.to == "full":
            out = sharded_to_full(args.src, args.dst, verify=not args.no_verify)
        else:
            out = to_hf_safetensors(
                args.src, args.dst, prefix=args.prefix, config_from=args.config_from,
                max_shard_size=args.max_shard_size, keep_peft_names=args.keep_peft_names, verify=not args.no_verify,
            )
    except (CheckpointFileError, FileNotFoundError, ValueError) as err:
        parser.exit(1, f"error: {err}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
