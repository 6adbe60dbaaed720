"""The process plumbing both strategies share (the Trainer's and Fabric's ``FSDP2Strategy``): devices, ranks, the
process group and the device mesh, collectives. A mixin, placed before Lightning's ``ParallelStrategy`` in each
strategy's bases: it needs only what both of Lightning's ``ParallelStrategy`` classes have (``parallel_devices``,
``cluster_environment``, ``local_rank``, ``node_rank``, ``global_rank``, ``world_size``) plus ``num_nodes``, and the
options :meth:`ProcessesMixin._set_options` keeps."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_fsdp2.checkpoint.pretrained import DeferredLoads
from lightning_fsdp2.parallel import ShardingOptions, validate_external_launch


class ProcessesMixin:
    """Devices, ranks, the process group, the device mesh and the collectives of an FSDP2 strategy."""

    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    num_nodes: int
    _process_group_backend: str | None
    _device_mesh: DeviceMesh | None

    def _set_options(
        self,
        *,
        sharding: ShardingOptions,
        meta_init: bool,
        process_group_backend: str | None,
        timeout: timedelta | None,
        state_dict_type: str,
        save_trainable_only: bool,
    ) -> None:
        """The arguments both strategies take, checked and kept; and what every strategy holds before it starts."""
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")
        self._sharding = sharding
        self._meta_init = meta_init
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._state_dict_type = state_dict_type
        self._save_trainable_only = save_trainable_only
        self._device_mesh = None
        self._deferred = DeferredLoads()  # load_pretrained calls made while the model is built, run after sharding

    @property
    def _sharded(self) -> bool:
        """Checkpoints are saved as a directory of every rank's shards."""
        return self._state_dict_type == "sharded"

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh parameters are sharded on: 1-D ``("shard",)`` over all processes, or 2-D ``("replicate", "shard")``
        with ``device_mesh=(replicate, shard)`` (HSDP)."""
        if self._device_mesh is None:
            raise RuntimeError(
                "The device mesh exists only after the processes have been set up (in `fit`, or by `fabric.launch()`)."
            )
        return self._device_mesh

    @property
    def root_device(self) -> torch.device:
        """This process's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Each rank reads a different part of the data."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}  # type: ignore[attr-defined]

    @property
    def process_group_backend(self) -> str | None:
        """The backend of the default process group."""
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        """Tell the cluster environment and ``rank_zero_only`` this process's global rank."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank = self.global_rank  # type: ignore[attr-defined]
        rank_zero_only.rank = fabric_rank_zero_only.rank = utils_rank_zero_only.rank = rank

    def _start_processes(self) -> None:
        """Check the launch, start the process group and build the mesh; every rank, before any model work. The
        front-end's own ``setup_environment`` (the accelerator's device set-up) runs in between, as ``super()``."""
        validate_external_launch(
            self.cluster_environment,
            num_processes=self.num_processes,
            num_nodes=self.num_nodes,
            local_rank=self.local_rank,  # type: ignore[attr-defined]
            node_rank=self.node_rank,  # type: ignore[attr-defined]
        )
        super().setup_environment()  # type: ignore[misc]
        reset_seed()
        self.set_world_ranks()
        self._sharding.check(self.world_size, self.root_device, self.num_processes)  # type: ignore[attr-defined]
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id  # type: ignore[attr-defined]
        )
        self._device_mesh = self._sharding.build_mesh(self.root_device.type, self.world_size)  # type: ignore[attr-defined]

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Wait for all processes."""
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from ``src`` to every process."""
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        torch.distributed.broadcast_object_list(holder, src, group=_group.WORLD)
        return holder[0]

    def _reduce(self, tensor: Tensor | Any, group: Any | None, reduce_op: ReduceOp | str | None) -> Tensor | Any:
        """Reduce a tensor over all processes; other values pass through."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
