"""Training throughput and memory of LoRA fine-tuning: FSDP2Strategy against its peers, measured side by side.

One Llama-style model (about 58M parameters; LoRA r=8 on q/k/v/o), sequence length 256, the same per-process batch
and the same LightningModule for every contender, all at world size 2 on CPU/gloo (one thread per process):

- ``fsdp2``: ``FSDP2Strategy()``; ``fsdp2_keep``: ``FSDP2Strategy(reshard_after_forward=False)`` (parameters kept
  gathered from forward to backward: one all-gather per step instead of two);
- ``model_parallel``: Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` with a
  hand-written per-decoder-layer ``fully_shard`` in ``configure_model`` (what its docs show);
- ``ddp``: Lightning's ``DDPStrategy``;
- ``fsdp1``: PyTorch FSDP1 (``FullyShardedDataParallel``) through Lightning's ``FSDPStrategy`` with per-layer
  wrapping (``use_orig_params=True`` for the frozen base); CUDA only (torch refuses FSDP1 on CPU), so it is
  skipped on CPU;
- ``compute_bound``: one process with the same per-process batch and no communication, times the world size.

Runs alternate between contenders and repeat; medians and ratios come from the same run. Tokens/s counts the
tokens of all processes over the timed steps (after warm-up). Peak memory is each rank's ``VmHWM`` above what it
held when ``fit`` started.

    python benchmarks/throughput.py                 # world size 2, 3 repeats
    python benchmarks/throughput.py --scaling       # FSDP2Strategy at world sizes 1, 2 and 4
    python benchmarks/throughput.py --knobs         # compile, activation checkpointing, prefetch (below)
    python benchmarks/throughput.py --tensor-parallel   # FSDP 4, TP 2 x FSDP 2, TP 4 at world size 4 (below)

``--tensor-parallel`` runs world size 4 with one global batch (8 sequences per step) at three layouts:
``FSDP2Strategy()``, ``FSDP2Strategy(tensor_parallel_size=2)`` and ``tensor_parallel_size=4``, each against
``ModelParallelStrategy(data_parallel_size=4 / t, tensor_parallel_size=t)`` with the same plan written by hand with
torch's styles (``tensor_parallel_peer.py``). A tensor group shares one batch, so its per-rank batch is ``t`` times
the FSDP one; tokens/s counts each distinct token once.

``--knobs`` puts FSDP2Strategy's per-block options side by side at world size 2: eager against ``compile=True``,
activation checkpointing of none / every block / every 2nd block / every block saving its matmuls
(``activation_checkpointing_save="matmuls"``), ``forward_prefetch=1``, ``reshard_last_block=False``,
``unmatched_forward_timeout=None`` (the check of forwards outside training off: what it costs training), and the peer
``model_parallel+compile``: ModelParallelStrategy with the hand-written torchtitan recipe (``torch.compile`` each
decoder layer, then ``fully_shard`` it). Compile time is reported apart: the first step's time minus a steady step's.

Writes ``benchmarks/results/throughput.{md,json}`` (or ``scaling.{md,json}``, ``knobs.{md,json}``).
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
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from load_pretrained import _status_kb  # noqa: E402

from tests.helpers import run_distributed  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False)
SEQ, BATCH, WARMUP, TIMED = 256, 2, 2, 6


class LoRALlama(L.LightningModule):
    """The same module for every contender; ``shard`` applies ModelParallelStrategy's hand-written fully_shard (with
    ``tensor_parallel``, the hand-written plan too); ``batch``: the per-data-parallel-rank batch."""

    def __init__(self, shard: bool = False, compile: bool = False, tensor_parallel: bool = False,
                 batch: int = BATCH) -> None:
        super().__init__()
        self.shard, self.compile, self.tensor_parallel, self.batch = shard, compile, tensor_parallel, batch
        self.model = None
        self.times: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        if self.shard and self.tensor_parallel:  # the ModelParallelStrategy way, with the plan written by hand
            from tensor_parallel_peer import parallelize_by_hand

            parallelize_by_hand(model, self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"])
        elif self.shard:  # the ModelParallelStrategy way: the user shards each layer, then the root
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            layers = model.base_model.model.model.layers
            for i, layer in enumerate(layers):
                if self.compile:  # torchtitan's apply_compile: the compiled wrapper replaces the layer, then is sharded
                    layers[i] = layer = torch.compile(layer)
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model = model

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def on_train_start(self) -> None:
        self.times.append(time.perf_counter())

    def on_train_batch_end(self, *args) -> None:
        self.times.append(time.perf_counter())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        # Enough samples for every process to take all its steps in one epoch (no epoch boundary in the timing).
        n = (WARMUP + TIMED) * self.batch * max(self.trainer.world_size, 1)
        data = torch.randint(0, CONFIG["vocab_size"], (n, SEQ), generator=torch.Generator().manual_seed(0))
        return DataLoader(data, batch_size=self.batch)


KNOBS = {  # FSDP2Strategy arguments of the --knobs contenders
    "fsdp2": {},
    "fsdp2+compile": {"compile": True},
    "fsdp2+ac": {"activation_checkpointing_policy": "blocks"},
    "fsdp2+ac_every2": {"activation_checkpointing_policy": "blocks", "activation_checkpointing_every": 2},
    "fsdp2+ac_matmuls": {"activation_checkpointing_policy": "blocks", "activation_checkpointing_save": "matmuls"},
    "fsdp2+compile+ac": {"compile": True, "activation_checkpointing_policy": "blocks"},
    "fsdp2+forward_prefetch": {"forward_prefetch": 1},
    "fsdp2+keep_last_block": {"reshard_last_block": False},
    "fsdp2+no_forward_check": {"unmatched_forward_timeout": None},  # what lockstep.py costs a training step
    "fsdp2+no_peer_watch": {"peer_timeout": None},  # what lockstep.PeerWatch (phases, store thread) costs a step
}


def _strategy(name: str):
    if "@" in name:  # --tensor-parallel: "fsdp2@tp2", "model_parallel@fsdp4"
        contender, layout = name.split("@")
        tensor = int(layout[2:]) if layout.startswith("tp") else 1
        if contender == "fsdp2":
            from lightning_fsdp2 import FSDP2Strategy

            return FSDP2Strategy(tensor_parallel_size=tensor)
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=_world_size() // tensor, tensor_parallel_size=tensor)
    if name in ("fsdp2", "fsdp2_keep"):
        from lightning_fsdp2 import FSDP2Strategy

        return FSDP2Strategy(reshard_after_forward=name == "fsdp2")
    if name in KNOBS:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from lightning_fsdp2 import FSDP2Strategy

        kwargs = dict(KNOBS[name])
        if kwargs.get("activation_checkpointing_policy") == "blocks":
            kwargs["activation_checkpointing_policy"] = {LlamaDecoderLayer}
        return FSDP2Strategy(**kwargs)
    if name.startswith("model_parallel"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    if name == "fsdp1":
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        class CPUFSDPStrategy(FSDPStrategy):  # Lightning checks `type(strategy) is FSDPStrategy` to refuse CPU
            pass

        return CPUFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, use_orig_params=True)
    return "auto"


def _tensor_size(name: str) -> int:
    layout = name.split("@")[1] if "@" in name else ""
    return int(layout[2:]) if layout.startswith("tp") else 1


def _train(name: str, world: int, accelerator: str) -> dict:
    tensor = _tensor_size(name)
    module = LoRALlama(shard=name.startswith("model_parallel"), compile=name.endswith("+compile"),
                       tensor_parallel="@" in name, batch=BATCH * tensor)
    start_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    trainer = L.Trainer(
        accelerator=accelerator, devices=world, strategy=_strategy(name), precision="32-true", max_steps=WARMUP + TIMED,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=name != "compute_bound",
    )
    trainer.fit(module)
    timed = module.times[WARMUP:]  # times[0] is the start of training, times[k] the end of step k
    seconds = timed[-1] - timed[0]
    tokens = TIMED * BATCH * SEQ * world  # distinct tokens: a tensor group's ranks share a batch t times as large
    steady = statistics.median(b - a for a, b in zip(timed, timed[1:]))
    return {"tokens_per_s": tokens / seconds, "peak_mb": (_status_kb("VmHWM") - start_kb) / 1024,
            "first_step_s": module.times[1] - module.times[0], "steady_step_s": steady}


def measure(names: list[str], worlds: dict[str, int], repeats: int, accelerator: str) -> dict[str, dict]:
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else list(reversed(names)):  # alternate the order
            result = run_distributed(_train, worlds[name], name, worlds[name], accelerator, timeout=1800)
            runs[name].append(result)
            print(f"repeat {repeat}: {name} x{worlds[name]}: {result[0]['tokens_per_s']:.0f} tokens/s", flush=True)
    summary = {}
    for name, per_run in runs.items():
        tps = statistics.median(r[0]["tokens_per_s"] for r in per_run)
        peaks = [statistics.median(r[rank]["peak_mb"] for r in per_run) for rank in range(worlds[name])]
        summary[name] = {"tokens_per_s": tps, "peak_mb_per_rank": peaks, "world_size": worlds[name],
                         "first_step_extra_s": [r[0]["first_step_s"] - r[0]["steady_step_s"] for r in per_run]}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scaling", action="store_true", help="FSDP2Strategy at world sizes 1, 2 and 4 instead")
    parser.add_argument("--knobs", action="store_true", help="compile, activation checkpointing and prefetch instead")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="FSDP 4, TP 2 x FSDP 2 and TP 4 at world size 4, each against ModelParallelStrategy")
    parser.add_argument("--tp-world", type=int, default=4, help="--tensor-parallel's world size (default 4)")
    parser.add_argument("--only", nargs="*", help="contenders to run (default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.device_count() >= 4 else "cpu")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_params = _count_parameters()

    if args.scaling:
        names = ["fsdp2@1", "fsdp2@2", "fsdp2@4"]
        runs = {}
        for name in names:
            world = int(name.split("@")[1])
            runs[name] = measure(["fsdp2"], {"fsdp2": world}, args.repeats, args.accelerator)["fsdp2"]
        lines = [f"FSDP2Strategy scaling, LoRA Llama {n_params / 1e6:.0f}M, seq {SEQ}, batch {BATCH} per process, CPU/gloo,"
                 f" 1 thread per process, median of {args.repeats}.", "",
                 "| world size | tokens/s | peak RSS per rank (MB) |", "|---:|---:|---:|"]
        for name, row in runs.items():
            lines.append(f"| {row['world_size']} | {row['tokens_per_s']:.0f} | "
                         + " / ".join(f"{p:.0f}" for p in row["peak_mb_per_rank"]) + " |")
        _write(out / "scaling", runs, lines, f"python benchmarks/throughput.py --scaling --repeats {args.repeats}")
        return

    if args.knobs:
        _knobs(args, out, n_params)
        return

    if args.tensor_parallel:
        _tensor_parallel(args, out, n_params)
        return

    names = args.only or ["fsdp2", "fsdp2_keep", "model_parallel", "ddp", "fsdp1", "compute_bound"]
    skipped = []
    if args.accelerator == "cpu" and "fsdp1" in names:
        names.remove("fsdp1")  # torch: "FSDP needs a non-CPU accelerator device"
        skipped.append("fsdp1 (PyTorch refuses FSDP1 on CPU: run on CUDA)")
    worlds = {n: (1 if n == "compute_bound" else 2) for n in names}
    rows = measure(names, worlds, args.repeats, args.accelerator)
    if "compute_bound" in rows:
        rows["compute_bound"]["tokens_per_s"] *= 2  # one process's throughput times the world size
    base = rows.get("fsdp2", {}).get("tokens_per_s")
    lines = [f"LoRA fine-tuning throughput at world size 2, Llama {n_params / 1e6:.0f}M parameters (LoRA r=8 on q/k/v/o),"
             f" seq {SEQ}, batch {BATCH} per process, fp32, {args.accelerator}, 1 thread per process, median of"
             f" {args.repeats}. compute_bound = one process's tokens/s x 2.", "",
             "| contender | tokens/s | FSDP2Strategy / contender | peak RSS per rank (MB) |", "|---|---:|---:|---:|"]
    for name, row in rows.items():
        ratio = f"{base / row['tokens_per_s']:.2f}x" if base else "-"
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_mb_per_rank"])
        lines.append(f"| {name} | {row['tokens_per_s']:.0f} | {ratio} | {peaks} |")
    lines += [f"\nNot measured: {s}." for s in skipped]
    _write(out / "throughput", rows, lines, f"python benchmarks/throughput.py --repeats {args.repeats}")


def _knobs(args: argparse.Namespace, out: Path, n_params: int) -> None:
    import os
    import tempfile

    # A fresh inductor cache: the first repeat compiles from nothing (cold), later ones find its kernels (warm).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-bench-")
    names = args.only or [*KNOBS, "model_parallel+compile"]
    rows = measure(names, {n: 2 for n in names}, args.repeats, args.accelerator)
    eager, compiled = rows.get("fsdp2", {}).get("tokens_per_s"), rows.get("fsdp2+compile", {}).get("tokens_per_s")
    lines = [f"FSDP2Strategy's per-block options at world size 2, Llama {n_params / 1e6:.0f}M parameters (LoRA r=8 on"
             f" q/k/v/o), seq {SEQ}, batch {BATCH} per process, fp32, {args.accelerator}, 1 thread per process, median"
             f" of {args.repeats}. \"x eager\": tokens/s over plain `fsdp2`'s; \"x peer\": over the hand-written"
             " `model_parallel+compile`'s. \"first step extra\": the first step's time beyond a steady step's"
             " (compilation, for the compiled contenders), in the first repeat (an empty inductor cache) and the"
             " median of the later ones (kernels found in the cache).", "",
             "| contender | tokens/s | x eager | x peer | peak RSS per rank (MB) | first step extra, cold / warm (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    peer = rows.get("model_parallel+compile", {}).get("tokens_per_s")
    for name, row in rows.items():
        ratio = f"{row['tokens_per_s'] / eager:.2f}x" if eager else "-"
        vs_peer = f"{row['tokens_per_s'] / peer:.2f}x" if peer else "-"
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_mb_per_rank"])
        extra = row["first_step_extra_s"]
        warm = f"{statistics.median(extra[1:]):.1f}" if len(extra) > 1 else "-"
        lines.append(f"| {name} | {row['tokens_per_s']:.0f} | {ratio} | {vs_peer} | {peaks} | {extra[0]:.1f} / {warm} |")
    if eager and compiled:
        lines += ["", f"compile / eager: {compiled / eager:.2f}x."]
    command = f"python benchmarks/throughput.py --knobs --repeats {args.repeats}"
    _write(out / "knobs", rows, lines, command + (f" --only {' '.join(args.only)}" if args.only else ""))


def _world_size() -> int:
    import os

    return int(os.environ["WORLD_SIZE"])


def _tensor_parallel(args: argparse.Namespace, out: Path, n_params: int) -> None:
    world = args.tp_world
    layouts = [f"fsdp{world}"] + [f"tp{t}" for t in (2, 4, 8) if t <= world and world % t == 0]
    names = args.only or [f"{c}@{layout}" for layout in layouts for c in ("fsdp2", "model_parallel")]
    rows = measure(names, {n: world for n in names}, args.repeats, args.accelerator)
    lines = [f"Tensor parallelism at world size {world}, Llama {n_params / 1e6:.0f}M parameters (LoRA r=8 on"
             f" q/k/v/o), seq {SEQ}, {BATCH * world} sequences per step (per data-parallel rank: {BATCH} x the"
             f" tensor size), fp32, {args.accelerator}, 1 thread per process, median of {args.repeats}. Peer:"
             " ModelParallelStrategy with the same plan written by hand (torch's styles, then fully_shard).", "",
             "| layout | FSDP2Strategy tokens/s | peer tokens/s | FSDP2Strategy / peer | x FSDP (ours) |"
             " peak RSS per rank, ours / peer (MB) |", "|---|---:|---:|---:|---:|---:|"]
    fsdp = rows.get(f"fsdp2@fsdp{world}", {}).get("tokens_per_s")
    for layout in layouts:
        ours, peer = rows.get(f"fsdp2@{layout}"), rows.get(f"model_parallel@{layout}")
        if ours is None:
            continue
        ratio = f"{ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else "-"
        vs_fsdp = f"{ours['tokens_per_s'] / fsdp:.2f}x" if fsdp else "-"
        peaks = f"{max(ours['peak_mb_per_rank']):.0f} / " + (f"{max(peer['peak_mb_per_rank']):.0f}" if peer else "-")
        theirs = f"{peer['tokens_per_s']:.0f}" if peer else "-"
        lines.append(f"| {layout} | {ours['tokens_per_s']:.0f} | {theirs} | {ratio} | {vs_fsdp} | {peaks} |")
    command = f"python benchmarks/throughput.py --tensor-parallel --repeats {args.repeats}"
    command += f" --tp-world {world}" if world != 4 else ""
    _write(out / "tensor-parallel", rows, lines, command + (f" --only {' '.join(args.only)}" if args.only else ""))


def _count_parameters() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**CONFIG)).parameters())


def _write(stem: Path, rows: dict, lines: list[str], command: str) -> None:
    lines += ["", f"Command: `{command}`"]
    stem.with_suffix(".json").write_text(json.dumps({"rows": rows, "command": command}, indent=2) + "\n")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
