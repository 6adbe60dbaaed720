"""What checkpoint checksums cost: writing them, and verifying them before a load, against the same work without.

One process, tensors of a Llama-like size mix (a few large matrices, many small ones) totalling ``--sizes`` GB:

- **sharded**: ``dcp.save`` through ``integrity.ChecksummedWriter`` (a CRC-32 per item, computed as DCP writes it)
  against DCP's plain ``FileSystemWriter``, each into a fresh directory;
- **full**: ``torch.save`` with torch's CRC-32 per record (``compute_crc32``, its default, which our streamed writer
  uses too) against ``compute_crc32`` off;
- **verify**: ``integrity.verify`` of each against reading every byte of the same files (16 MB reads, after the
  writes, so from the page cache alike).

Targets: writing with checksums within 10% of the time without; verifying within the time to read the bytes (plus
the CRC-32 at 2-3 GB/s). Medians of ``--repeats``, contenders alternating.

    python benchmarks/integrity.py --sizes 1.1 1.5 --repeats 3

(1.1 GB: the 551M model of ``load_pretrained.py`` in bf16.) Writes ``benchmarks/results/integrity.{md,json}``.
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
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.utils.serialization import config as serialization_config  # noqa: E402

from lightning_fsdp2.checkpoint import integrity  # noqa: E402


def tensors(gb: float) -> dict[str, torch.Tensor]:
    """bf16 matrices of 1024 x 4096 (8 MB) and a 32000 x 1024 embedding (64 MB) up to ``gb``, plus small norms."""
    out, total, i = {"embed": torch.randn(32000, 1024, dtype=torch.bfloat16)}, 32000 * 1024 * 2, 0
    while total < gb * 1e9:
        out[f"layers.{i}.weight"] = torch.randn(1024, 4096, dtype=torch.bfloat16)
        out[f"layers.{i}.norm"] = torch.ones(1024, dtype=torch.bfloat16)
        total, i = total + 1024 * 4096 * 2 + 2048, i + 1
    return out


def read_all(path: Path) -> None:
    for file in sorted(path.rglob("*") if path.is_dir() else [path]):
        if file.is_file():
            with open(file, "rb") as f:
                while f.read(integrity.CHUNK):
                    pass


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(gb: float, repeats: int, where: Path) -> dict[str, float]:
    state = tensors(gb)
    times: dict[str, list[float]] = {}
    for repeat in range(repeats):
        order = ["plain", "checksummed"] if repeat % 2 == 0 else ["checksummed", "plain"]
        for name in order:
            target = where / f"sharded-{name}"
            shutil.rmtree(target, ignore_errors=True)
            writer = integrity.ChecksummedWriter(target) if name == "checksummed" else FileSystemWriter(target)
            times.setdefault(f"sharded save, {name}", []).append(
                timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True)))
        for crc in ([False, True] if repeat % 2 == 0 else [True, False]):
            target = where / f"full-{crc}.pt"
            serialization_config.save.compute_crc32 = crc
            try:
                times.setdefault(f"full save, {'checksummed' if crc else 'plain'}", []).append(
                    timed(lambda: torch.save(state, target)))
            finally:
                serialization_config.save.compute_crc32 = True
        for kind, path in (("sharded", where / "sharded-checksummed"), ("full", where / "full-True.pt")):
            times.setdefault(f"{kind} read", []).append(timed(lambda: read_all(path)))
            times.setdefault(f"{kind} verify", []).append(timed(lambda: integrity.verify(path, together=False)))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1.1, 1.5], help="GB of tensors")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory(dir=ROOT / "outputs" if (ROOT / "outputs").is_dir() else None) as tmp:
        for gb in args.sizes:
            rows[f"{gb:g} GB"] = run(gb, args.repeats, Path(tmp))
            print(gb, rows[f"{gb:g} GB"], flush=True)
    lines = [f"Checkpoint checksums (CRC-32), one process, bf16 tensors, median of {args.repeats}: writing with them"
             " against without, and verifying against reading the same bytes (page cache warm for both).", "",
             "| tensors | sharded save: plain / checksummed (s) | ratio | full save: crc off / on (s) | ratio |"
             " sharded: read / verify (s) | full: read / verify (s) |", "|---|---|---:|---|---:|---|---|"]
    for size, t in rows.items():
        lines.append(
            f"| {size} | {t['sharded save, plain']:.2f} / {t['sharded save, checksummed']:.2f} |"
            f" {t['sharded save, checksummed'] / t['sharded save, plain']:.2f}x |"
            f" {t['full save, plain']:.2f} / {t['full save, checksummed']:.2f} |"
            f" {t['full save, checksummed'] / t['full save, plain']:.2f}x |"
            f" {t['sharded read']:.2f} / {t['sharded verify']:.2f} | {t['full read']:.2f} / {t['full verify']:.2f} |")
    command = f"python benchmarks/integrity.py --sizes {' '.join(f'{g:g}' for g in args.sizes)} --repeats {args.repeats}"
    lines += ["", f"Command: `{command}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "integrity.json").write_text(json.dumps({"rows": rows, "command": command}, indent=2) + "\n")
    (out / "integrity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
