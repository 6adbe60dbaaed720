"""Saving a checkpoint at world size 2 as the model grows: FSDP2Strategy against Lightning's ModelParallelStrategy.

Two measurements, both at world size 2 on CPU/gloo, contenders alternating within each repeat:

1. **Save** (``trainer.save_checkpoint`` after ``validate``: the weights of a randomly initialized fp32 Llama, no
   optimizer state) for each contender:

   - ``fsdp2 full``: ``FSDP2Strategy(state_dict_type="full")``: one file, rank 0 writes each tensor as it arrives;
   - ``fsdp2 sharded``: ``FSDP2Strategy(state_dict_type="sharded")``: every rank writes its shards (DCP);
   - ``peer full``: Lightning's ``ModelParallelStrategy(save_distributed_checkpoint=False)`` with the
     hand-written per-layer ``fully_shard`` its docs show: the full state dict on rank 0, then ``torch.save``;
   - ``peer sharded``: the same with ``save_distributed_checkpoint=True`` (DCP).

   Time is the ``save_checkpoint`` call on rank 0; memory is each rank's peak resident set (``VmHWM``, reset just
   before the save) above what it held then. Target: a full save's rank-0 extra memory is flat, at most the largest
   tensor + 300 MB at every size, and its time at most the peer's.

2. **Asynchronous save** (``--async-size``, default ``large``): a short SGD training run (6 steps) that saves a
   sharded checkpoint after steps 2 and 4, with ``async_save=True``, synchronously, and not at all. *Blocked* is
   how long each ``save_checkpoint`` held the training loop (the first async save also allocates the staging
   buffers the later ones reuse); *lost* is how much longer steps 3 to 6 took than in the run without saves (the
   background writer shares the two CPU cores with training here). Target: an async save blocks training for < 20%
   of a synchronous sharded save.

    python benchmarks/save.py                                       # small and medium
    python benchmarks/save.py --sizes small medium large --repeats 3

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

CONTENDERS = ["fsdp2 full", "fsdp2 sharded", "peer full", "peer sharded"]
ASYNC_MODES = ["none", "sync", "async"]
SAVE_AT, STEPS = (2, 4), 6  # two saves: the first allocates the async staging buffers, the second reuses them


class Built(L.LightningModule):
    """A random Llama; ``peer=True`` shards it by hand as ModelParallelStrategy users do."""

    def __init__(self, size: str, peer: bool = False) -> None:
        super().__init__()
        self.size, self.peer = size, peer
        self.model = None
        self.step_ends: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import LlamaForCausalLM

        if not self.peer:
            self.model = LlamaForCausalLM(_config(self.size))  # FSDP2Strategy builds it on meta and shards it
            return
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = LlamaForCausalLM(_config(self.size))
        mesh = self.device_mesh["data_parallel"]
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():  # real values in every page, as FSDP2Strategy's initialization gives (the save reads them)
            for param in model.parameters():
                param.to_local().normal_(std=0.02)
        self.model = model

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def on_train_batch_end(self, *args) -> None:
        self.step_ends.append(time.perf_counter())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)  # no optimizer state: the checkpoint is the weights

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(64, 16, dtype=torch.long), batch_size=1)

    def validation_step(self, batch, batch_idx) -> None:
        pass

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(1, 8, dtype=torch.long), batch_size=1)


def _trainer(strategy, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, **kwargs,
    )


def _save(size: str, contender: str, path: str) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_fsdp2 import FSDP2Strategy

    peer, fmt = contender.split()[0] == "peer", contender.split()[1]
    if peer:
        strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=fmt == "sharded"
        )
    else:
        strategy = FSDP2Strategy(state_dict_type=fmt)
    trainer = _trainer(strategy, limit_val_batches=1)
    trainer.validate(Built(size, peer=peer), verbose=False)
    start = _reset_peak()
    t0 = time.perf_counter()
    trainer.save_checkpoint(path)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "peak_mb": (_status_kb("VmHWM") - start) / 1024}


def _train_and_save(size: str, mode: str, path: str) -> dict:
    """Train STEPS steps, saving after each step in SAVE_AT (async, sync, or not); time the saves and what follows."""
    from lightning_fsdp2 import FSDP2Strategy

    marks: dict = {"blocked": []}

    class SaveAt(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if trainer.global_step in SAVE_AT and len(marks["blocked"]) < SAVE_AT.index(trainer.global_step) + 1:
                marks.setdefault("start", time.perf_counter())
                t0 = time.perf_counter()
                if mode != "none":
                    trainer.save_checkpoint(path)
                marks["blocked"].append(time.perf_counter() - t0)

    strategy = FSDP2Strategy(state_dict_type="sharded", async_save=mode == "async")
    module = Built(size)
    trainer = _trainer(strategy, max_steps=STEPS, limit_val_batches=0, callbacks=[SaveAt()])
    trainer.fit(module)
    return {"blocked": marks["blocked"], "until_last_step": module.step_ends[-1] - marks["start"]}


def _params(size: str) -> list[torch.nn.Parameter]:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return list(LlamaForCausalLM(_config(size)).parameters())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="*", default=["small", "medium"], choices=list(SIZES))
    parser.add_argument("--async-size", default="large", choices=[*SIZES, "none"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    rows, async_rows = [], []
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        for size in args.sizes:
            params = _params(size)
            model_mb = sum(p.numel() * 4 for p in params) / 2**20
            largest_mb = max(p.numel() * 4 for p in params) / 2**20
            runs: dict[str, list[list[dict]]] = {c: [] for c in CONTENDERS}
            for repeat in range(args.repeats):
                order = CONTENDERS if repeat % 2 == 0 else CONTENDERS[::-1]
                for contender in order:
                    path = Path(tmp) / f"{size}-{contender.replace(' ', '-')}.ckpt"
                    runs[contender].append(run_distributed(_save, 2, size, contender, str(path), timeout=1800))
                    _remove(path)
                    print(f"{size} {contender} repeat {repeat}: {runs[contender][-1][0]['seconds']:.2f} s", flush=True)
            for contender, per_run in runs.items():
                rows.append({
                    "size": size, "parameters": sum(p.numel() for p in params), "model_mb": model_mb,
                    "largest_tensor_mb": largest_mb, "contender": contender,
                    "seconds": statistics.median(r[0]["seconds"] for r in per_run),
                    "peak_mb_per_rank": [statistics.median(r[k]["peak_mb"] for r in per_run) for k in (0, 1)],
                })
        if args.async_size != "none":
            timings: dict[str, list[dict]] = {m: [] for m in ASYNC_MODES}
            for repeat in range(args.repeats):
                for mode in ASYNC_MODES if repeat % 2 == 0 else ASYNC_MODES[::-1]:
                    path = Path(tmp) / f"train-{mode}.ckpt"
                    timings[mode].append(run_distributed(_train_and_save, 2, args.async_size, mode, str(path), timeout=1800)[0])
                    _remove(path)
                    print(f"train {args.async_size} save={mode} repeat {repeat}: {timings[mode][-1]}", flush=True)
            baseline = statistics.median(t["until_last_step"] for t in timings["none"])
            for mode in ("sync", "async"):
                async_rows.append({
                    "size": args.async_size, "mode": mode,
                    "blocked_first_s": statistics.median(t["blocked"][0] for t in timings[mode]),
                    "blocked_later_s": statistics.median(t["blocked"][1] for t in timings[mode]),
                    "lost_s": statistics.median(t["until_last_step"] for t in timings[mode]) - baseline,
                    "steps_after_s_without_save": baseline,
                })

    command = f"python benchmarks/save.py --sizes {' '.join(args.sizes)} --async-size {args.async_size} --repeats {args.repeats}"
    lines = [
        f"Saving at world size 2 (fp32 Llama, random weights, no optimizer state), CPU/gloo, median of {args.repeats},"
        " contenders alternating. *peer*: Lightning's `ModelParallelStrategy` with hand-written per-layer"
        " `fully_shard` (`save_distributed_checkpoint=False` for full, `True` for sharded). Peak: each rank's"
        " resident-memory peak during the save above its level just before. Full-save target: rank 0 <= largest"
        " tensor + 300 MB, and time <= the peer's.", "",
        "| parameters (checkpoint) | contender | time (s) | vs peer | peak above start, rank 0 / rank 1 (MB) | target (MB) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    by_key = {(r["size"], r["contender"]): r for r in rows}
    for row in rows:
        kind = row["contender"].split()[1]
        peer = by_key[(row["size"], f"peer {kind}")]
        ratio = f"{row['seconds'] / peer['seconds']:.2f}x" if row["contender"].startswith("fsdp2") else "-"
        target = f"{row['largest_tensor_mb'] + 300:.0f}" if row["contender"] == "fsdp2 full" else "-"
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_mb_per_rank"])
        lines.append(
            f"| {row['parameters'] / 1e6:.0f}M ({row['model_mb']:.0f} MB) | {row['contender']} | {row['seconds']:.2f}"
            f" | {ratio} | {peaks} | {target} |"
        )
    if async_rows:
        sync = next(r for r in async_rows if r["mode"] == "sync")
        lines += [
            "", f"Sharded saves during SGD training of the {async_rows[0]['size']} model (saves after steps"
            f" {' and '.join(map(str, SAVE_AT))} of {STEPS}; steps {SAVE_AT[0] + 1} to {STEPS} take"
            f" {sync['steps_after_s_without_save']:.2f} s without saves). Blocked: each `save_checkpoint` call (the"
            " first async save allocates the staging buffers, later ones reuse them); lost: extra time to the last"
            " step, both saves together. Target: async blocked < 20% of the synchronous save.", "",
            "| save | blocked, first (s) | blocked, later (s) | later vs synchronous | training time lost (s) |",
            "|---|---:|---:|---:|---:|",
        ]
        for row in async_rows:
            share = f"{100 * row['blocked_later_s'] / sync['blocked_later_s']:.0f}%"
            lines.append(
                f"| {row['mode']} | {row['blocked_first_s']:.2f} | {row['blocked_later_s']:.2f} | {share} |"
                f" {row['lost_s']:.2f} |"
            )
    lines += ["", f"Command: `{command}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "save.json").write_text(json.dumps({"rows": rows, "async": async_rows, "command": command}, indent=2) + "\n")
    (out / "save.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
