"""What checkpoint checksums cost: writing them, and verifying them before a load, against the same work without.

One process, tensors of a Llama-like size mix (a few large matrices, many small ones) totalling ``--sizes`` GB:

- **sharded**: ``dcp.save`` (each tensor a ``torch.save`` archive inside the ``.distcp`` files) with torch's CRC-32
  per record (``torch.utils.serialization.config.save.compute_crc32``, its default) against it off, each into a
  fresh directory: what the checksums cost to write (torch pays it by default; the strategy adds nothing);
- **full**: ``torch.save`` the same way (our streamed writer uses torch's zip writer with the same option);
- both saves again into memory (``/dev/shm``, where it exists): the CRC-32s' CPU time without the disk's spread;
- **hf export**: the converter's Hugging Face output (``save_torch_state_dict``, 5 GB shards) and what its checksums
  add: each tensor's CRC-32 computed from memory (``integrity.checksum_metadata``, timed alone) for the safetensors
  headers; this one the package pays;
- **verify**: ``integrity.verify`` (``verify_safetensors`` for the safetensors files) of each against reading every
  byte of the same files (16 MB reads into one buffer, after the writes, so from the page cache alike).

Targets (issue 28): writing checksums <= 10% of the save's time: the strategy adds nothing to torch's own write (the
table shows what torch's default CRC-32s cost against turning them off); verifying <= the time to read the bytes:
from the disk (run as root: the page cache dropped before each read), where a load reads them. From the page cache
reading is a memory copy, and verifying is bound by the CRC-32s (zlib's, about 4 GB/s per core, computed on as many
cores as the machine has, up to 4). A save's time
runs until its bytes are on the disk (``os.sync()`` before, untimed, and after, timed). Medians of ``--repeats``, the
two settings alternating.

    python benchmarks/integrity.py --sizes 1.1 1.5 --repeats 5

It also times the candidate digests on one core (zlib's CRC-32 against hashlib's MD5, SHA-1, SHA-256, BLAKE2b).

(1.1 GB: the 551M model of ``load_pretrained.py`` in bf16.) Writes ``benchmarks/results/integrity.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
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
    """Every byte of the files at ``path``, in order, 16 MB at a time into one reused buffer (a plain read at its
    fastest: no allocation per read)."""
    buffer = bytearray(16 << 20)
    for file in sorted(path.rglob("*") if path.is_dir() else [path]):
        if file.is_file():
            with open(file, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


def read_beside_crcs(path: Path, block: bytes) -> None:
    """:func:`read_all` while ``integrity._threads()`` threads compute as many bytes' CRC-32s from memory (``block``
    over and over): a plain read sharing the cores with the CPU work a verification adds, without its reading. On a
    machine whose cores the reading itself keeps busy this, not the read alone, is what a verification can reach."""
    import threading
    import zlib

    total = sum(f.stat().st_size for f in (path.rglob("*") if path.is_dir() else [path]) if f.is_file())
    threads = integrity._threads()

    def work(left: int) -> None:
        while left > 0:
            zlib.crc32(block)
            left -= len(block)

    workers = [threading.Thread(target=work, args=(total // threads,)) for _ in range(threads)]
    for worker in workers:
        worker.start()
    read_all(path)
    for worker in workers:
        worker.join()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def saved(fn) -> float:
    """A save's time until its bytes are on the disk: the earlier writes flushed first (untimed), this one's
    flushed inside the timing. Without it each save's time held whatever of the previous save's writeback the kernel
    did during it."""

    os.sync()
    return timed(lambda: (fn(), os.sync()))


def _drop_caches() -> None:

    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def can_drop_caches() -> bool:
    try:
        _drop_caches()
        return True
    except OSError:
        return False


MEMORY = Path("/dev/shm")


def run(gb: float, repeats: int, where: Path, cold: bool) -> dict[str, float]:
    state = tensors(gb)
    block = os.urandom(64 << 20)
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
                if MEMORY.is_dir():  # the same saves into memory (tmpfs): the CRC-32s' CPU time without the disk's spread
                    target = Path(tempfile.mkdtemp(dir=MEMORY))
                    try:
                        times.setdefault(f"sharded save in memory, {name}", []).append(timed(
                            lambda: dcp.save(state, storage_writer=FileSystemWriter(target / "sharded"), no_dist=True)))
                        times.setdefault(f"full save in memory, {name}", []).append(
                            timed(lambda: torch.save(state, target / "full.pt")))
                    finally:
                        shutil.rmtree(target)
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
            read_all(path)  # into the page cache (the previous kind's cold runs dropped it), untimed
            times.setdefault(f"{kind} read", []).append(timed(lambda: read_all(path)))
            times.setdefault(f"{kind} verify", []).append(timed(lambda: check(path)))
            if cold:  # from the disk: the page cache dropped before each (needs root); which goes first alternates
                trio = [("read", lambda: read_all(path)), ("verify", lambda: check(path)),
                        ("read beside crcs", lambda: read_beside_crcs(path, block))]
                for what, fn in trio[repeat % 3:] + trio[:repeat % 3]:
                    _drop_caches()
                    times.setdefault(f"{kind} {what}, cold", []).append(timed(fn))
    medians = {k: statistics.median(v) for k, v in times.items()}
    for kind in ("sharded", "full", "hf"):  # the median of each repeat's ratio (the disk's speed drifts between them)
        for cache in ("", ", cold") if cold else ("",):
            for peer in ("read", "read beside crcs") if cache else ("read",):
                ratios = [v / r for r, v in zip(times[f"{kind} {peer}{cache}"], times[f"{kind} verify{cache}"])]
                medians[f"{kind} verify / {peer}{cache}"] = statistics.median(ratios)
    return medians


def digest_speeds() -> dict[str, float]:
    """GB/s of each candidate digest over 256 MB on one core (best of 3): zlib's CRC-32 (what torch's archives
    carry), and hashlib's (what would be written beside them)."""
    import hashlib
    import zlib

    data = os.urandom(256 << 20)
    candidates = {"zlib.crc32": zlib.crc32, **{f"hashlib.{name}": lambda d, n=name: hashlib.new(n, d).digest()
                                                for name in ("md5", "sha1", "sha256", "blake2b")}}
    return {name: len(data) / 1e9 / min(timed(lambda f=f: f(data)) for _ in range(3)) for name, f in candidates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1.1, 1.5], help="GB of tensors")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cold = can_drop_caches()
    speeds = digest_speeds()
    print(speeds, flush=True)
    rows = {}
    with tempfile.TemporaryDirectory(dir=ROOT / "outputs" if (ROOT / "outputs").is_dir() else None) as tmp:
        for gb in args.sizes:
            rows[f"{gb:g} GB"] = run(gb, args.repeats, Path(tmp), cold)
            print(gb, rows[f"{gb:g} GB"], flush=True)
    lines = [f"Checkpoint checksums (CRC-32), one process, bf16 tensors, medians of {args.repeats}.", "",
             "**Writing**: torch's CRC-32s (its default) against without, each save timed until its bytes are on the"
             " disk; the converter's Hugging Face export against the CRC-32s it adds to its safetensors headers"
             " (computed from memory, timed alone).", "",
             "| tensors | sharded save: crc off / on (s) | ratio | full save: crc off / on (s) | ratio |"
             " hf export: write / its CRC-32s (s) | ratio |", "|---|---|---:|---|---:|---|---:|"]
    for size, t in rows.items():
        lines.append(
            f"| {size} | {t['sharded save, plain']:.2f} / {t['sharded save, checksummed']:.2f} |"
            f" {t['sharded save, checksummed'] / t['sharded save, plain']:.2f}x |"
            f" {t['full save, plain']:.2f} / {t['full save, checksummed']:.2f} |"
            f" {t['full save, checksummed'] / t['full save, plain']:.2f}x |"
            f" {t['hf save']:.2f} / {t['hf checksums']:.2f} | {(t['hf save'] + t['hf checksums']) / t['hf save']:.2f}x |")
    lines += ["", "**Verifying** against reading the same bytes (16 MB reads into one buffer), from the page cache"
              + (" and from the disk (the page cache dropped before each; the contenders in turns), where the peer is"
                 " also a plain read with the CRC-32s' work running beside it from memory (what a verification adds"
                 " to the cores, without its reading)" if cold else "")
              + "; in brackets the median of the repeats' ratios of verify to each peer.", "",
              "| tensors | checkpoint | page cache: read / verify (s) |"
              + (" disk: read / read beside the CRC-32 work / verify (s) |" if cold else ""),
              "|---|---|---|" + ("---|" if cold else "")]
    for size, t in rows.items():
        for kind in ("sharded", "full", "hf"):
            lines.append(
                f"| {size} | {kind} | {t[f'{kind} read']:.2f} / {t[f'{kind} verify']:.2f}"
                f" ({t[f'{kind} verify / read']:.2f}x) |"
                + (f" {t[f'{kind} read, cold']:.2f} / {t[f'{kind} read beside crcs, cold']:.2f} /"
                   f" {t[f'{kind} verify, cold']:.2f} ({t[f'{kind} verify / read, cold']:.2f}x,"
                   f" {t[f'{kind} verify / read beside crcs, cold']:.2f}x) |" if cold else ""))
    command = f"python benchmarks/integrity.py --sizes {' '.join(f'{g:g}' for g in args.sizes)} --repeats {args.repeats}"
    if all("full save in memory, plain" in t for t in rows.values()):
        lines += ["", "The same saves into memory (`/dev/shm`, tmpfs): what torch's CRC-32s cost a save without the"
                  " disk's spread.", "", "| tensors | sharded save: crc off / on (s) | added | full save: crc off / on"
                  " (s) | added |", "|---|---|---:|---|---:|"]
        lines += [f"| {size} | " + " | ".join(
            f"{t[f'{kind} save in memory, plain']:.2f} / {t[f'{kind} save in memory, checksummed']:.2f} |"
            f" {t[f'{kind} save in memory, checksummed'] - t[f'{kind} save in memory, plain']:+.2f} s"
            for kind in ("sharded", "full")) + " |" for size, t in rows.items()]
    lines += ["", "Digests on one core, GB/s over 256 MB (best of 3): "
              + ", ".join(f"{name} {speed:.1f}" for name, speed in speeds.items())
              + f". Verification computes its CRC-32s on {integrity._threads()} threads here (the cores, up to 4).",
              "", f"Command: `{command}`"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "integrity.json").write_text(
        json.dumps({"rows": rows, "digests_gb_per_s": speeds, "command": command}, indent=2) + "\n")
    (out / "integrity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
