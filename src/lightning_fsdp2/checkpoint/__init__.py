"""Values from checkpoints into the sharded model, and the model's state out to disk.

Two jobs, one primitive. *Loading pretrained weights* (:func:`load_pretrained`) and *resuming from a full
checkpoint* (:func:`load_full_state_dict`) both copy tensors from a file into parameters that are already sharded,
the same way: for each parameter, work out which slice of the whole tensor this rank's shard holds
(:func:`local_slice`), read only that slice from the file (safetensors ``get_slice`` or an ``mmap``-ed
``torch.load``), copy it into the local shard. No rank ever holds the whole checkpoint, and no rank waits on
another: there is no broadcast from rank 0.

*Saving* has two formats (``FSDP2Strategy(state_dict_type=...)``):

- ``"full"``: one Lightning checkpoint file written by rank 0, exactly what a single-device run writes (clean
  parameter names, optimizer state in ``torch.optim``'s index-keyed form). Tensors reach rank 0 one at a time
  (:func:`gather_to_rank0`).
- ``"sharded"``: a directory written by ``torch.distributed.checkpoint`` (each rank its own shards) plus
  ``meta.pt`` with everything else Lightning saves. Resharding to another world size happens on load.

Every write goes to a temporary name beside the target and is renamed into place only when complete, so a process
killed mid-save leaves the previous checkpoint as it was. Every read is ``weights_only=True`` or safetensors.

The modules: ``files`` (safe reads and atomic writes), ``sources`` (tensors read a slice at a time), ``shards``
(whole tensors to and from shards), ``module_load`` (``load_state_dict`` of whole tensors on the sharded model, for
code written for one device), ``plan`` (matching names and shapes), ``pretrained`` (``load_pretrained``),
``stream`` (a full checkpoint written as it is gathered), ``formats`` (the two checkpoint formats, as both strategies'
hooks use them), ``background`` (sharded saves written in the background), ``optimizer_keys`` (index- and
name-keyed optimizer states), ``safe_dcp`` (reading DCP directories without unpickling code). They are the package's
internals;
what users call is exported here.
"""

from lightning_fsdp2.checkpoint.files import CheckpointFileError, is_sharded_checkpoint
from lightning_fsdp2.checkpoint.module_load import full_state_dict
from lightning_fsdp2.checkpoint.pretrained import load_pretrained
from lightning_fsdp2.checkpoint.sources import PretrainedSource

__all__ = ["CheckpointFileError", "PretrainedSource", "full_state_dict", "is_sharded_checkpoint", "load_pretrained"]
