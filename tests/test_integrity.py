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
from tests.models import fit_resumable


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x10
    file.write_bytes(bytes(data))


def _resume(pretrained: str, path: str, strategy: dict) -> str:
    try:
        fit_resumable(pretrained, 2, resume_from=path, strategy=strategy)
    except Exception as err:  # noqa: BLE001 - the test asserts on the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def _damaged_full(saved: dict, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the full checkpoint with one bit flipped in the middle of its largest tensor record."""
    copy = tmp_path / "flipped.ckpt"
    shutil.copy(saved["full"], copy)
    with zipfile.ZipFile(copy) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(copy, "rb") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = (int.from_bytes(f.read(2), "little") for _ in range(2))
    _flip(copy, info.header_offset + 30 + name_length + extra_length + info.file_size // 2)
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
    messages = run_distributed(_resume, 2, str(pretrained), str(copy), {})
    assert messages[0] == messages[1], "every rank raises the same error"
    message = messages[0]
    assert message.startswith(f"CheckpointFileError: The checkpoint {copy} is damaged"), message
    assert f"record {record!r} (tensor 'state_dict." in message, message
    assert "(found by rank " in message and "Nothing was loaded" in message, message
    # Turned off, the same file loads (and trains on from the flipped value): the check is what caught it.
    assert run_distributed(_resume, 2, str(pretrained), str(copy), {"verify_checkpoints": False}) == ["no error"] * 2
    # The converter and read_full_checkpoint check too, and can be told not to.
    with pytest.raises(CheckpointFileError, match="is damaged"):
        read_full_checkpoint(copy)
    assert "state_dict" in read_full_checkpoint(copy, verify=False)


def test_a_flipped_bit_in_a_shard_is_named_with_its_tensor(pretrained: Path, saved: dict, tmp_path: Path) -> None:
    assert sorted(p.name for p in saved["sharded"].glob("*_crc32.json")) == ["__0_crc32.json", "__1_crc32.json"]
    integrity.verify(saved["sharded"], together=False)  # the intact one passes
    copy, file, fqn = _damaged_sharded(saved, tmp_path)
    messages = run_distributed(_resume, 2, str(pretrained), str(copy), {"state_dict_type": "sharded"})
    assert messages[0] == messages[1], "every rank raises the same error"
    assert f"CheckpointFileError: The checkpoint {copy} is damaged" in messages[0], messages[0]
    assert f"file {file!r}, tensor {fqn!r} (found by rank " in messages[0], messages[0]
    with pytest.raises(SystemExit):  # the converter refuses it, naming it; --no-verify converts it anyway
        convert_main([str(copy), str(tmp_path / "out.ckpt")])
    convert_main([str(copy), str(tmp_path / "out.ckpt"), "--no-verify"])
    assert (tmp_path / "out.ckpt").is_file()


def test_checkpoints_without_checksums_load_as_before(saved: dict, tmp_path: Path) -> None:
    """A DCP directory written by someone else (no checksum files) and a torch.save file written without CRC-32s
    are read without a check; an intact full checkpoint passes it."""
    integrity.verify(saved["full"], together=False)
    copy = tmp_path / "theirs.ckpt"
    shutil.copytree(saved["sharded"], copy)
    for sidecar in copy.glob("*_crc32.json"):
        sidecar.unlink()
    _flip(copy / read_dcp_metadata(copy).storage_data[next(iter(read_dcp_metadata(copy).storage_data))].relative_path, 200)
    integrity.verify(copy, together=False)  # nothing to compare against: as before
