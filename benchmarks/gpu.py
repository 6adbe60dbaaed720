"""One GPU: LoRA fine-tuning throughput, MFU and peak GPU memory of FSDP2Strategy against its peers, side by side.

A 1.1B Llama (hidden 2048, 22 layers, TinyLlama's shape; LoRA r=16 on q/k/v/o), `bf16-true`, sequence 1024, batch 4,
on one CUDA device, in the same run, contenders alternating:

- ``fsdp2``: ``FSDP2Strategy()`` at world size 1 (NCCL, FSDP2's hooks on every decoder layer);
- ``model_parallel``: Lightning's ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)`` with the
  hand-written per-layer ``fully_shard`` its docs show;
- ``single``: Lightning's single-device strategy, no sharding (the compute bound on one GPU);
- ``fsdp2+auto``: ``FSDP2Strategy(device_mesh="auto", batch_shape=...)``: its estimate of the per-rank peak against
  ``max_memory_allocated`` and ``max_memory_reserved`` (how well ``ALLOCATOR_SHARE["cuda"]`` holds);
- with ``--knobs``: ``fsdp2+compile`` (``compile=True``), ``fsdp2+ac`` / ``fsdp2+ac_matmuls`` (every decoder layer
  checkpointed, wholly / saving its matmuls), ``model_parallel+compile`` (the hand-written recipe with
  ``torch.compile`` on each layer before its ``fully_shard``, as torchtitan does).

Tokens/s over the timed steps (after warm-up, `torch.cuda.synchronize` before each clock read); MFU = 4 x parameters x
tokens/s over the GPU's dense bf16 peak (from its name; left out for GPUs not in the table): forward and the input
gradients of the frozen base, no weight gradients and no attention FLOPs counted; peak = the largest
``torch.cuda.max_memory_allocated`` of the fit. ``make gpu-check`` runs it after the CUDA-marked tests:

    python benchmarks/gpu.py --repeats 1
    python benchmarks/gpu.py --repeats 1 --knobs     # compile and activation checkpointing too (not in gpu-check)
    python benchmarks/gpu.py --repeats 1 --tensor-parallel   # 2+ GPUs: FSDP vs TP 2 x FSDP, each vs the peer

``--tensor-parallel`` (on a machine with two or more GPUs; not in gpu-check, which has one) runs every GPU as one
process, with one global batch (``BATCH`` x the GPUs per step): ``FSDP2Strategy()`` and
``FSDP2Strategy(tensor_parallel_size=2)``, each against ``ModelParallelStrategy`` with the same layout and the same
plan written by hand with torch's styles (``tensor_parallel_peer.py``). Writes ``gpu-tensor-parallel.{md,json}``.

Writes ``benchmarks/results/gpu-throughput.{md,json}``.
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

from lightning_fsdp2 import FSDP2Precision  # noqa: E402
from tests.helpers import run_distributed  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
              num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)
SEQ, BATCH, WARMUP, TIMED = 1024, 4, 3, 10
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
             "L4": 121e12, "A10": 125e12}  # dense bf16 FLOP/s, from the vendors' data sheets


class LoRALlama(L.LightningModule):
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
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                      "o_proj"]))
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

    def on_train_batch_end(self, *args) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        data = torch.randint(0, CONFIG["vocab_size"], ((WARMUP + TIMED) * self.batch * self.trainer.world_size, SEQ),
                             generator=torch.Generator().manual_seed(0))
        return DataLoader(data, batch_size=self.batch)


KNOBS = {"fsdp2+compile": {"compile": True}, "fsdp2+ac": {"activation_checkpointing_policy": "blocks"},
         "fsdp2+ac_matmuls": {"activation_checkpointing_policy": "blocks", "activation_checkpointing_save": "matmuls"}}


def _strategy(name: str, world: int = 1):
    if "@" in name:  # --tensor-parallel: "fsdp2@tp2", "model_parallel@fsdp"
        contender, layout = name.split("@")
        tensor = 2 if layout == "tp2" else 1
        if contender == "fsdp2":
            from lightning_fsdp2 import FSDP2Strategy

            return FSDP2Strategy(tensor_parallel_size=tensor)
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=world // tensor, tensor_parallel_size=tensor)
    if name == "fsdp2+auto":  # the layout chosen from memory, the activations estimated for this batch
        from lightning_fsdp2 import FSDP2Strategy

        return FSDP2Strategy(device_mesh="auto", batch_shape=(BATCH, SEQ))
    if name == "fsdp2" or name in KNOBS:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        from lightning_fsdp2 import FSDP2Strategy

        kwargs = dict(KNOBS.get(name, {}))
        if kwargs.get("activation_checkpointing_policy") == "blocks":
            kwargs["activation_checkpointing_policy"] = {LlamaDecoderLayer}
        return FSDP2Strategy(**kwargs)
    if name.startswith("model_parallel"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    return "auto"


def _train(name: str, world: int = 1) -> dict:
    tensor = 2 if name.endswith("@tp2") else 1
    module = LoRALlama(shard=name.startswith("model_parallel"), compile=name.endswith("+compile"),
                       tensor_parallel="@" in name, batch=BATCH * tensor)
    torch.cuda.reset_peak_memory_stats()
    strategy = _strategy(name, world)
    # The same work for every contender: Lightning's stock bf16-true casts the adapters to bf16, so FSDP2Strategy's
    # precision keeps them in bf16 too here (its default stores them in fp32).
    precision = ({"plugins": [FSDP2Precision("bf16-true", adapter_dtype=None)]} if name.startswith("fsdp2")
                 else {"precision": "bf16-true"})
    trainer = L.Trainer(accelerator="cuda", devices=world, strategy=strategy, **precision,
                        max_steps=WARMUP + TIMED, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)
    timed = module.times[WARMUP - 1:]
    choice = getattr(strategy, "layout_choice", None)
    return {"tokens_per_s": TIMED * BATCH * SEQ * world / (timed[-1] - timed[0]),  # distinct tokens
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30, "gpu": torch.cuda.get_device_name(),
            "reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
            "estimate_gb": choice.chosen.total / 2**30 if choice is not None else None,
            "estimate_tensors_gb": (choice.chosen.total - choice.chosen.allocator) / 2**30 if choice else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--knobs", action="store_true", help="also compile and activation checkpointing contenders")
    parser.add_argument("--tensor-parallel", action="store_true", help="FSDP and TP 2 x FSDP over every GPU (2+)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device.")
    if args.tensor_parallel:
        _tensor_parallel(args)
        return
    names = ["fsdp2", "model_parallel", "single", "fsdp2+auto"] + ([*KNOBS, "model_parallel+compile"] if args.knobs else [])
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else list(reversed(names)):
            (result,) = run_distributed(_train, 1, name, timeout=1200)
            runs[name].append(result)
            print(f"repeat {repeat}: {name}: {result['tokens_per_s']:.0f} tokens/s, {result['peak_gb']:.2f} GB",
                  flush=True)
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        n_params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**CONFIG)).parameters())
    gpu = runs["fsdp2"][0]["gpu"]
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    rows = {}
    for name, results in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in results)
        rows[name] = {"tokens_per_s": tps, "peak_gb": max(r["peak_gb"] for r in results),
                      "mfu": 4 * n_params * tps / peak if peak else None,
                      **{k: results[0][k] for k in ("reserved_gb", "estimate_gb", "estimate_tensors_gb")}}
    command = f"python benchmarks/gpu.py --repeats {args.repeats}" + (" --knobs" if args.knobs else "")
    lines = [f"LoRA (r=16, q/k/v/o) on a {n_params / 1e9:.2f}B Llama, bf16-true, seq {SEQ}, batch {BATCH}, one {gpu},"
             f" median of {args.repeats}; all adapters bf16. MFU: 4 x parameters x tokens/s over the dense bf16 peak.", "",
             "| contender | tokens/s | FSDP2Strategy / contender | MFU | peak GPU memory (GB) |", "|---|---:|---:|---:|---:|"]
    for name, row in rows.items():
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
        lines.append(f"| {name} | {row['tokens_per_s']:.0f} | {rows['fsdp2']['tokens_per_s'] / row['tokens_per_s']:.2f}x"
                     f" | {mfu} | {row['peak_gb']:.2f} |")
    auto = rows["fsdp2+auto"]
    if auto["estimate_gb"] is not None:
        lines += ["", f"`device_mesh=\"auto\"`'s estimate of the chosen layout: {auto['estimate_gb']:.2f} GB"
                  f" ({auto['estimate_tensors_gb']:.2f} GB in tensors, the rest the allocator's share) against"
                  f" max_memory_allocated {auto['peak_gb']:.2f} GB and max_memory_reserved {auto['reserved_gb']:.2f} GB"
                  f" (estimate / allocated: {auto['estimate_tensors_gb'] / auto['peak_gb']:.2f}x in tensors,"
                  f" {auto['estimate_gb'] / auto['reserved_gb']:.2f}x of reserved)."]
    lines += ["", f"Command: `{command}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-throughput.json").write_text(json.dumps({"gpu": gpu, "rows": rows, "command": command}, indent=2) + "\n")
    (out / "gpu-throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _tensor_parallel(args: argparse.Namespace) -> None:
    world = min(torch.cuda.device_count(), 8)
    if world < 2:
        raise SystemExit("benchmarks/gpu.py --tensor-parallel needs two or more GPUs (one process each).")
    names = [f"{c}@{layout}" for layout in ("fsdp", "tp2") for c in ("fsdp2", "model_parallel")]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else list(reversed(names)):
            result = run_distributed(_train, world, name, world, timeout=1800)
            runs[name].append(result[0] | {"peak_gb": max(r["peak_gb"] for r in result)})
            print(f"repeat {repeat}: {name}: {result[0]['tokens_per_s']:.0f} tokens/s", flush=True)
    rows = {n: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "peak_gb": max(r["peak_gb"] for r in rs)} for n, rs in runs.items()}
    gpu = runs[names[0]][0]["gpu"]
    command = f"python benchmarks/gpu.py --repeats {args.repeats} --tensor-parallel"
    lines = [f"LoRA (r=16, q/k/v/o) on the 1.1B Llama, bf16-true, seq {SEQ}, {BATCH * world} sequences per step,"
             f" {world} x {gpu}, median of {args.repeats}. Peer: ModelParallelStrategy with the same layout and plan"
             " by hand.", "",
             "| layout | FSDP2Strategy tokens/s | peer tokens/s | FSDP2Strategy / peer |"
             " peak GPU memory per rank, ours /"
             " peer (GB) |", "|---|---:|---:|---:|---:|"]
    for layout in ("fsdp", "tp2"):
        ours, peer = rows[f"fsdp2@{layout}"], rows[f"model_parallel@{layout}"]
        ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
        lines.append(f"| {layout} | {ours['tokens_per_s']:.0f} | {peer['tokens_per_s']:.0f} | {ratio:.2f}x |"
                     f" {ours['peak_gb']:.2f} / {peer['peak_gb']:.2f} |")
    lines += ["", f"Command: `{command}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"gpu": gpu, "rows": rows, "command": command}
    (out / "gpu-tensor-parallel.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "gpu-tensor-parallel.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
