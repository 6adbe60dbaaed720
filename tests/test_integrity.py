"""Checkpoints prove their integrity: a flipped bit in a full or sharded checkpoint is named (file, tensor, rank)
on every rank before anything is loaded; the option turns the check off; checkpoints without checksums load."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from lightning_fsdp2 import CheckpointFileError
from lightning_fsdp2.checkpoint import integrity
from lightning_fsdp2.checkpoint.safe_dcp import read_dcp_metadata
from lightning_fsdp2.convert import main as convert_main
from lightning_fsdp2.convert import read_full_checkpoint
from tests.helpers import run_distributed
from tests.integration.test_resume import _resume_expecting_error


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x10
    file.write_bytes(bytes(data))


def _data_offset(file: Path, info: zipfile.ZipInfo) -> int:
    """Where a zip record's bytes start: after its local header (whose extra field torch pads for alignment)."""
    with open(file, "rb") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_length + extra_length


def _damaged_full(saved: dict, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the full checkpoint with one bit flipped in the middle of its largest tensor record."""
    copy = tmp_path / "flipped.ckpt"
    shutil.copy(saved["full"], copy)
    with zipfile.ZipFile(copy) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    _flip(copy, _data_offset(copy, info) + info.file_size // 2)
    return copy, info.filename


def _damaged_sharded(saved: dict, tmp_path: Path) -> tuple[Path, str, str]:
    """A copy of the sharded checkpoint with one bit flipped in the middle of its largest model tensor."""
    copy = tmp_path / "flipped-sharded.ckpt"
    shutil.copytree(saved["sharded"], copy)
    items = [(index.fqn, info) for index, info in read_dcp_metadata(copy).storage_data.items()
             if index.fqn.startswith("state_dict.")]
    fqn, info = max(items, key=lambda item: item[1].length)
    _flip(copy / info.relative_path, info.offset + info.length // 2)
    return copy, info.relative_path, fqn


def test_a_flipped_bit_in_a_full_checkpoint_is_named_on_every_rank(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    copy, record = _damaged_full(saved, tmp_path)
    messages = run_distributed(_resume_expecting_error, 2, str(pretrained), str(copy), {})
    assert messages[0] == messages[1], "every rank raises the same error"
    message = messages[0]
    assert message.startswith(f"CheckpointFileError: The checkpoint {copy} is damaged"), message
    assert f"record {record!r} (tensor 'state_dict." in message, message
    assert "(found by rank " in message and "Nothing was loaded" in message, message
    # Turned off, the same file loads (and trains on from the flipped value): the check is what caught it.
    assert run_distributed(_resume_expecting_error, 2, str(pretrained), str(copy), {}, {"verify_checkpoints": False}) == ["no error"] * 2
    # The converter and read_full_checkpoint check too, and can be told not to.
    with pytest.raises(CheckpointFileError, match="is damaged"):
        read_full_checkpoint(copy)
    assert "state_dict" in read_full_checkpoint(copy, verify=False)


def test_a_flipped_bit_in_a_shard_is_named_with_its_tensor(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    integrity.verify(saved["sharded"], together=False)  # the intact one passes
    copy, file, fqn = _damaged_sharded(saved, tmp_path)
    messages = run_distributed(_resume_expecting_error, 2, str(pretrained), str(copy), {}, {"state_dict_type": "sharded"})
    assert messages[0] == messages[1], "every rank raises the same error"
    assert f"CheckpointFileError: The checkpoint {copy} is damaged" in messages[0], messages[0]
    assert f"file {file!r}, tensor {fqn!r} (found by rank " in messages[0], messages[0]
    with pytest.raises(SystemExit):  # the converter refuses it, naming it; --no-verify converts it anyway
        convert_main([str(copy), str(tmp_path / "out.ckpt")])
    convert_main([str(copy), str(tmp_path / "out.ckpt"), "--no-verify"])
    assert (tmp_path / "out.ckpt").is_file()


def test_checkpoints_without_checksums_load_as_before(saved: dict, tmp_path: Path) -> None:
    """A torch.save file written without CRC-32s (compute_crc32 off) is read without a check, flipped bit and all;
    an intact full checkpoint passes it; a flipped bit in a sharded checkpoint's meta.pt is found too."""
    import torch
    from torch.utils.serialization import config

    integrity.verify(saved["full"], together=False)
    config.save.compute_crc32 = False
    try:
        torch.save({"weight": torch.arange(1000.0)}, tmp_path / "theirs.pt")
    finally:
        config.save.compute_crc32 = True
    with zipfile.ZipFile(tmp_path / "theirs.pt") as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename)
    _flip(tmp_path / "theirs.pt", _data_offset(tmp_path / "theirs.pt", info) + info.file_size // 2)
    integrity.verify(tmp_path / "theirs.pt", together=False)  # nothing to compare against: as before
    copy = tmp_path / "meta-flipped.ckpt"
    shutil.copytree(saved["sharded"], copy)
    with zipfile.ZipFile(copy / "meta.pt") as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
    _flip(copy / "meta.pt", _data_offset(copy / "meta.pt", info) + info.file_size // 2)
    with pytest.raises(CheckpointFileError, match=r"meta\.pt: record .*data\.pkl"):
        integrity.verify(copy, together=False)
