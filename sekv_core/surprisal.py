"""Token surprisal, -log p(next token), from the model's last hidden states.

The output projection over the whole vocabulary is the largest product of a store build (the
model's own prefill needs the last token's logits only). Where the device multiplies bfloat16
natively (CUDA, CPUs with AVX-512 BF16 or AMX), the log-normaliser comes from bfloat16 logits
with the ``REFINE`` largest of each row recomputed in float32 (they carry almost all of the
normaliser's mass), and the realised token's logit is computed in float32: within a few
hundredths of a nat of the float32 result at about a third of its cost on such a CPU.
Elsewhere every logit is float32.
"""

from __future__ import annotations

import torch
from torch import nn

ROWS = 128  # logits over the vocabulary computed for this many tokens at a time
REFINE = 32  # largest logits per row recomputed in float32
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
        logits = nn.functional.linear(h.to(LOW), self.low).float()
        top = logits.topk(min(REFINE, logits.shape[-1]), dim=-1).indices  # (T, k)
        logits.scatter_(1, top, self._exact(h, top))
        return torch.logsumexp(logits, -1) - self._exact(h, targets[:, None])[:, 0]

    def _exact(self, h: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
        """float32 logits of the tokens ``vocab`` (T, k) for the rows ``h`` (T, hidden)."""
        out = torch.einsum("td,tkd->tk", h, self.weight[vocab])
        return out if self.bias is None else out + self.bias[vocab]


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) in nats for logits (T, V) and realised tokens (T,)."""
    pred = logits.float()
    return torch.logsumexp(pred, -1) - pred.gather(1, targets[:, None])[:, 0]
