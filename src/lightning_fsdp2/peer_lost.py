"""A collective that fails for want of a peer (timed out, a connection closed) raised as :class:`PeerLostError`, a
message in place of torch's: where this rank was (``lockstep.PeerWatch``), or that every rank must call a function
that gathers from all of them (the LoRA exports)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist


class PeerLostError(RuntimeError):
    """A collective failed (timed out, or a peer's connection closed) because another rank did not take part:
    the message names each rank's last phase; or a forward outside training that not every rank ran (its message
    says so)."""


def collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed for want of a peer: torch's distributed errors, and gloo's and
    NCCL's timeouts and closed connections (plain ``RuntimeError`` on gloo)."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        word in text for word in ("Timed out", "Connection closed", "Connection reset", "gloo", "NCCL", "timeout"))


@contextmanager
def peer_lost(message: Callable[[BaseException], str]) -> Iterator[None]:
    """A collective that fails in the block (for want of a peer) raises :class:`PeerLostError` with
    ``message(error)``; other errors pass."""
    try:
        yield
    except PeerLostError:
        raise
    except Exception as err:
        if not collective_failure(err):
            raise
        raise PeerLostError(message(err)) from err


def torch_said(err: BaseException) -> str:
    return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__


def every_rank_calls(what: str) -> Any:
    """For functions outside the strategy that gather from every rank (``lora.save_adapter``): a collective that
    fails in the block raises :class:`PeerLostError` saying that every rank must call ``what``."""
    return peer_lost(lambda err: (
        f"{what} failed in a collective on rank {dist.get_rank()}: another rank did not take part. Every rank must call"
        f" {what}: each holds a share of the tensors (rank 0 alone writes the files). Torch reported: {torch_said(err)}"
    ))


def called_by_every_rank(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a function that gathers from every rank with :func:`every_rank_calls`."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with every_rank_calls(what):
                return fn(*args, **kwargs)

        return run

    return decorate
