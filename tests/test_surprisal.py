"""Token surprisal: the low-precision path stays within a few hundredths of a nat of float32."""

import torch
from torch import nn

from sekv_core.surprisal import BLOCK, ROWS, Surprisal, token_nll, top_indices


def _head(vocab: int = 4096, hidden: int = 96, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    head = nn.Linear(hidden, vocab, bias=bias)
    nn.init.normal_(head.weight, std=0.15)  # row norms like a small LM's tied embeddings
    return head


def _states(n: int, hidden: int = 96) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(n, hidden) * 4.0  # hidden-state norms of tens, as in the default model


def test_float32_path_is_the_plain_log_softmax():
    head, h = _head(bias=True), _states(300)
    targets = torch.randint(0, 4096, (300,))
    with torch.inference_mode():
        got = Surprisal(head, low_precision=False)(h, targets)
        want = -torch.log_softmax(head(h), -1).gather(1, targets[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-4)


def test_low_precision_path_within_a_few_hundredths_of_a_nat():
    for bias in (False, True):
        head, h = _head(bias=bias), _states(2 * ROWS + 5)  # more than one block, a ragged end
        targets = torch.randint(0, 4096, (len(h),))
        with torch.inference_mode():
            exact = token_nll(head(h), targets)
            fast = Surprisal(head, low_precision=True)(h, targets)
            plain = token_nll(head(h).bfloat16(), targets)  # bfloat16 logits, no refinement
        assert fast.shape == exact.shape and fast.dtype == torch.float32
        err = (fast - exact).abs().max().item()
        assert err < 0.05, err
        assert err < (plain - exact).abs().max().item()  # the refinement is what keeps it close


def test_the_largest_logits_are_found_through_their_blocks():
    """top_indices finds the same k largest values as a full top-k: rows whose largest values
    crowd into one block, spread over many, or tie."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64 * BLOCK, generator=g)
    x[0, 5 * BLOCK : 5 * BLOCK + 40] += 10  # all in one block
    x[1, ::BLOCK] += 10  # one in each block
    x[2] = x[2].round()  # many ties
    for k in (1, 8, 32):
        got = top_indices(x, k)
        assert got.shape == (6, k)
        want = x.topk(k, dim=-1).values
        assert torch.equal(x.gather(1, got).sort(-1, descending=True).values, want)
        assert all(len(set(row.tolist())) == k for row in got)  # k distinct entries
