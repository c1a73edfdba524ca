"""The safetensors reader: the same tensors as safetensors' own loader, each in memory of its own;
a truncated or corrupt file is refused naming the tensor or the header."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockserve.models.safetensors_reader import read_tensors


def saved(path) -> dict[str, torch.Tensor]:
    tensors = {"a.weight": torch.randn(7, 5).to(torch.bfloat16), "b": torch.randn(3).half(),
               "c": torch.arange(6, dtype=torch.int64).reshape(2, 3), "empty": torch.zeros(0, 4),
               "d": torch.randn(2, 2, 2)}
    save_file(tensors, path, metadata={"format": "pt"})
    return tensors


def test_reads_what_safetensors_reads_into_buffers_of_its_own(tmp_path):
    saved(tmp_path / "m.safetensors")
    ours, theirs = dict(read_tensors(tmp_path / "m.safetensors")), load_file(tmp_path / "m.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    pointers = {t.untyped_storage().data_ptr() for t in ours.values() if t.numel()}
    assert len(pointers) == len([t for t in ours.values() if t.numel()])  # one buffer each, none shared


def test_a_truncated_file_names_the_tensor_cut_off(tmp_path):
    saved(tmp_path / "m.safetensors")
    last = [name for name, t in read_tensors(tmp_path / "m.safetensors") if t.numel()][-1]  # in file order
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-3])  # within the last tensor
    with pytest.raises(ValueError, match=f"tensor '{last}' .*truncated or corrupt"):
        list(read_tensors(tmp_path / "m.safetensors"))


@pytest.mark.parametrize("content, message", [(b"\x10\0\0\0\0\0\0\0not json at all!", "not JSON"),
                                              (b"\xff" * 8, "not a safetensors file"),
                                              (b"\x0b\0\0\0\0\0\0\0{\"x\": 1234}", "no valid data_offsets")])
def test_a_corrupt_header_is_refused(tmp_path, content, message):
    (tmp_path / "m.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=message):
        list(read_tensors(tmp_path / "m.safetensors"))
