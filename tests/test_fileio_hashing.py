"""Files hashed while they are written (fileio.HashingFile, write_safetensors): a checkpoint's meta.json and final/'s
MANIFEST take the digest computed during the write instead of reading GBs back (a 7B run's end of run), so that
digest must be the file's true sha256, and the safetensors files we write must be what safetensors itself reads."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from entrenar import fileio
from entrenar.fileio import HashingFile, sha256_file, write_safetensors, written_sha256


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.layers.0.w": torch.randn(33, 7, generator=g),
            "a.bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "b.f16": torch.randn(4, generator=g).half(),
            "c.scalar": torch.tensor(2.5, dtype=torch.float64),
            "d.empty": torch.zeros(0, 3),
            "e.int": torch.arange(10, dtype=torch.int64).reshape(2, 5),
            "f.bool": torch.tensor([True, False, True]),
            "g.view": torch.randn(6, 4, generator=g).t(),  # not contiguous
            "h.fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn)}


def test_write_safetensors_is_read_back_by_safetensors_with_its_true_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "_WRITTEN", {})
    path = tmp_path / "m.safetensors"
    want = tensors()
    digest = write_safetensors(want, path, metadata={"format": "pt"})
    assert digest == sha256_file(path)
    got = load_file(str(path))
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with open(path, "rb") as f:  # the header is padded to 8 bytes, as safetensors' writer pads it
        assert int.from_bytes(f.read(8), "little") % 8 == 0


@pytest.mark.parametrize("background", [False, True])
def test_the_digest_taken_while_writing_is_used_once_and_only_for_the_same_file(tmp_path, monkeypatch, background):
    monkeypatch.setattr(fileio, "_WRITTEN", {})
    path = tmp_path / "f.bin"
    with HashingFile(path, background=background) as f:
        for i in range(50):
            f.write(bytes([i]) * 100_003)
    assert f.digest == sha256_file(path)
    calls = []
    monkeypatch.setattr(fileio, "sha256_file", lambda p: calls.append(p) or "read")
    os.replace(path, tmp_path / "moved.bin")  # a rename keeps the file: its digest still holds
    assert written_sha256(tmp_path / "moved.bin") == f.digest and calls == []
    assert written_sha256(tmp_path / "moved.bin") == "read"  # taken once
    with HashingFile(path) as g:
        g.write(b"abc")
    with open(path, "r+b") as h:  # changed after it was written: read again
        h.write(b"x")
    os.utime(path, ns=(1, 1))
    assert written_sha256(path) == "read" and g.digest != "read"
