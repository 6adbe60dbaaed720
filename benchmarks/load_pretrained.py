"""Start-up cost of a pretrained model at world size 2: time and peak memory per rank, side by side.

Three ways to get a Hugging Face Llama's weights into an FSDP2-sharded model, measured in the same run,
alternating, repeated, medians reported:

- ``load_pretrained``: FSDP2Strategy builds on ``meta``, shards, and each rank reads only its shards' slices of
  the safetensors files (``lightning_fsdp2.load_pretrained``).
- ``eager``: the model is built for real on every rank (``FSDP2Strategy(meta_init=False)``), the whole state
  dict is loaded into it from the files, and only then is it sharded.
- ``transformers-fsdp``: transformers shards the model itself,
  ``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))`` (transformers 5's own FSDP2), in a
  plain process group with no Lightning: the peer for "could transformers load it for us?". FSDP2Strategy does not
  take such a model over (it refuses it, saying to use ``load_pretrained``); this row says what that costs.
- ``read-only``: each rank just reads its share of the checkpoint bytes into fresh memory, one tensor at a time
  (the same slices, kept nowhere): the floor for any loader.

Time is from the start of ``configure_model`` to the first validation step (so it includes sharding,
materialization, initialization and loading), and for ``transformers-fsdp`` the ``from_pretrained`` call (which
shards, materializes and loads); memory is the peak resident set size (``VmHWM``) per rank above what the process
held when ``configure_model`` (or ``from_pretrained``) started.

    python benchmarks/load_pretrained.py                # ~150M parameters
    python benchmarks/load_pretrained.py --size large   # ~550M parameters (needs ~10 GB RAM)

Writes ``benchmarks/results/load_pretrained-<size>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_fsdp2 import FSDP2Strategy, load_pretrained  # noqa: E402
from tests.helpers import run_distributed  # noqa: E402

SIZES = {  # LlamaConfig overrides
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8),
    "medium": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=10, num_attention_heads=16),
    "large": dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16),
}


def _config(size: str):
    from transformers import LlamaConfig

    return LlamaConfig(num_key_value_heads=None, max_position_embeddings=512, tie_word_embeddings=False, **SIZES[size])


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    return _status_kb("VmRSS")


class StartUp(L.LightningModule):
    def __init__(self, size: str, checkpoint: str, method: str) -> None:
        super().__init__()
        self.size, self.checkpoint, self.method = size, checkpoint, method
        self.model = None
        self.result: dict = {}

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import LlamaForCausalLM

        self.result["rss_start_kb"] = _reset_peak()
        self.result["t0"] = time.perf_counter()
        model = LlamaForCausalLM(_config(self.size))
        if self.method == "load_pretrained":
            load_pretrained(model, self.checkpoint)
        else:  # eager: the whole state dict into the whole model, then FSDP2 shards it
            from safetensors.torch import load_file

            state = {}
            for file in sorted(Path(self.checkpoint).glob("*.safetensors")):
                state.update(load_file(file))
            model.load_state_dict(state)
            del state
        self.model = model

    def validation_step(self, batch, batch_idx) -> None:
        if "seconds" not in self.result:
            self.result["seconds"] = time.perf_counter() - self.result.pop("t0")
            self.result["peak_kb"] = _status_kb("VmHWM") - self.result["rss_start_kb"]

    def val_dataloader(self) -> DataLoader:
        return DataLoader(torch.zeros(1, 8, dtype=torch.long), batch_size=1)


def _start_up(size: str, checkpoint: str, method: str) -> dict:
    if method == "read-only":
        return _read_share(checkpoint)
    if method == "transformers-fsdp":
        return _transformers_fsdp(checkpoint)
    module = StartUp(size, checkpoint, method)
    strategy = FSDP2Strategy(meta_init=(method == "load_pretrained"))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=1, use_distributed_sampler=False,
    )
    trainer.validate(module, verbose=False)
    return module.result


def _read_share(checkpoint: str) -> dict:
    """Read this rank's dim-0 chunk of every tensor and nothing else (what any sharded loader must read)."""
    import math

    import torch.distributed as dist
    from safetensors import safe_open

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start_kb = _reset_peak()
    t0 = time.perf_counter()
    total = 0
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                rows = piece.get_shape()[0]
                chunk = math.ceil(rows / world)
                # clone(): the slice may be a view of the mapped file; its bytes must land in memory of our own,
                # as they do in a shard.
                total += piece[min(rank * chunk, rows) : min((rank + 1) * chunk, rows)].clone().numel()
    dist.barrier()
    result = {"seconds": time.perf_counter() - t0, "peak_kb": _status_kb("VmHWM") - start_kb, "elements": total}
    dist.destroy_process_group()
    return result


def _transformers_fsdp(checkpoint: str) -> dict:
    """transformers 5's own FSDP2: ``from_pretrained`` with a ``DistributedConfig``, in a plain gloo group."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo")
    start_kb = _reset_peak()
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(fsdp_size=2))
    # Its shards may still be views of the memory-mapped files, read only when first used: touch each (as the
    # first step would), so that time and memory count the reading as they do for the other methods.
    for param in model.parameters():
        (param.to_local() if isinstance(param, DTensor) else param).sum()
    dist.barrier()
    result = {"seconds": time.perf_counter() - t0, "peak_kb": _status_kb("VmHWM") - start_kb,
              "sharded": all(isinstance(p, DTensor) for p in model.parameters())}
    dist.destroy_process_group()
    return result


def _make_checkpoint(size: str, path: Path) -> int:
    from transformers import LlamaForCausalLM

    if not (path / "config.json").exists():
        print(f"creating the {size} checkpoint in {path} (once)...", flush=True)
        torch.manual_seed(0)
        LlamaForCausalLM(_config(size)).save_pretrained(path, max_shard_size="500MB")
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(size))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="medium")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", default=str(ROOT / "benchmarks" / ".cache"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    checkpoint = Path(args.cache) / f"llama-{args.size}"
    n_params = _make_checkpoint(args.size, checkpoint)
    model_mb = n_params * 4 / 2**20
    methods = ["load_pretrained", "eager", "transformers-fsdp", "read-only"]
    runs: dict[str, list[list[dict]]] = {m: [] for m in methods}
    for repeat in range(args.repeats):
        for method in methods if repeat % 2 == 0 else reversed(methods):  # alternate the order
            runs[method].append(run_distributed(_start_up, 2, args.size, str(checkpoint), method, timeout=1800))
            print(f"repeat {repeat}: {method}: {[round(r['seconds'], 2) for r in runs[method][-1]]} s", flush=True)

    def median(method: str, key: str, rank: int) -> float:
        return statistics.median(run[rank][key] for run in runs[method])

    rows = {}
    for method in methods:
        rows[method] = {
            "seconds": max(median(method, "seconds", r) for r in (0, 1)),
            "peak_mb_per_rank": [median(method, "peak_kb", r) / 1024 for r in (0, 1)],
        }
    base = rows["load_pretrained"]
    summary = {
        "size": args.size,
        "parameters": n_params,
        "model_mb_fp32": model_mb,
        "world_size": 2,
        "repeats": args.repeats,
        "methods": rows,
        "eager_over_load_pretrained_time": rows["eager"]["seconds"] / base["seconds"],
        "transformers_fsdp_over_load_pretrained_time": rows["transformers-fsdp"]["seconds"] / base["seconds"],
        "transformers_fsdp_over_load_pretrained_peak": max(rows["transformers-fsdp"]["peak_mb_per_rank"])
        / max(base["peak_mb_per_rank"]),
        "transformers_fsdp_sharded": all(r["sharded"] for run in runs["transformers-fsdp"] for r in run),
        "load_pretrained_over_read_only_time": base["seconds"] / rows["read-only"]["seconds"],
        "peak_over_shard": max(base["peak_mb_per_rank"]) / (model_mb / 2),
        "command": f"python benchmarks/load_pretrained.py --size {args.size} --repeats {args.repeats}",
    }
    lines = [
        f"Pretrained load at world size 2, Llama {n_params / 1e6:.0f}M parameters ({model_mb:.0f} MB fp32,"
        f" {model_mb / 2:.0f} MB per rank's shard), CPU/gloo, median of {args.repeats}.",
        "",
        "| method | time (s) | peak RSS per rank above start (MB) |",
        "|---|---:|---:|",
    ]
    for method, row in rows.items():
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_mb_per_rank"])
        lines.append(f"| {method} | {row['seconds']:.2f} | {peaks} |")
    lines += [
        "",
        f"- eager / load_pretrained time: {summary['eager_over_load_pretrained_time']:.2f}x",
        f"- transformers-fsdp / load_pretrained: time {summary['transformers_fsdp_over_load_pretrained_time']:.2f}x,"
        f" peak {summary['transformers_fsdp_over_load_pretrained_peak']:.2f}x (every parameter a DTensor:"
        f" {summary['transformers_fsdp_sharded']})",
        f"- load_pretrained / read-only time: {summary['load_pretrained_over_read_only_time']:.2f}x",
        f"- load_pretrained peak / shard size: {summary['peak_over_shard']:.2f}x",
        "",
        f"Command: `{summary['command']}`",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"load_pretrained-{args.size}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / f"load_pretrained-{args.size}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
