"""Saving a checkpoint at world size 2 as the model grows: time and peak memory per rank, full against sharded.

For each model size, a Llama built by FSDP2Strategy (meta init, random weights) is saved with
``trainer.save_checkpoint`` once as ``state_dict_type="full"`` (one file from rank 0, tensors gathered one at a time)
and once as ``"sharded"`` (every rank writes its shards). Memory is each rank's ``VmHWM`` above what it held just
before the save; the full-save target is rank 0 <= checkpoint bytes + largest tensor + 300 MB.

    python benchmarks/save.py                      # small and medium (58M, 194M parameters)
    python benchmarks/save.py --sizes small medium large

Writes ``benchmarks/results/save.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from load_pretrained import SIZES, _config, _reset_peak, _status_kb  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.helpers import run_distributed  # noqa: E402


class Built(L.LightningModule):
    def __init__(self, size: str) -> None:
        super().__init__()
        self.size = size
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            from transformers import LlamaForCausalLM

            self.model = LlamaForCausalLM(_config(self.size))

    def validation_step(self, batch, batch_idx) -> None:
        pass

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(1, 8, dtype=torch.long), batch_size=1)


def _save(size: str, fmt: str, path: str) -> dict:
    from lightning_fsdp2 import FSDP2Strategy

    module = Built(size)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=FSDP2Strategy(state_dict_type=fmt), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=1,
    )
    trainer.validate(module, verbose=False)
    start = _reset_peak()
    t0 = time.perf_counter()
    trainer.save_checkpoint(path)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_mb": (_status_kb("VmHWM") - start) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="*", default=["small", "medium"], choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    rows = []
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        for size in args.sizes:
            with torch.device("meta"):
                params = list(LlamaForCausalLM(_config(size)).parameters())
            model_mb = sum(p.numel() * 4 for p in params) / 2**20
            largest_mb = max(p.numel() * 4 for p in params) / 2**20
            runs: dict[str, list[list[dict]]] = {"full": [], "sharded": []}
            for repeat in range(args.repeats):
                for fmt in ("full", "sharded") if repeat % 2 == 0 else ("sharded", "full"):
                    path = Path(tmp) / f"{size}-{fmt}.ckpt"
                    runs[fmt].append(run_distributed(_save, 2, size, fmt, str(path), timeout=1800))
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                    print(f"{size} {fmt} repeat {repeat}: {runs[fmt][-1][0]['seconds']:.2f} s", flush=True)
            for fmt, per_run in runs.items():
                rows.append({
                    "size": size, "parameters": sum(p.numel() for p in params), "model_mb": model_mb,
                    "largest_tensor_mb": largest_mb, "format": fmt,
                    "seconds": statistics.median(r[0]["seconds"] for r in per_run),
                    "peak_mb_per_rank": [statistics.median(r[k]["peak_mb"] for r in per_run) for k in (0, 1)],
                })
    lines = [f"Saving at world size 2 (fp32 Llama, random weights), CPU/gloo, median of {args.repeats}. Target for"
             " full saves: rank 0 peak <= checkpoint + largest tensor + 300 MB.", "",
             "| parameters | format | time (s) | peak above start, rank 0 / rank 1 (MB) | full-save bound (MB) |",
             "|---:|---|---:|---:|---:|"]
    for row in rows:
        bound = f"{row['model_mb'] + row['largest_tensor_mb'] + 300:.0f}" if row["format"] == "full" else "-"
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_mb_per_rank"])
        lines.append(f"| {row['parameters'] / 1e6:.0f}M | {row['format']} | {row['seconds']:.2f} | {peaks} | {bound} |")
    command = f"python benchmarks/save.py --sizes {' '.join(args.sizes)} --repeats {args.repeats}"
    lines += ["", f"Command: `{command}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "save.json").write_text(json.dumps({"rows": rows, "command": command}, indent=2) + "\n")
    (out / "save.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
