"""Context parallelism against FSDP alone on long sequences: the longest sequence that trains on an emulated device
per rank, and tokens/s and memory per rank at one long sequence.

One Llama of 4 layers (hidden 256, 8 query and 4 key/value heads, vocabulary 4096; built on ``meta`` and initialized
by the strategy), LoRA r=8 on q/k/v/o with AdamW, fp32 on CPU/gloo (one thread per process), one sequence per
batch, the same plain loop (forward with labels, backward, the optimizer's step) for every contender:

- ``cp``: Fabric with ``FSDP2Strategy(context_parallel_size=2)`` at world size 2: both ranks read one sequence, each
  keeps half of its tokens through the layers (an all-to-all before and after attention);
- ``fsdp``: ``FSDP2Strategy()`` at world size 2: each rank a sequence of its own, whole;
- ``one``: the model in one process without this package (``--at`` only, where it fits).

``--longest`` (default): on an emulated device of ``--device-mib`` per rank (a process whose resident set grows past
what it held once the model was set up plus the device size is killed, exit code 137, as by the OOM killer; its peak
looked at every 10 ms), sequences from 1024 tokens up by steps of 1.25x until a contender is killed: the longest
that trains 2 steps. ``--at N``: at N tokens, 2 untimed and 3 timed steps, median of ``--repeats`` (contenders
alternated): tokens/s (every token the world trains per second: a context group trains one sequence, FSDP's ranks one
each) and what training added to each rank's resident set (its ``VmHWM`` above what it held once set up). The time
the all-to-alls take is measured on the cp ranks (wall time inside them, forward; backward's are not timed).

    python benchmarks/context_parallel.py --longest --device-mib 400
    python benchmarks/context_parallel.py --at 4096 --repeats 2

Writes ``benchmarks/results/context-parallel.{md,json}`` (both parts; each run updates its own).
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

from auto_layout import _watch  # noqa: E402
from load_pretrained import _status_kb  # noqa: E402

from tests.helpers import run_distributed  # noqa: E402

CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=1 << 17, tie_word_embeddings=False)
WARMUP, TIMED = 2, 3
CONTENDERS = ("cp", "fsdp", "one")


def _set_up(name: str):
    """(model, optimizer, backward) for contender ``name`` on this rank."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    lora = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    config = LlamaConfig(**CONFIG, attn_implementation="sdpa")
    if name == "one":
        torch.manual_seed(0)
        model = get_peft_model(LlamaForCausalLM(config), lora)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4), \
            torch.Tensor.backward
    import lightning as L

    from lightning_fsdp2.fabric import FSDP2Strategy

    world = int(os.environ["WORLD_SIZE"])
    strategy = FSDP2Strategy(context_parallel_size=world) if name == "cp" else FSDP2Strategy()
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="32-true")
    fabric.launch()
    with fabric.init_module():
        model = get_peft_model(LlamaForCausalLM(config), lora)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4))
    return model, optimizer, fabric.backward


def _train(name: str, tokens: int, steps: int, device_mib: int | None) -> dict:
    torch.set_num_threads(1)
    model, optimizer, backward = _set_up(name)
    exchanged = [0.0]
    if name == "cp":  # wall time inside the all-to-alls (forward)
        from lightning_fsdp2 import context_parallel

        original = context_parallel._all_to_all

        def timed(x, group):
            start = time.perf_counter()
            out = original(x, group)
            exchanged[0] += time.perf_counter() - start
            return out

        context_parallel._all_to_all = timed
    rank = int(os.environ.get("RANK", 0))
    sequences = 1 if name == "cp" else int(os.environ.get("WORLD_SIZE", 1))  # the sequences the world trains
    generator = torch.Generator().manual_seed(0 if name == "cp" else rank)
    batches = [torch.randint(0, CONFIG["vocab_size"], (1, tokens), generator=generator) for _ in range(steps)]
    loaded_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)
    if device_mib is not None:
        _watch(loaded_kb * 1024 + device_mib * 2**20)
    first = min(WARMUP, steps - 1)  # the first timed step
    times = [time.perf_counter()]
    for step, batch in enumerate(batches):
        if step == first:
            exchanged[0] = 0.0
        loss = model(input_ids=batch, labels=batch).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        float(loss.detach())
        times.append(time.perf_counter())
    seconds = times[-1] - times[first]
    return {"tokens_per_s": (steps - first) * tokens * sequences / seconds, "step_s": seconds / (steps - first),
            "all_to_all_s": exchanged[0] / (steps - first), "peak_mb": (_status_kb("VmHWM") - loaded_kb) / 1024}


def _run(name: str, tokens: int, steps: int, device_mib: int | None) -> list[dict] | None:
    """Every rank's result, or ``None`` when a rank went past the emulated device."""
    world = 1 if name == "one" else 2
    try:
        return run_distributed(_train, world, name, tokens, steps, device_mib, timeout=3600)
    except RuntimeError as err:
        if "exited with 137" in str(err):
            return None
        raise


def longest(device_mib: int) -> dict:
    found = {}
    for name in ("cp", "fsdp"):
        tokens, last = 1024, None
        while tokens <= 1 << 16:
            result = _run(name, tokens, 2, device_mib)
            print(f"{name} at {tokens} tokens: {'killed' if result is None else 'trains'}", flush=True)
            if result is None:
                break
            last = {"tokens": tokens, "peak_mb_per_rank": [r["peak_mb"] for r in result]}
            tokens = int(tokens * 1.25) // 128 * 128
        found[name] = {**(last or {"tokens": 0}), "killed_at": tokens}
    return found


def at(tokens: int, repeats: int) -> dict:
    runs: dict[str, list[list[dict]]] = {n: [] for n in CONTENDERS}
    for repeat in range(repeats):
        for name in CONTENDERS if repeat % 2 == 0 else list(reversed(CONTENDERS)):
            result = _run(name, tokens, WARMUP + TIMED, None)
            assert result is not None
            runs[name].append(result)
            print(f"repeat {repeat}: {name}: {result[0]['tokens_per_s']:.0f} tokens/s,"
                  f" +{max(r['peak_mb'] for r in result):.0f} MB", flush=True)
    return {name: {
        "tokens_per_s": statistics.median(r[0]["tokens_per_s"] for r in per_run),
        "step_s": statistics.median(r[0]["step_s"] for r in per_run),
        "all_to_all_s": statistics.median(max(x["all_to_all_s"] for x in r) for r in per_run),
        "peak_mb_per_rank": [statistics.median(r[k]["peak_mb"] for r in per_run) for k in range(len(per_run[0]))],
        "runs": per_run,
    } for name, per_run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--longest", action="store_true", help="the longest sequence on an emulated device (default)")
    parser.add_argument("--device-mib", type=int, default=400)
    parser.add_argument("--at", type=int, help="tokens/s and memory at this sequence length")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--render", action="store_true", help="rewrite the tables from the saved JSON, run nothing")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    out = Path(args.out) / "context-parallel"
    saved = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    if not args.render:
        if args.at:
            saved["at"] = {"tokens": args.at, "repeats": args.repeats, "rows": at(args.at, args.repeats),
                           "command": f"python benchmarks/context_parallel.py --at {args.at} --repeats {args.repeats}"}
        else:
            saved["longest"] = {"device_mib": args.device_mib, "rows": longest(args.device_mib),
                                "command": f"python benchmarks/context_parallel.py --longest --device-mib"
                                           f" {args.device_mib}"}
        out.with_suffix(".json").write_text(json.dumps(saved, indent=2) + "\n")
    lines = _tables(saved)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _tables(saved: dict) -> list[str]:
    lines = [
        f"Llama, {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, {CONFIG['num_attention_heads']}"
        f" query / {CONFIG['num_key_value_heads']} key-value heads, vocabulary {CONFIG['vocab_size']}; LoRA r=8 on"
        " q/k/v/o, AdamW, fp32, sdpa, one sequence per batch, cpu, 1 thread per process. CP 2:"
        " `FSDP2Strategy(context_parallel_size=2)` at world size 2 (the two ranks share one sequence); FSDP:"
        " `FSDP2Strategy()` at world size 2 (a sequence per rank); one process: the same model without this package.",
    ]
    if "longest" in saved:
        part = saved["longest"]
        lines += ["", f"Longest sequence that trains (2 steps) on an emulated device of {part['device_mib']} MiB per"
                  " rank above the set-up model (sequences from 1024 tokens, x1.25 each try):", "",
                  "| layout | longest sequence (tokens) | killed at | added per rank at the longest (MB) |",
                  "|---|---:|---:|---:|"]
        for name, label in (("cp", "CP 2"), ("fsdp", "FSDP")):
            row = part["rows"][name]
            peak = max(row.get("peak_mb_per_rank") or [0])
            lines.append(f"| {label} | {row['tokens']} | {row['killed_at']} | {peak:.0f} |")
        cp, fsdp = part["rows"]["cp"]["tokens"], part["rows"]["fsdp"]["tokens"]
        if fsdp:
            lines += ["", f"CP 2 trains {cp / fsdp:.2f}x the sequence length of FSDP alone on the same memory."]
        lines += ["", f"Command: `{part['command']}`"]
    if "at" in saved:
        part = saved["at"]
        rows = part["rows"]
        lines += ["", f"At {part['tokens']} tokens per sequence, {TIMED} timed steps after {WARMUP}, median of"
                  f" {part['repeats']} (contenders alternated):", "",
                  "| layout | tokens/s (world) | x FSDP | s per step | all-to-alls per step, forward (s) |"
                  " added per rank (MB) | x FSDP |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        fsdp = rows["fsdp"]
        for name, label in (("cp", "CP 2 (world 2)"), ("fsdp", "FSDP (world 2)"), ("one", "one process")):
            row = rows[name]
            peak = max(row["peak_mb_per_rank"])
            exchanged = f"{row['all_to_all_s']:.2f}" if name == "cp" else "-"
            lines.append(f"| {label} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / fsdp['tokens_per_s']:.2f}x |"
                         f" {row['step_s']:.2f} | {exchanged} | {peak:.0f} |"
                         f" {peak / max(fsdp['peak_mb_per_rank']):.2f}x |")
        lines += ["", f"Command: `{part['command']}`"]
    return lines


if __name__ == "__main__":
    main()
