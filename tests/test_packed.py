"""A store file's tensors in one LZMA stream (:mod:`sekv_core.packed`): bit for bit back,
smaller, what is already compressed left alone, and a stream that does not fit its shapes
refused."""

import lzma

import pytest
import torch

from sekv_core.format import nbytes
from sekv_core.packed import BLOB, KEPT, SHAPE, pack, unpack


def matrices():
    g = torch.Generator().manual_seed(0)
    basis = (torch.randn(2, 3, 64, 64, generator=g) * 30).round().clamp(-127, 127)
    return {
        "k_basis": basis.to(torch.int8),
        "sketch_proj": (torch.randn(2, 3, 64, 32, generator=g) / 8).to(torch.float16),
        "fixed_k": torch.zeros(2, 3, 0, 64, dtype=torch.int8),  # no anchors: empty is fine
        "span_starts": torch.arange(5),
        "offsets": torch.arange(40, dtype=torch.int32).view(20, 2),
        KEPT[0]: torch.arange(9, dtype=torch.uint8),  # already compressed: not packed
    }


def test_matrices_come_back_bit_for_bit_and_smaller():
    tensors = matrices()
    packed = pack(tensors)
    assert set(packed) == {BLOB, KEPT[0], *(n + SHAPE for n in tensors if n != KEPT[0])}
    assert nbytes(packed) < 0.95 * nbytes(tensors)
    unpack(packed)
    assert set(packed) == set(tensors)
    for name, t in tensors.items():
        assert packed[name].dtype == t.dtype and torch.equal(packed[name], t), name


def test_nothing_packed_is_left_alone():
    tensors = {KEPT[0]: torch.arange(3, dtype=torch.uint8)}
    assert pack(tensors) == tensors
    unpack(tensors)
    assert set(tensors) == {KEPT[0]}


@pytest.mark.parametrize("damage", ["truncated", "longer", "shape", "garbage", "no stream"])
def test_a_stream_that_does_not_fit_its_shapes_is_refused(damage):
    packed = pack(matrices())
    raw = lzma.decompress(packed[BLOB].numpy().tobytes())
    if damage == "truncated":
        raw = raw[:-1]
    elif damage == "longer":
        raw += b"\0"
    if damage in ("truncated", "longer"):
        packed[BLOB] = torch.frombuffer(bytearray(lzma.compress(raw)), dtype=torch.uint8)
    elif damage == "shape":
        packed["k_basis" + SHAPE][1] = -2
    elif damage == "garbage":
        packed[BLOB] = torch.frombuffer(bytearray(b"not lzma at all"), dtype=torch.uint8)
    else:
        del packed[BLOB]
    with pytest.raises(ValueError):
        unpack(packed)
