"""Where a training step's time goes under FSDP2Strategy: communication against compute, from torch.profiler.

    python benchmarks/profile_step.py                  # world size 2, the throughput benchmark's model and batch
    python benchmarks/profile_step.py --keep           # FSDP2Strategy(reshard_after_forward=False)
    python benchmarks/profile_step.py --contender fsdp2+compile   # any contender of throughput.py (--knobs too)

Profiles rank 0 over the timed steps of one run of ``throughput.py``'s LoRA Llama and prints the operators that
took the most time, and the share of collectives (``c10d``/gloo all-gather, reduce-scatter, all-reduce and their
waits) in the total, and of matrix multiplications (``aten::mm``/``addmm``/``bmm``, eager or called from compiled
code).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from throughput import TIMED, WARMUP, LoRALlama, _strategy  # noqa: E402

from tests.helpers import run_distributed  # noqa: E402


class Profiled(LoRALlama):
    def on_train_batch_start(self, batch, batch_idx) -> None:
        if batch_idx == WARMUP:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()

    def on_train_end(self) -> None:
        self.profiler.__exit__(None, None, None)  # the timed steps, all in one epoch (see throughput.py)


def _profile(name: str) -> dict:
    module = Profiled(shard=name.startswith("model_parallel"), compile=name.endswith("+compile"))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(name), max_steps=WARMUP + TIMED, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module)
    events = module.profiler.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    comm_words = ("all_gather", "reduce_scatter", "allreduce", "all_reduce", "c10d", "gloo", "wait", "broadcast")
    comm = sum(e.self_cpu_time_total for e in events if any(w in e.key.lower() for w in comm_words))
    matmul = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {"total_s": total / 1e6, "comm_s": comm / 1e6, "matmul_s": matmul / 1e6,
            "top": [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="reshard_after_forward=False")
    parser.add_argument("--contender", default="fsdp2", help="a contender of throughput.py (fsdp2+compile...)")
    args = parser.parse_args()
    result = run_distributed(_profile, 2, "fsdp2_keep" if args.keep else args.contender, timeout=1800)[0]
    print(f"rank 0, {TIMED} steps: {result['total_s']:.1f} s of operator time, {result['comm_s']:.1f} s"
          f" ({100 * result['comm_s'] / result['total_s']:.0f}%) in collectives and their waits, {result['matmul_s']:.1f}"
          f" s ({100 * result['matmul_s'] / result['total_s']:.0f}%) in matrix multiplications")
    for key, seconds, count in result["top"]:
        print(f"  {seconds:7.2f} s  {count:6d}x  {key}")


if __name__ == "__main__":
    main()
