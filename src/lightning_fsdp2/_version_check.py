"""The torch version gate, checked before anything imports FSDP2."""

from __future__ import annotations

MIN_TORCH = (2, 6)


def check_torch_version(version: str) -> None:
    """Raise ``ImportError`` if ``version`` (a ``torch.__version__`` string) is older than :data:`MIN_TORCH`.

    FSDP2's ``fully_shard`` became public API (``torch.distributed.fsdp.fully_shard``) in torch 2.6; older
    releases only have a private, differently behaving prototype.
    """
    release = version.split("+")[0].split(".")
    try:
        found = (int(release[0]), int(release[1]))
    except (IndexError, ValueError):
        return  # a development build with an unusual version string: let the imports decide
    if found < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise ImportError(
            f"lightning-fsdp2 needs torch>={need}, found torch {version}: FSDP2's fully_shard became public in"
            f" torch {need}. Upgrade with `pip install 'torch>={need}'`."
        )
