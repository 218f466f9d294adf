"""Digests where the tensor lives: the host's sha256, and on a GPU (the instrumented device,
tests/fake_device.py) a fold on the device that never copies the tensor to the host."""

from __future__ import annotations

import pytest
import torch

from domain.refit import storage
from domain.refit.storage import tensor_digest
from tests.fake_device import FakeCuda


def _weights(seed: int, n: int = 10_001, device: str = "cpu") -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), device=device).to(torch.bfloat16)


def test_host_digests_are_sha256_of_the_bytes():
    import hashlib

    t = _weights(0)
    expected = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode() + t.view(torch.uint8).numpy().tobytes())
    assert tensor_digest(t) == expected.hexdigest()


def test_gpu_digests_never_copy_the_tensor_to_the_host(monkeypatch):
    monkeypatch.setattr(storage, "_FOLD_WORDS", 512)  # several steps, and a tail of 2 bytes
    with FakeCuda(host_buffers="forbid"):  # a host copy of the tensor (or numpy() of it) fails
        a = _weights(0, device="cuda")
        same = _weights(0, device="cuda")
        flipped = a.clone()
        flipped.view(torch.int16)[7777] ^= 1  # one bit
        swapped = a.clone()
        swapped[[10, 11]] = swapped[[11, 10]]  # two elements trade places
        digests = [tensor_digest(x) for x in (a, same, flipped, swapped, a.view(torch.int16), a[:-1], a.reshape(1, -1))]
        strided = tensor_digest(torch.stack([a, a], dim=1)[:, 0])  # not contiguous: folded from a copy on the device
    assert digests[0] == digests[1] == strided
    assert len(set(digests[1:])) == len(digests) - 1  # a bit, the order, the dtype, the size, the shape all count


@pytest.mark.parametrize("n", [1, 7, 8, 9, 4096 + 3])
def test_gpu_digests_fold_every_byte(n):
    with FakeCuda(host_buffers="allow"):
        t = torch.arange(n, dtype=torch.uint8, device="cuda")
        flipped = t.clone()
        flipped[-1] ^= 0x80
        assert tensor_digest(t) != tensor_digest(flipped)
