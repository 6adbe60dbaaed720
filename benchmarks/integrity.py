"""What checkpoint checksums cost: writing them, and verifying them before a load, against the same work without.

One process, tensors of a Llama-like size mix (a few large matrices, many small ones) totalling ``--sizes`` GB:

- **sharded**: ``dcp.save`` (each tensor a ``torch.save`` archive inside the ``.distcp`` files) with torch's CRC-32
  per record (``torch.utils.serialization.config.save.compute_crc32``, its default) against it off, each into a
  fresh directory: what the checksums cost to write (torch pays it by default; the strategy adds nothing);
- **full**: ``torch.save`` the same way (our streamed writer uses torch's zip writer with the same option);
- **hf export**: the converter's Hugging Face output (``save_torch_state_dict``, 5 GB shards) and what its checksums
  add: each tensor's CRC-32 computed from memory (``integrity.checksum_metadata``, timed alone) for the safetensors
  headers; this one the package pays;
- **verify**: ``integrity.verify`` (``verify_safetensors`` for the safetensors files) of each against reading every
  byte of the same files (16 MB reads, after the writes, so from the page cache alike).

Targets (issue 28): writing checksums <= 10% of the save's time: the strategy adds nothing to torch's own write (the
table shows what torch's default CRC-32s cost against turning them off); verifying <= the time to read the bytes:
here the files are in the page cache, so reading is memory speed and verifying is bound by the CRC-32 (zlib's, 2-3
GB/s on one core); run as root, the same from the disk too (the page cache dropped before each read). A save's time
runs until its bytes are on the disk (``os.sync()`` before, untimed, and after, timed). Medians of ``--repeats``, the
two settings alternating.

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

from huggingface_hub import save_torch_state_dict  # noqa: E402

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


def saved(fn) -> float:
    """A save's time until its bytes are on the disk: the earlier writes flushed first (untimed), this one's
    flushed inside the timing. Without it each save's time held whatever of the previous save's writeback the kernel
    did during it."""
    import os

    os.sync()
    return timed(lambda: (fn(), os.sync()))


def _drop_caches() -> None:
    import os

    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def can_drop_caches() -> bool:
    try:
        _drop_caches()
        return True
    except OSError:
        return False


def run(gb: float, repeats: int, where: Path, cold: bool) -> dict[str, float]:
    state = tensors(gb)
    times: dict[str, list[float]] = {}
    for repeat in range(repeats):
        for crc in ([False, True] if repeat % 2 == 0 else [True, False]):
            name = "checksummed" if crc else "plain"
            serialization_config.save.compute_crc32 = crc
            try:
                target = where / f"sharded-{name}"
                shutil.rmtree(target, ignore_errors=True)
                writer = FileSystemWriter(target)
                times.setdefault(f"sharded save, {name}", []).append(
                    saved(lambda: dcp.save(state, storage_writer=writer, no_dist=True)))
                target = where / f"full-{name}.pt"
                times.setdefault(f"full save, {name}", []).append(saved(lambda: torch.save(state, target)))
            finally:
                serialization_config.save.compute_crc32 = True
            # The converter's Hugging Face output: what the checksums add is computing them from memory
            # (checksum_metadata; the header grows by a few KB), timed alone, against the write without them (a
            # write's time on this disk varies 4x from one to the next, so the two are not timed as two writes).
            if crc:
                times.setdefault("hf checksums", []).append(timed(lambda: integrity.checksum_metadata(state)))
            else:
                target = where / "hf-plain"
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()
                times.setdefault("hf save", []).append(saved(lambda: save_torch_state_dict(state, target)))
        target = where / "hf-checksummed"  # what the verification below reads
        if not target.exists():
            target.mkdir()
            save_torch_state_dict(state, target, metadata=integrity.checksum_metadata(state))
        hf_files = sorted((where / "hf-checksummed").glob("*.safetensors"))
        for kind, path, check in (
            ("sharded", where / "sharded-checksummed", lambda p: integrity.verify(p, together=False)),
            ("full", where / "full-checksummed.pt", lambda p: integrity.verify(p, together=False)),
            ("hf", where / "hf-checksummed",
             lambda p: integrity.verify_safetensors(hf_files, together=False, turn_off="")),
        ):
            times.setdefault(f"{kind} read", []).append(timed(lambda: read_all(path)))
            times.setdefault(f"{kind} verify", []).append(timed(lambda: check(path)))
            if cold:  # from the disk: the page cache dropped before each (needs root)
                _drop_caches()
                times.setdefault(f"{kind} read, cold", []).append(timed(lambda: read_all(path)))
                _drop_caches()
                times.setdefault(f"{kind} verify, cold", []).append(timed(lambda: check(path)))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1.1, 1.5], help="GB of tensors")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cold = can_drop_caches()
    rows = {}
    with tempfile.TemporaryDirectory(dir=ROOT / "outputs" if (ROOT / "outputs").is_dir() else None) as tmp:
        for gb in args.sizes:
            rows[f"{gb:g} GB"] = run(gb, args.repeats, Path(tmp), cold)
            print(gb, rows[f"{gb:g} GB"], flush=True)
    lines = [f"Checkpoint checksums (CRC-32), one process, bf16 tensors, median of {args.repeats}: writing with torch's"
             " CRC-32s (its default) against without, and the converter's Hugging Face export with and without the"
             " CRC-32s in its safetensors headers (each save timed until its bytes are on the disk), and verifying against reading the same bytes, from the page"
             " cache" + (" and from the disk (the page cache dropped before each)." if cold else "."), "",
             "| tensors | sharded save: crc off / on (s) | ratio | full save: crc off / on (s) | ratio |"
             " hf export: write / its CRC-32s (s) | ratio |"
             " sharded: read / verify (s) | full: read / verify (s) | hf: read / verify (s) |"
             + (" sharded from disk: read / verify (s) | full from disk: read / verify (s) | hf from disk: read /"
                " verify (s) |" if cold else ""),
             "|---|---|---:|---|---:|---|---:|---|---|---|" + ("---|---|---|" if cold else "")]
    for size, t in rows.items():
        lines.append(
            f"| {size} | {t['sharded save, plain']:.2f} / {t['sharded save, checksummed']:.2f} |"
            f" {t['sharded save, checksummed'] / t['sharded save, plain']:.2f}x |"
            f" {t['full save, plain']:.2f} / {t['full save, checksummed']:.2f} |"
            f" {t['full save, checksummed'] / t['full save, plain']:.2f}x |"
            f" {t['hf save']:.2f} / {t['hf checksums']:.2f} |"
            f" {(t['hf save'] + t['hf checksums']) / t['hf save']:.2f}x |"
            f" {t['sharded read']:.2f} / {t['sharded verify']:.2f} | {t['full read']:.2f} / {t['full verify']:.2f} |"
            f" {t['hf read']:.2f} / {t['hf verify']:.2f} |"
            + (f" {t['sharded read, cold']:.2f} / {t['sharded verify, cold']:.2f} | {t['full read, cold']:.2f} /"
               f" {t['full verify, cold']:.2f} | {t['hf read, cold']:.2f} / {t['hf verify, cold']:.2f} |"
               if cold else ""))
    command = f"python benchmarks/integrity.py --sizes {' '.join(f'{g:g}' for g in args.sizes)} --repeats {args.repeats}"
    lines += ["", f"Command: `{command}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "integrity.json").write_text(json.dumps({"rows": rows, "command": command}, indent=2) + "\n")
    (out / "integrity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
