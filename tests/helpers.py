"""Run a function on N CPU processes with gloo, the way Lightning's launchers would.

Every test that needs a distributed run goes through :func:`run_distributed`. The children come from a forkserver
that has imported torch, Lightning, transformers and peft once, so each run pays the ~8 s import cost only once per
test session. Each child gets the environment variables a launcher sets (``LOCAL_RANK``, ``WORLD_SIZE``, ...),
so ``Trainer(devices=N, strategy=FSDP2Strategy())`` inside the function joins the group instead of launching.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

_PRELOAD = ["torch", "lightning.pytorch", "transformers", "peft", "lightning_fsdp2"]
_context = mp.get_context("forkserver")
_context.set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` processes; return each rank's return value (rank order).

    Return values travel through ``torch.save``/``torch.load(weights_only=True)``: tensors, numbers, strings,
    lists and dicts. An exception in any rank fails the call with that rank's traceback.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            _context.Process(target=_entry, args=(rank, world_size, port, out, fn, args), daemon=False)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        _wait(procs, timeout)
        failed = []
        another = any(p.exitcode not in (None, 0) for p in procs)  # before the stuck ones are killed
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()
                proc.join()
                failed.append(f"rank {rank} killed after another rank failed" if another
                              else f"rank {rank} timed out after {timeout} s")
            elif proc.exitcode != 0:
                err = Path(out, f"{rank}.err")
                failed.append(f"rank {rank} exited with {proc.exitcode}:\n" + (err.read_text() if err.exists() else ""))
        if failed:
            raise RuntimeError("\n".join(failed))
        return [torch.load(Path(out, f"{rank}.pt"), weights_only=True) for rank in range(world_size)]


def _wait(procs: list, timeout: float, grace: float = 60) -> None:
    """Until every process has exited or ``timeout`` has passed. Once one has failed (an exception, or killed for
    memory), the others get ``grace`` seconds: they are usually stuck in a collective with the dead one."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            return
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        alive[0].join(0.5)


def _entry(rank: int, world_size: int, port: int, out: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        LOCAL_RANK=str(rank),
        RANK=str(rank),
    )
    torch.set_num_threads(1)  # two cores shared by up to four ranks
    try:
        result = fn(*args)
    except BaseException:
        import traceback

        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise
    torch.save(result, Path(out, f"{rank}.pt"))
    # Shut the process group down together before the interpreter exits: left to the exit, gloo's threads were
    # sometimes torn down while a peer still used them (a worker killed by SIGSEGV/SIGABRT after its work was done;
    # seen in CI about once per full run). The same as the strategy's spawn launcher does.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
