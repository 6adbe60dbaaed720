"""A big Llama's LoRA training steps at world size 2 on this machine: does it fit, and how much memory per rank.

The model's weights are random (normal, std 0.02; norms 1), written once as a sharded safetensors directory in bf16,
tensor by tensor (the model is never built in memory), then trained for ``--steps`` AdamW steps of 1 x 128 tokens per
rank, LoRA r=16 on q/k/v/o, activation checkpointing on each decoder layer, ``"bf16-true"``, in one of three layouts:

- ``nf4``: ``load_pretrained(..., quantize="nf4")`` under FSDP2Strategy (QLoRA; adapters fp32);
- ``bf16``: ``load_pretrained`` under FSDP2Strategy (adapters fp32);
- ``ddp``: the eager peer, ``from_pretrained`` on every rank under Lightning's DDP (a whole bf16 replica per rank).

    python benchmarks/largest.py --layout nf4                # the 7B shape (hidden 4096, 32 layers): ~14 GB on disk
    python benchmarks/largest.py --layout bf16 --layers 40   # another depth: the largest that trains is searched so

A run that does not fit (a rank killed for memory) is recorded as such. Writes
``benchmarks/results/largest-<layout>-<shape>.{md,json}`` and ``largest.md``, every shape tried so far side by side.
With ``MALLOC_TRIM_THRESHOLD_=0`` set (glibc then gives freed memory back at once), results are kept apart (``-trim``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from load_pretrained import _reset_peak, _status_kb  # noqa: E402
from memory import SEQ, Timed, _local_bytes  # noqa: E402

from lightning_fsdp2 import FSDP2Strategy, load_pretrained  # noqa: E402
from tests.helpers import run_distributed  # noqa: E402

DESCRIBE = {
    "nf4": "FSDP2Strategy, base NF4 (bf16-true, fp32 adapters)",
    "bf16": "FSDP2Strategy, base bf16 (bf16-true, fp32 adapters)",
    "ddp": "eager build (`from_pretrained`) + Lightning's DDP, bf16-true (a whole bf16 replica per rank)",
}


def _config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                       max_position_embeddings=512, tie_word_embeddings=False)


def _write_random(config, path: Path) -> int:
    """The model's weights, random, one safetensors file per layer (and one for the rest), with the index."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    n_params = sum(torch.Size(s).numel() for s in shapes.values())
    if (path / "model.safetensors.index.json").exists():
        return n_params
    print(f"writing {n_params / 1e9:.2f}B random parameters to {path} (once)...", flush=True)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    groups: dict[str, list[str]] = {}
    for key in shapes:
        group = key.split(".")[2] if key.startswith("model.layers.") else "rest"
        groups.setdefault(group, []).append(key)
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for i, (group, keys) in enumerate(groups.items()):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for key in keys:
            if key.endswith("norm.weight"):
                tensors[key] = torch.ones(shapes[key], dtype=torch.bfloat16)
            else:
                tensors[key] = (torch.randn(shapes[key], generator=g) * 0.02).to(torch.bfloat16)
            weight_map[key] = name
        save_file(tensors, path / name, metadata={"format": "pt"})
    index = {"metadata": {"total_size": 2 * n_params}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return n_params


class Big(Timed):
    def __init__(self, config, checkpoint: str, layout: str) -> None:
        super().__init__()
        self.config_, self.checkpoint, self.layout = config, checkpoint, layout
        self.vocab = config.vocab_size

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        self.result["rss_start_kb"] = _reset_peak()
        self.result["t0"] = time.perf_counter()
        if self.layout == "ddp":  # the eager peer: every rank builds and loads the whole model (a replica)
            model = LlamaForCausalLM.from_pretrained(self.checkpoint, torch_dtype=torch.bfloat16)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model = LlamaForCausalLM(self.config_)
            load_pretrained(model, self.checkpoint, quantize="nf4" if self.layout == "nf4" else None)
        self.model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj",
                                                                                          "v_proj", "o_proj"]))

    def on_train_start(self) -> None:
        self.result["setup_seconds"] = time.perf_counter() - self.result.pop("t0")
        self.result["setup_peak_kb"] = _status_kb("VmHWM") - self.result["rss_start_kb"]
        self.result["param_mb"] = sum(_local_bytes(p) for p in self.model.parameters()) / 2**20
        self._t = time.perf_counter()


def _run(config, checkpoint: str, layout: str, steps: int) -> dict:
    from lightning.pytorch.strategies import DDPStrategy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    module = Big(config, checkpoint, layout)
    strategy = (DDPStrategy() if layout == "ddp"
                else FSDP2Strategy(activation_checkpointing_policy={LlamaDecoderLayer}))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy,
        precision="bf16-true", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(module)
    return module.result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=["nf4", "bf16", "ddp"], default="nf4")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cache", default=str(ROOT / "benchmarks" / ".cache"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    config = _config(args)
    shape = f"h{args.hidden}-l{args.layers}"
    checkpoint = Path(args.cache) / f"llama-random-{shape}"
    n_params = _write_random(config, checkpoint)
    # With MALLOC_TRIM_THRESHOLD_=0 in the environment, glibc gives freed memory back at once (see memory.py's
    # _return_freed_memory): the peak then follows the live tensors. Such runs are kept apart ("-trim").
    trim = os.environ.get("MALLOC_TRIM_THRESHOLD_")
    command = (("" if trim is None else f"MALLOC_TRIM_THRESHOLD_={trim} ") + f"python benchmarks/largest.py --layout {args.layout} --hidden {args.hidden} --layers {args.layers}"
               f" --intermediate {args.intermediate} --heads {args.heads} --steps {args.steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"largest-{args.layout}-{shape}" + ("" if trim is None else "-trim")
    try:
        ranks = run_distributed(_run, 2, config, str(checkpoint), args.layout, args.steps, timeout=7200)
    except RuntimeError as err:
        if "exited with -9" not in str(err):  # SIGKILL: the kernel's OOM killer (no swap here); anything else is a bug
            raise
        failed = {"layout": args.layout, "parameters": n_params, "shape": vars(args), "fits": False,
                  "error": str(err)[-500:], "command": command}
        (out / f"{stem}.json").write_text(json.dumps(failed, indent=2) + "\n")
        print(f"{args.layout} {shape} ({n_params / 1e9:.2f}B) did not train: {str(err)[-500:]}")
        summarize(out)
        return
    summary = {"fits": True,
        "layout": args.layout, "parameters": n_params, "shape": vars(args), "world_size": 2, "seq": SEQ,
        "setup_seconds": max(r["setup_seconds"] for r in ranks),
        "setup_peak_mb_per_rank": [r["setup_peak_kb"] / 1024 for r in ranks],
        "peak_mb_per_rank": [r["peak_kb"] / 1024 for r in ranks],
        "process_peak_mb_per_rank": [r["peak_abs_kb"] / 1024 for r in ranks],
        "param_mb_per_rank": [r["param_mb"] for r in ranks],
        "step_seconds": [max(r["step_seconds"][i] for r in ranks) for i in range(args.steps)],
        "losses_rank0": ranks[0]["losses"],
        "command": command,
    }
    lines = [
        f"A {n_params / 1e9:.2f}B-parameter Llama (hidden {args.hidden}, {args.layers} layers), random weights, LoRA r=16"
        f" on q/k/v/o, {DESCRIBE[args.layout]}, world size 2 on this machine (2 CPU cores, 23 GiB RAM), 1 x 128"
        " tokens per rank and step, activation checkpointing.",
        "",
        f"- parameter shards per rank: {' / '.join(f'{m:.0f}' for m in summary['param_mb_per_rank'])} MB",
        f"- set-up (build on meta, load{', quantize' if args.layout == 'nf4' else ''}, shard): "
        f"{summary['setup_seconds']:.0f} s, peak RSS per rank above start"
        f" {' / '.join(f'{m:.0f}' for m in summary['setup_peak_mb_per_rank'])} MB",
        f"- peak RSS per rank above start, through {args.steps} steps:"
        f" {' / '.join(f'{m:.0f}' for m in summary['peak_mb_per_rank'])} MB",
        f"- the processes' whole peak RSS (imports, libraries and all; both share the machine's 23.5 GiB):"
        f" {' / '.join(f'{m:.0f}' for m in summary['process_peak_mb_per_rank'])} MB",
        f"- step times: {', '.join(f'{s:.0f}' for s in summary['step_seconds'])} s;"
        f" losses (rank 0): {', '.join(f'{x:.3f}' for x in summary['losses_rank0'])}",
        "",
        f"Command: `{summary['command']}`",
    ]
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    summarize(out)


def summarize(out: Path) -> None:
    """``largest.md``: every shape tried, per layout, and the largest that trained."""
    runs = [json.loads(f.read_text()) for f in sorted(out.glob("largest-*-h*-l*.json")) if "trim" not in f.name]
    runs.sort(key=lambda r: (list(DESCRIBE).index(r["layout"]), r["parameters"]))
    lines = [
        "LoRA training steps (r=16 on q/k/v/o, 1 x 128 tokens per rank, activation checkpointing) at world size 2 on"
        " this machine (2 CPU cores, 23.5 GiB RAM, no swap; both processes share it), Llama shapes with random"
        " weights loaded from a safetensors directory.",
        "",
        "| layout | shape | parameters | trained | peak RSS per process (MB) | both processes (GB) | s/step | set-up (s) |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        shape = f"hidden {r['shape']['hidden']}, {r['shape']['layers']} layers"
        if r.get("fits", True) and "process_peak_mb_per_rank" in r:
            peaks = r["process_peak_mb_per_rank"]
            lines.append(f"| {r['layout']} | {shape} | {r['parameters'] / 1e9:.2f}B | yes | {max(peaks):.0f} |"
                         f" {sum(peaks) / 1000:.1f} | {sorted(r['step_seconds'])[len(r['step_seconds']) // 2]:.0f} |"
                         f" {r['setup_seconds']:.0f} |")
        elif not r.get("fits", True):
            lines.append(f"| {r['layout']} | {shape} | {r['parameters'] / 1e9:.2f}B | no (out of memory) | | | | |")
    trimmed = [json.loads(f.read_text()) for f in sorted(out.glob("largest-*-h*-l*-trim.json"))]
    if trimmed:
        lines += ["", "The same with `MALLOC_TRIM_THRESHOLD_=0` (glibc's malloc gives freed memory back at once instead of"
                  " keeping it for reuse, so the resident set follows the live tensors more closely):", "",
                  "| layout | shape | parameters | peak RSS per process (MB) | above start (MB) | s/step |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in sorted(trimmed, key=lambda r: (list(DESCRIBE).index(r["layout"]), r["parameters"])):
            if r.get("fits", True):
                lines.append(f"| {r['layout']} | hidden {r['shape']['hidden']}, {r['shape']['layers']} layers |"
                             f" {r['parameters'] / 1e9:.2f}B | {max(r['process_peak_mb_per_rank']):.0f} |"
                             f" {max(r['peak_mb_per_rank']):.0f} |"
                             f" {sorted(r['step_seconds'])[len(r['step_seconds']) // 2]:.0f} |")
    lines.append("")
    for layout in DESCRIBE:
        fits = [r for r in runs if r["layout"] == layout and r.get("fits", True)]
        if fits:
            best = max(fits, key=lambda r: r["parameters"])
            lines.append(f"- largest that trained, {layout} ({DESCRIBE[layout]}): {best['parameters'] / 1e9:.2f}B"
                         f" (`{best['command']}`)")
    (out / "largest.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
