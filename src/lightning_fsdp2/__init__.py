"""lightning-fsdp2: PyTorch FSDP2 (``fully_shard``) as a Lightning ``Trainer`` strategy.

``import lightning_fsdp2`` registers the strategies with Lightning, so ``Trainer(strategy="fsdp2")`` and
``Fabric(strategy="fsdp2")`` work (the Fabric one is :class:`lightning_fsdp2.fabric.FSDP2Strategy`).
"""

import torch

from lightning_fsdp2._version_check import check_torch_version

check_torch_version(torch.__version__)

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_fsdp2.auto_layout import LayoutChoice, estimate_layouts  # noqa: E402
from lightning_fsdp2.checkpoint import CheckpointFileError, load_pretrained  # noqa: E402
from lightning_fsdp2.init import UninitializedError  # noqa: E402
from lightning_fsdp2.peer_lost import PeerLostError  # noqa: E402
from lightning_fsdp2.precision import FSDP2Precision  # noqa: E402
from lightning_fsdp2.strategy import FSDP2Strategy  # noqa: E402

FSDP2Strategy.register_strategies(StrategyRegistry)

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_STRATEGIES  # noqa: E402

from lightning_fsdp2 import fabric as _fabric  # noqa: E402

_fabric.FSDP2Strategy.register_strategies(_FABRIC_STRATEGIES)  # Fabric(strategy="fsdp2")

__version__ = "0.1.0"
__all__ = [
    "CheckpointFileError",
    "FSDP2Precision",
    "FSDP2Strategy",
    "LayoutChoice",
    "PeerLostError",
    "UninitializedError",
    "__version__",
    "estimate_layouts",
    "load_pretrained",
]
