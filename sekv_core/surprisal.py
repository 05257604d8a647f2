"""Token surprisal, -log p(next token), from the model's last hidden states.

The output projection over the whole vocabulary is the largest product of a store build (the
model's own prefill needs the last token's logits only). Where the device multiplies bfloat16
natively (CUDA, CPUs with AVX-512 BF16 or AMX), the log-normaliser comes from bfloat16 logits
with the ``REFINE`` largest of each row recomputed in float32 (they carry almost all of the
normaliser's mass), and the realised token's logit is computed in float32: close to the
float32 result at a fraction of its cost (figures: docs/design.md). Elsewhere every logit is
float32.
"""

from __future__ import annotations

import torch
from torch import nn

ROWS = 128  # logits over the vocabulary computed for this many tokens at a time
REFINE = 32  # largest logits per row recomputed in float32
BLOCK = 128  # vocabulary entries per block in the search for a row's largest logits
LOW = torch.bfloat16


def native_low_precision(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively (faster than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = torch.cpu
        return any(getattr(cpu, name, lambda: False)() for name in _CPU_BF16)
    return False


_CPU_BF16 = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")


class Surprisal:
    """-log p(target) in nats for hidden states (T, hidden) and realised tokens (T,)."""

    def __init__(self, head: nn.Linear, low_precision: bool | None = None):
        self.weight, self.bias = head.weight, head.bias
        if low_precision is None:
            low_precision = self.weight.dtype == torch.float32 and native_low_precision(
                self.weight.device
            )
        self.low = self.weight.to(LOW) if low_precision else None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # (ROWS, vocab) each

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(targets), dtype=torch.float32, device=hidden.device)
        for at in range(0, len(targets), ROWS):
            rows = slice(at, min(at + ROWS, len(targets)))
            out[rows] = self._rows(hidden[rows], targets[rows])
        return out

    def _rows(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.low is None:
            return token_nll(nn.functional.linear(hidden, self.weight, self.bias), targets)
        h = hidden.to(self.weight.dtype)
        low, logits = (buffer[: len(h)] for buffer in self.buffers())
        torch.mm(h.to(LOW), self.low.t(), out=low)
        if self.bias is not None:
            low += self.bias.to(LOW)
        top = top_indices(low, min(REFINE, low.shape[-1]))  # (T, k)
        logits.copy_(low).scatter_(1, top, self._exact(h, top))
        peak = logits.amax(dim=-1, keepdim=True)
        normaliser = logits.sub_(peak).exp_().sum(dim=-1).log_() + peak[:, 0]
        return normaliser - self._exact(h, targets[:, None])[:, 0]

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of ROWS tokens in bfloat16 and in float32, allocated once (the prefill's
        largest tensors, reused chunk after chunk)."""
        if self._buffers is None:
            shape, device = (ROWS, self.weight.shape[0]), self.weight.device
            self._buffers = (
                torch.empty(shape, dtype=LOW, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
            )
        return self._buffers

    def _exact(self, h: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
        """float32 logits of the tokens ``vocab`` (T, k) for the rows ``h`` (T, hidden)."""
        out = torch.einsum("td,tkd->tk", h, self.weight[vocab])
        return out if self.bias is None else out + self.bias[vocab]


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (T, k) of the k largest values of each row of x (T, V), found among the k blocks
    of BLOCK values with the largest maxima (those hold all k: a block without one of them has
    a max below the k-th value, and at most k blocks have one) instead of among all V."""
    T, V = x.shape
    if V % BLOCK or V // BLOCK <= k:
        return x.topk(k, dim=-1).indices
    blocks = x.view(T, V // BLOCK, BLOCK)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # (T, k) blocks
    candidates = blocks.gather(1, best[..., None].expand(T, k, BLOCK)).view(T, k * BLOCK)
    within = candidates.topk(k, dim=-1).indices
    return best.gather(1, within // BLOCK) * BLOCK + within % BLOCK


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) in nats for logits (T, V) and realised tokens (T,)."""
    pred = logits.float()
    return torch.logsumexp(pred, -1) - pred.gather(1, targets[:, None])[:, 0]
