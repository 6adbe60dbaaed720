"""LoRA memory layouts at world size 2: per-rank parameter bytes, peak memory and tokens/s, side by side.

The same pretrained Llama (``--size large``: 551M parameters) fine-tuned with LoRA (r=16 on q/k/v/o) under
FSDP2Strategy in four layouts, in the same run, in turn:

- ``fp32``: ``"32-true"``, everything fp32;
- ``bf16``: ``"bf16-true"`` with ``FSDP2Precision(adapter_dtype=None)``, everything bf16;
- ``bf16+fp32-adapters``: ``"bf16-true"`` (the default): base bf16, adapters and their AdamW state fp32;
- ``nf4``: the same with ``load_pretrained(..., quantize="nf4")``: the base's linear weights in NF4 (QLoRA);

then ``bf16+fp32-adapters:trim`` and ``nf4:trim``: those two again with glibc's malloc giving freed memory back at once
(by default it keeps it for reuse, and the resident set counts it; see ``_return_freed_memory``).

Per rank: the bytes of the parameter shards it holds (the base's linear weights, the rest of the base, the
adapters), the peak resident set size (``VmHWM``) above what the process held when ``configure_model`` started
(building, loading, then ``--steps`` optimizer steps with activation checkpointing on each decoder layer), and the
tokens/s of the steps after the first.

    python benchmarks/memory.py                 # ~551M parameters, 4 steps each (a few minutes on 2 cores)

Writes ``benchmarks/results/memory.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from load_pretrained import SIZES, _config, _make_checkpoint, _reset_peak, _status_kb  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_fsdp2 import FSDP2Precision, FSDP2Strategy, load_pretrained  # noqa: E402
from tests.helpers import run_distributed  # noqa: E402

LAYOUTS = ["fp32", "bf16", "bf16+fp32-adapters", "nf4"]
TRIMMED = ["bf16+fp32-adapters:trim", "nf4:trim"]  # the peak ratio's two layouts again, freed memory given back
SEQ, BATCH = 128, 1  # per rank and step


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for a parameter: its shard (an NF4 shard's codes, scales and their factors)."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if type(local).__name__ == "NF4Tensor":
        parts = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
        return sum(getattr(local, p).numel() * getattr(local, p).element_size() for p in parts)
    return local.numel() * local.element_size()


class Timed(L.LightningModule):
    """LoRA steps on random tokens, timed; the peak RSS since ``configure_model`` started (``rss_start_kb``)."""

    vocab = 32000

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.result: dict = {"step_seconds": [], "losses": []}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.result["losses"].append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, *args) -> None:
        now = time.perf_counter()
        self.result["step_seconds"].append(now - self._t)
        self._t = now

    def on_train_end(self) -> None:
        self.result["peak_kb"] = _status_kb("VmHWM") - self.result["rss_start_kb"]
        self.result["peak_abs_kb"] = _status_kb("VmHWM")  # the process's whole peak: what must fit in the machine

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        data = torch.randint(0, self.vocab, (64, SEQ), generator=torch.Generator().manual_seed(0))
        return DataLoader(data, batch_size=BATCH)


class Fine(Timed):
    def __init__(self, size: str, checkpoint: str, layout: str) -> None:
        super().__init__()
        self.size, self.checkpoint, self.layout = size, checkpoint, layout

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        self.result["rss_start_kb"] = _reset_peak()
        model = LlamaForCausalLM(_config(self.size))
        load_pretrained(model, self.checkpoint, quantize="nf4" if self.layout == "nf4" else None)
        self.model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj",
                                                                                          "v_proj", "o_proj"]))

    def on_train_start(self) -> None:
        from lightning_fsdp2.quantize import is_nf4

        groups = {"base linear weights": 0, "rest of the base": 0, "adapters": 0}
        linear = {f"{n}.weight" for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)}
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                groups["adapters"] += _local_bytes(param)
            elif name in linear and not name.endswith("lm_head.weight") or is_nf4(param):
                groups["base linear weights"] += _local_bytes(param)
            else:
                groups["rest of the base"] += _local_bytes(param)
        self.result["param_bytes"] = groups
        self._t = time.perf_counter()


def _return_freed_memory() -> None:
    """Make glibc's malloc give freed memory back to the system (as ``MALLOC_TRIM_THRESHOLD_=0`` would). By default
    it keeps freed blocks below a threshold that grows with the largest block freed (up to 32 MB) for reuse, and the
    resident set counts them: RSS then measures the allocator's high-water mark, not the live tensors. Trimming
    every free costs speed (pages are faulted in again); the benchmark runs both ways."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-1, 0)  # M_TRIM_THRESHOLD = 0 (also fixes the mmap threshold at 128 KiB)


def _run(size: str, checkpoint: str, layout: str, steps: int) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layout, _, allocator = layout.partition(":")
    if allocator == "trim":
        _return_freed_memory()

    precision = {
        "fp32": FSDP2Precision("32-true"),
        "bf16": FSDP2Precision("bf16-true", adapter_dtype=None),
    }.get(layout, FSDP2Precision("bf16-true"))
    module = Fine(size, checkpoint, layout)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(activation_checkpointing_policy={LlamaDecoderLayer}),
        plugins=[precision], max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(module)
    return module.result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="large")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cache", default=str(ROOT / "benchmarks" / ".cache"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    checkpoint = Path(args.cache) / f"llama-{args.size}"
    n_params = _make_checkpoint(args.size, checkpoint)
    rows = {}
    for layout in LAYOUTS + TRIMMED:
        ranks = run_distributed(_run, 2, args.size, str(checkpoint), layout, args.steps, timeout=3600)
        timed = [max(r["step_seconds"][i] for r in ranks) for i in range(1, args.steps)]  # the slower rank's
        rows[layout] = {
            "param_mb_per_rank": {k: max(r["param_bytes"][k] for r in ranks) / 2**20 for k in ranks[0]["param_bytes"]},
            "peak_mb_per_rank": max(r["peak_kb"] for r in ranks) / 1024,
            "tokens_per_s": 2 * BATCH * SEQ * len(timed) / sum(timed),
        }
        print(layout, json.dumps(rows[layout]), flush=True)
    bf16, nf4, mixed = rows["bf16"], rows["nf4"], rows["bf16+fp32-adapters"]
    linear = "base linear weights"
    summary = {
        "size": args.size, "parameters": n_params, "world_size": 2, "steps": args.steps, "seq": SEQ,
        "batch_per_rank": BATCH, "layouts": rows,
        "nf4_over_bf16_linear_weights": nf4["param_mb_per_rank"][linear] / bf16["param_mb_per_rank"][linear],
        "nf4_over_bf16_whole_base": (nf4["param_mb_per_rank"][linear] + nf4["param_mb_per_rank"]["rest of the base"])
        / (bf16["param_mb_per_rank"][linear] + bf16["param_mb_per_rank"]["rest of the base"]),
        "nf4_over_bf16_true_peak": nf4["peak_mb_per_rank"] / mixed["peak_mb_per_rank"],
        "nf4_over_bf16_true_peak_trimmed": rows["nf4:trim"]["peak_mb_per_rank"]
        / rows["bf16+fp32-adapters:trim"]["peak_mb_per_rank"],
        "command": f"python benchmarks/memory.py --size {args.size} --steps {args.steps}",
    }
    lines = [
        f"LoRA (r=16, q/k/v/o) on a Llama of {n_params / 1e6:.0f}M parameters at world size 2, CPU/gloo,"
        f" {BATCH} x {SEQ} tokens per rank and step, activation checkpointing on each decoder layer,"
        f" {args.steps} steps (tokens/s over the last {args.steps - 1}).",
        "",
        "| layout | base linear weights (MB/rank) | rest of the base (MB/rank) | adapters (MB/rank) | peak RSS per rank (MB) | tokens/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for layout, row in rows.items():
        p = row["param_mb_per_rank"]
        lines.append(f"| {layout} | {p[linear]:.0f} | {p['rest of the base']:.0f} | {p['adapters']:.1f} |"
                     f" {row['peak_mb_per_rank']:.0f} | {row['tokens_per_s']:.0f} |")
    lines += [
        "",
        f"- NF4 / bf16, the quantized weights: {summary['nf4_over_bf16_linear_weights']:.3f}x",
        f"- NF4 / bf16, the whole base (embeddings, norms and head stay bf16): {summary['nf4_over_bf16_whole_base']:.3f}x",
        f"- NF4 / bf16-true (fp32 adapters), peak per rank: {summary['nf4_over_bf16_true_peak']:.3f}x;"
        f" with freed memory given back (`:trim`): {summary['nf4_over_bf16_true_peak_trimmed']:.3f}x",
        "",
        "`:trim` rows: the same layout with glibc's malloc giving freed memory back at once (`mallopt(M_TRIM_THRESHOLD,"
        " 0)`, as `MALLOC_TRIM_THRESHOLD_=0`); by default it keeps freed blocks for reuse and RSS counts them.",
        "",
        f"Command: `{summary['command']}`",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
