"""Collect the latest benchmark results into ``docs/performance.md`` and plots in ``benchmarks/results/``.

    python benchmarks/report.py      # run by `make bench` after the benchmarks

Reads ``benchmarks/results/*.json`` and ``*.md`` (written by real_model.py (two tables), throughput.py (four tables),
auto_layout.py (two), expert_parallel.py (two), context_parallel.py, load_pretrained.py, save.py and memory.py); sections
whose results are missing say so.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

SECTIONS = [
    ("The real model: SmolLM2-135M-Instruct", "real-model", "LoRA fine-tuning of the demo's model (the real pretrained"
     " weights, its task's tokens) at world size 2 in `bf16-true`: FSDP2Strategy's default and `device_mesh=\"auto\"`"
     " against Lightning's DDP and ModelParallelStrategy with hand-written `fully_shard`, each loading the weights its"
     " own way (start-up: `load_pretrained` against `from_pretrained` on every rank, and against rank 0 reading the"
     " file and DCP broadcasting it)."),
    ("The real model on an NF4 base (QLoRA)", "real-model-nf4", "The same with the base's MLP weights in NF4 (the"
     " attention projections, which NF4 cannot split evenly over 2 processes, stay bf16, as in the demo's `--qlora`):"
     " FSDP2Strategy quantizing as it loads, against DDP on a base quantized in place by torchao's `to_nf4` in every"
     " process. ModelParallelStrategy is not run here: an NF4 base under hand-written `fully_shard` needs a"
     " hand-written quantize-then-distribute load (torchtune's), which is not its documented recipe."),
    ("Training throughput", "throughput", "LoRA fine-tuning at world size 2 against Lightning's ModelParallelStrategy "
     "(hand-written per-layer fully_shard), DDP, FSDP1 and the compute bound."),
    ("Scaling", "scaling", "FSDP2Strategy at world sizes 1, 2 and 4."),
    ("Compile, activation checkpointing, prefetch", "knobs", "FSDP2Strategy's per-block options side by side, against "
     "the hand-written ModelParallelStrategy recipe with torch.compile."),
    ("The check of forwards outside training, in training steps", "forward-check", "What "
     "`unmatched_forward_timeout` costs a training step: FSDP2Strategy with it (the default) and without, side by side "
     "(`python benchmarks/throughput.py --knobs --only fsdp2 fsdp2+no_forward_check --repeats 3 --out DIR`, copied to"
     " `forward-check.*`)."),
    ("The watch for peers that moved on, in training steps", "peer-watch", "What `peer_timeout` costs a training step:"
     " FSDP2Strategy with it (the default: each rank's phase published by a thread, the process groups' timeout"
     " lowered) and without, side by side (`python benchmarks/throughput.py --knobs --only fsdp2 fsdp2+no_peer_watch"
     " fsdp2 fsdp2+no_peer_watch --repeats 2 --out DIR`, copied to `peer-watch.*`)."),
    ("Checkpoint checksums", "integrity", "What the CRC-32s of `verify_checkpoints` cost: torch writing them (its"
     " default) against not, to the disk and into memory, and verifying against reading the same bytes from the page"
     " cache and from the disk; and the candidate digests' speed on one core"
     " (`python benchmarks/integrity.py --sizes 1.1 1.5 --repeats 5`, as root to drop the page cache)."),
    ("Tensor parallelism", "tensor-parallel", "FSDP over 4, TP 2 x FSDP 2 and TP 4 at world size 4 (one global batch),"
     " each against Lightning's ModelParallelStrategy with the same plan written by hand. On CPUs with gloo TP is"
     " expected to be slower than FSDP: its all-reduces sit on the critical path of every layer, on the same cores"
     " that compute; `benchmarks/gpu.py --tensor-parallel` measures it on two or more GPUs."),
    ("Expert parallelism: fully fine-tuned", "expert-parallel", "A Qwen3-MoE of 216M parameters (32 experts per"
     " layer) at world sizes 2 and 4: `FSDP2Strategy(expert_parallel_size=W)` against `FSDP2Strategy()` and against"
     " transformers' own FSDP2 with expert parallelism (`from_pretrained(..., distributed_config=DistributedConfig("
     "fsdp_size=W, ep_size=W))`), each driven by the same plain loop (`python benchmarks/expert_parallel.py --repeats"
     " 2`)."),
    ("Expert parallelism: LoRA, the experts frozen", "expert-parallel-lora", "The same model with LoRA on attention,"
     " against FSDP alone (transformers' peer shards inside `from_pretrained`, before peft could add adapters: not"
     " run) (`python benchmarks/expert_parallel.py --repeats 2 --lora`)."),
    ("Context parallelism", "context-parallel", "A 4-layer Llama with LoRA on one long sequence per batch:"
     " `FSDP2Strategy(context_parallel_size=2)` (two ranks share each sequence) against `FSDP2Strategy()` (a sequence"
     " per rank) at world size 2, and one process: the longest sequence that trains on an emulated device per rank"
     " (`python benchmarks/context_parallel.py --longest --device-mib 400`), then tokens/s and memory per rank at 4096"
     " tokens (`python benchmarks/context_parallel.py --at 4096 --repeats 2`)."),
    ("The layout chosen from memory: the estimate", "auto-estimate", "`device_mesh=\"auto\"`'s per-rank estimate of the"
     " two layouts at world size 2 (whole replicas, full sharding) against the measured peak resident set, at three"
     " model sizes (`python benchmarks/auto_layout.py --estimate`)."),
    ("The layout chosen from memory: against DDP and full sharding", "auto-layout", "`device_mesh=\"auto\"` on an"
     " emulated device (each process's memory capped), against Lightning's DDP and `FSDP2Strategy()`, where DDP fits,"
     " in between, and where it does not (`python benchmarks/auto_layout.py --contest --repeats 3 --timed 10`)."),
    ("The layout chosen from memory: the in-between case again", "auto-layout-deep", "The 48-layer model on 3.6 GiB"
     " alone, 5 repeats of 10 timed steps after 3 untimed (`python benchmarks/auto_layout.py --contest --cases"
     " deep:3.6:1x64 --repeats 5 --timed 10 --name auto-layout-deep`)."),
    ("Start-up: loading a pretrained model", "load_pretrained-large", "load_pretrained on meta against an eager build "
     "plus whole-state-dict load then sharding, against transformers sharding the model itself "
     "(`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))`, which FSDP2Strategy refuses to take "
     "over; timed around `from_pretrained` alone in a bare process group, while load_pretrained's time runs through "
     "Lightning's set-up to the first step: not like for like, an upper bound on the gap), and against reading the "
     "rank's share of the bytes."),
    ("Saving", "save", "Full and sharded checkpoints as the model grows, against Lightning's ModelParallelStrategy; "
     "asynchronous sharded saves during training."),
    ("LoRA memory: fp32, bf16, fp32 adapters on bf16, NF4 (QLoRA)", "memory", "The same LoRA fine-tune in four "
     "storage layouts: parameter bytes and peak memory per rank, and throughput."),
    ("Largest LoRA shapes at world size 2", "largest", "Every shape `benchmarks/largest.py` tried, per layout, and the"
     " largest that trained (not part of `make bench`: about 10 minutes a bf16 shape, 15 to 25 an NF4 one)."),
    ("A 7B-shaped Llama with an NF4 base", "largest-nf4-h4096-l32", "QLoRA at world size 2 on this 23 GiB machine "
     "(`python benchmarks/largest.py --layout nf4`, not part of `make bench`: about 20 minutes)."),
    ("The same 7B shape with a bf16 base", "largest-bf16-h4096-l32", "The bf16-true peer of the run above "
     "(`python benchmarks/largest.py --layout bf16`)."),
]


def plots() -> list[str]:
    """Bar chart of throughput and a scaling line, as PNGs next to the results; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    throughput = RESULTS / "throughput.json"
    if throughput.exists():
        rows = json.loads(throughput.read_text())["rows"]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar(list(rows), [r["tokens_per_s"] for r in rows.values()], color="C0")
        ax.set_ylabel("tokens/s")
        ax.set_title("LoRA fine-tuning, world size 2")
        fig.tight_layout()
        fig.savefig(RESULTS / "throughput.png", dpi=100)
        plt.close(fig)
        made.append("throughput.png")
    scaling = RESULTS / "scaling.json"
    if scaling.exists():
        rows = json.loads(scaling.read_text())["rows"]
        worlds = [r["world_size"] for r in rows.values()]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(worlds, [r["tokens_per_s"] for r in rows.values()], marker="o", label="tokens/s")
        ax.set_xlabel("processes")
        ax.set_ylabel("tokens/s")
        ax2 = ax.twinx()
        ax2.plot(worlds, [max(r["peak_mb_per_rank"]) for r in rows.values()], marker="s", color="C1", label="MB/rank")
        ax2.set_ylabel("peak MB per rank")
        ax.set_title("FSDP2Strategy scaling")
        fig.tight_layout()
        fig.savefig(RESULTS / "scaling.png", dpi=100)
        plt.close(fig)
        made.append("scaling.png")
    return made


def main() -> None:
    made = plots()
    lines = [
        "# Performance",
        "",
        "Benchmarks, not tests: every table comes from one run of `make bench` on the machine described below, with the",
        "contenders alternating and repeated, and ratios taken within that run. Reproduce with `make bench` (CPU; on",
        "CUDA when at least 4 GPUs are present) or each script's own command, given under its table. Raw numbers:",
        "`benchmarks/results/*.json`.",
        "",
    ]
    notes = ROOT / "benchmarks" / "NOTES.md"
    if notes.exists():
        lines += [notes.read_text().strip(), ""]
    for title, stem, what in SECTIONS:
        lines += [f"## {title}", "", what, ""]
        md = RESULTS / f"{stem}.md"
        lines += [md.read_text().strip() if md.exists() else f"(no results yet: `{stem}.md` is missing)", ""]
        png = f"{stem}.png"
        if png in made:
            lines += [f"![{title}](../benchmarks/results/{png})", ""]
    (ROOT / "docs" / "performance.md").write_text("\n".join(lines))
    print(f"wrote {ROOT / 'docs' / 'performance.md'}")


if __name__ == "__main__":
    main()
