"""Packed codes (sekv_core/bitpack.py): the one bit layout, in the tensor code and in the C."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sekv_core.bitpack import pack_codes, unpack_codes
from sekv_core.native import kernels
from sekv_core.native.build import library

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def random_layout(n: int, seed: int, spare_bytes: int = 0) -> tuple[torch.Tensor, int]:
    """(n,) widths 0..8, every width present, and a row's bytes (``spare_bytes`` past the bits)."""
    g = torch.Generator().manual_seed(seed)
    widths = torch.cat([torch.arange(9), torch.randint(0, 9, (n - 9,), generator=g)])
    widths = widths[torch.randperm(n, generator=g)]
    return widths, -(-int(widths.sum()) // 8) + spare_bytes


def random_codes(widths: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, widths.numel(), generator=g) * 2.0**widths).long()


def bits_of(packed: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """Each code read bit by bit, as the layout says: code j from bit s_j of the row, lowest first;
    bit b is bit b % 8 of byte b / 8."""
    bits = np.unpackbits(packed.numpy(), axis=-1, bitorder="little")
    at, read = 0, []
    for width in widths.tolist():
        read.append((bits[..., at : at + width] * (1 << np.arange(width))).sum(axis=-1))
        at += width
    assert not bits[..., at:].any()  # bits after the last code are 0
    return torch.from_numpy(np.stack(read, axis=-1))


@pytest.mark.parametrize("spare", [0, 3])
@pytest.mark.parametrize("n", [9, 64, 200])
def test_codes_of_every_width_lie_where_the_layout_says_and_unpack_to_themselves(n, spare):
    widths, nbytes = random_layout(n, seed=n + spare, spare_bytes=spare)
    codes = random_codes(widths, 300, seed=n)
    packed = pack_codes(codes, widths, nbytes)
    assert packed.shape == (300, nbytes) and packed.dtype == torch.uint8
    assert torch.equal(bits_of(packed, widths), codes)
    assert torch.equal(unpack_codes(packed, widths).long(), codes)


@pytest.mark.parametrize("device", DEVICES)
def test_unpacking_keeps_leading_dims_and_the_device(device):
    widths, nbytes = random_layout(64, seed=1)
    codes = random_codes(widths, 2 * 3 * 5, seed=2)
    packed = pack_codes(codes, widths, nbytes).view(2, 3, 5, nbytes).to(device)
    got = unpack_codes(packed, widths)
    assert got.device == packed.device and got.shape == (2, 3, 5, 64)
    assert torch.equal(got.cpu().long().view(-1, 64), codes)
    assert unpack_codes(packed[:0], widths).shape == (0, 3, 5, 64)


@pytest.mark.parametrize("widths", [[8], [3], [0, 5], [2, 0, 6], [8, 8], [4, 8, 4], [7, 8, 1]])
def test_short_rows_and_codes_in_the_last_byte_unpack(widths):
    w = torch.tensor(widths)
    codes = (2**w - 1)[None].expand(4, -1).clone()
    codes[1] = 0
    codes[2] = torch.arange(len(widths)) % (2**w).clamp(min=1)
    packed = pack_codes(codes, w)
    assert torch.equal(unpack_codes(packed, w).long(), codes)


@pytest.mark.skipif(library() is None, reason="needs the native library (a C compiler)")
@pytest.mark.parametrize("spare", [0, 1, 9])
@pytest.mark.parametrize("n", [9, 64, 256])
def test_the_c_decoder_reads_the_codes_the_tensor_code_reads(n, spare):
    """A store written by either decodes bit for bit in both: every width, bits to spare."""
    widths, nbytes = random_layout(n, seed=3 * n + spare, spare_bytes=spare)
    codes = random_codes(widths, 500, seed=n)
    packed = pack_codes(codes, widths, nbytes)
    native = kernels.field_codes(packed, widths)
    assert torch.equal(native, unpack_codes(packed, widths).float())
    assert torch.equal(native, codes.float())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_one_width_packs_whole_bytes_lowest_code_first(bits):
    codes = random_codes(torch.full((16,), bits), 7, seed=bits)
    packed = pack_codes(codes, bits)
    assert packed.shape == (7, 2 * bits)
    assert torch.equal(packed, pack_codes(codes, torch.full((16,), bits)))
    assert torch.equal(unpack_codes(packed, bits).long(), codes)
