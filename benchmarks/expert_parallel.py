"""Expert parallelism against FSDP alone and against transformers' own expert parallelism, measured side by side.

One Qwen3-MoE of about 216M parameters (6 layers, 32 experts of every MoE layer, top-2; saved once by
``save_pretrained``), in fp32 on CPU/gloo (one thread per process), the same plain loop (forward with labels,
backward, AdamW's step) and the same batches for every contender, at world sizes 2 and 4, fully fine-tuned and (with
``--lora``) with LoRA r=8 on the attention projections, the experts frozen:

- ``ep``: Fabric with ``FSDP2Strategy(expert_parallel_size=W)`` (each rank ``32 / W`` whole experts of every layer),
  the model built on ``meta`` under ``init_module`` and read by ``load_pretrained``;
- ``fsdp``: the same with ``FSDP2Strategy()`` (every expert of a layer all-gathered on every rank, forward and
  backward);
- ``peer``: transformers' own ``AutoModelForCausalLM.from_pretrained(path,
  distributed_config=DistributedConfig(fsdp_size=W, ep_size=W))`` (its FSDP2 and its expert-parallel styles), driven
  by the same loop. Fully fine-tuned only: transformers shards the model inside ``from_pretrained``, before peft
  could add adapters, which its FSDP groups would then neither shard nor reduce.

Runs alternate between contenders and repeat; medians come from the same run. Tokens/s counts the tokens of all
processes over the timed steps (after warm-up). Memory: each rank's ``VmHWM`` above what it held once the model was
set up (its shards loaded), what training adds (gathered parameters, activations, gradients, AdamW's state, the
all-to-alls' buffers); and the resident peak itself (loaded + added), which also counts what each loader left
resident (transformers' ``from_pretrained`` keeps more).

    python benchmarks/expert_parallel.py --repeats 2          # fully fine-tuned
    python benchmarks/expert_parallel.py --repeats 2 --lora   # LoRA on attention, the experts frozen

Writes ``benchmarks/results/expert-parallel.{md,json}`` (``expert-parallel-lora.*`` with ``--lora``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from load_pretrained import _status_kb  # noqa: E402

from tests.helpers import run_distributed  # noqa: E402

CONFIG = dict(vocab_size=16384, hidden_size=640, intermediate_size=1280, moe_intermediate_size=512,
              num_hidden_layers=6, num_attention_heads=10, num_key_value_heads=2, head_dim=64, num_experts=32,
              num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=512, tie_word_embeddings=False,
              output_router_logits=False)
SEQ, BATCH, WARMUP, TIMED = 128, 2, 2, 4
CONTENDERS = ("ep", "fsdp", "peer")


def _model(path: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).save_pretrained(path, max_shard_size="500MB")


def _set_up(name: str, path: str, lora: bool):
    """(the model to call, the optimizer, backward, a synchronizing barrier) for contender ``name`` on this rank."""
    world = int(os.environ["WORLD_SIZE"])
    if name == "peer":
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(fsdp_size=world, ep_size=world), dtype=torch.float32)
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5), torch.Tensor.backward, dist.barrier
    import lightning as L
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lightning_fsdp2 import load_pretrained
    from lightning_fsdp2.fabric import FSDP2Strategy

    strategy = FSDP2Strategy(expert_parallel_size=world) if name == "ep" else FSDP2Strategy()
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    with fabric.init_module():
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
        load_pretrained(model, path)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model = fabric.setup_module(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(trained, lr=1e-5))
    return model, optimizer, fabric.backward, fabric.barrier


def _train(name: str, path: str, lora: bool) -> dict:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    model, optimizer, backward, barrier = _set_up(name, path, lora)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=generator)
               for _ in range(WARMUP + TIMED)]
    barrier()
    loaded_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    times = [time.perf_counter()]
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        float(loss.detach())
        times.append(time.perf_counter())
    seconds = times[-1] - times[WARMUP]
    world = int(os.environ["WORLD_SIZE"])
    return {"tokens_per_s": TIMED * BATCH * SEQ * world / seconds, "loaded_mb": loaded_kb / 1024,
            "peak_mb": (_status_kb("VmHWM") - loaded_kb) / 1024}


def measure(worlds: list[int], names: list[str], repeats: int, path: Path, lora: bool) -> dict:
    runs: dict[tuple[int, str], list[list[dict]]] = {(w, n): [] for w in worlds for n in names}
    for repeat in range(repeats):
        for world in worlds:
            for name in names if repeat % 2 == 0 else list(reversed(names)):  # alternate the order
                result = run_distributed(_train, world, name, str(path), lora, timeout=1800)
                runs[(world, name)].append(result)
                print(f"repeat {repeat}: {name} x{world}: {result[0]['tokens_per_s']:.0f} tokens/s,"
                      f" +{max(r['peak_mb'] for r in result):.0f} MB", flush=True)
    summary = {}
    for (world, name), per_run in runs.items():
        summary[f"{name}@{world}"] = {
            "tokens_per_s": statistics.median(r[0]["tokens_per_s"] for r in per_run),
            "peak_mb_per_rank": [statistics.median(r[k]["peak_mb"] for r in per_run) for k in range(world)],
            "loaded_mb_per_rank": [statistics.median(r[k]["loaded_mb"] for r in per_run) for k in range(world)],
            "runs": per_run,  # every repeat, every rank: the pairs the medians come from
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--only", nargs="*", choices=CONTENDERS, help="contenders to run (default: all)")
    parser.add_argument("--lora", action="store_true", help="LoRA r=8 on attention, the experts frozen (no peer)")
    parser.add_argument("--render", action="store_true", help="rewrite the table from the saved JSON, run nothing")
    parser.add_argument("--cache", default=str(ROOT / "benchmarks" / ".cache"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    out = Path(args.out) / ("expert-parallel-lora" if args.lora else "expert-parallel")
    names = [n for n in args.only or CONTENDERS if not (args.lora and n == "peer")]
    if args.render:
        saved = json.loads(out.with_suffix(".json").read_text())
        rows, command, repeats = saved["rows"], saved["command"], saved.get("repeats", args.repeats)
        names = [n for n in CONTENDERS if any(k.startswith(f"{n}@") for k in rows)]
        worlds = sorted({int(k.split("@")[1]) for k in rows})
    else:
        path = Path(args.cache) / "qwen3-moe-216m"
        _model(path)
        rows, repeats, worlds = measure(args.worlds, names, args.repeats, path, args.lora), args.repeats, args.worlds
        command = f"python benchmarks/expert_parallel.py --repeats {args.repeats}" + (" --lora" if args.lora else "")
        command += f" --worlds {' '.join(map(str, args.worlds))}" if args.worlds != [2, 4] else ""
        command += f" --only {' '.join(args.only)}" if args.only else ""
        out.with_suffix(".json").write_text(
            json.dumps({"rows": rows, "command": command, "repeats": repeats}, indent=2) + "\n")
    lines = _table(rows, names, worlds, args.lora, repeats) + ["", f"Command: `{command}`"]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _table(rows: dict, names: list[str], worlds: list[int], lora: bool, repeats: int) -> list[str]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    lines = [
        f"Qwen3-MoE {total / 1e6:.0f}M parameters ({experts / 1e6:.0f}M in experts: {CONFIG['num_experts']} per layer,"
        f" top-{CONFIG['num_experts_per_tok']}, {CONFIG['num_hidden_layers']} layers), "
        + ("LoRA r=8 on q/k/v/o (the experts frozen)" if lora else "fully fine-tuned") + " with AdamW,"
        f" seq {SEQ}, {BATCH} sequences per rank per step, fp32, cpu, 1 thread per process, median of {repeats}."
        " EP: expert_parallel_size = world size."
        + ("" if lora else " Peer: transformers' from_pretrained(distributed_config=DistributedConfig("
           "fsdp_size=W, ep_size=W)) in the same loop.")
        + " Memory, the largest rank's: what training added to the loaded model, and the resident peak (loaded +"
        " added), which counts what each loader left resident.",
        "",
        "| world | layout | tokens/s | x FSDP (ours) | x peer | added per rank (MB) | resident peak per rank (MB) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for world in worlds:
        fsdp, peer = rows.get(f"fsdp@{world}"), rows.get(f"peer@{world}")
        for name in names:
            row = rows[f"{name}@{world}"]
            tps = row["tokens_per_s"]
            vs_fsdp = f"{tps / fsdp['tokens_per_s']:.2f}x" if fsdp else "-"
            vs_peer = f"{tps / peer['tokens_per_s']:.2f}x" if peer else "-"
            label = {"ep": f"FSDP2Strategy(expert_parallel_size={world})", "fsdp": "FSDP2Strategy()",
                     "peer": f"transformers, ep_size={world}"}[name]
            resident = max(a + b for a, b in zip(row["peak_mb_per_rank"], row["loaded_mb_per_rank"]))
            lines.append(f"| {world} | {label} | {tps:.0f} | {vs_fsdp} | {vs_peer} |"
                         f" {max(row['peak_mb_per_rank']):.0f} | {resident:.0f} |")
    return lines


if __name__ == "__main__":
    main()
