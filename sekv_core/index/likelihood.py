"""How well a passage explains a question, in the answering model's own judgement.

:class:`QuestionLikelihood` reads each passage followed by the question and returns the mean
log-probability the model gives the question's tokens. A passage that states what the question
asks about makes its words likely even when they are other words than the passage's (asked
about "dock building", the model expects it after a sentence on "harbour works"); a passage
that only shares the question's place or topic does not. It re-orders the few passages the
words and the embedder found first (:mod:`.ranking`): one batched forward pass over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

PASSAGE_TOKENS = 96  # a passage is cut to this many tokens (a sentence of ~60 words fits)
QUESTION_TOKENS = 64  # and a question part to this many


class QuestionLikelihood:
    """``model`` (a causal LM) and its ``tokenizer``; calling it scores passages for a
    question."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def _ids(self, text: str, limit: int) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"][:limit]

    @torch.inference_mode()
    def __call__(self, passages: Sequence[str], question: str) -> np.ndarray:
        """(len(passages),) the mean log-probability of ``question``'s tokens after each
        passage (higher: the passage explains the question better)."""
        if not passages:
            return np.zeros(0)
        asked = self._ids(f"\nQuestion: {' '.join(question.split())}", QUESTION_TOKENS)
        heads = [self._ids(f"Passage: {' '.join(p.split())}", PASSAGE_TOKENS) for p in passages]
        length = max(len(h) for h in heads) + len(asked)
        device = next(self.model.parameters()).device
        ids = torch.full((len(heads), length), self.pad, dtype=torch.long)
        mask = torch.zeros((len(heads), length), dtype=torch.long)
        for row, head in enumerate(heads):  # right-padded: positions count from 0 in every row
            ids[row, : len(head) + len(asked)] = torch.tensor(head + asked)
            mask[row, : len(head) + len(asked)] = 1
        hidden = self.model.get_decoder()(
            input_ids=ids.to(device), attention_mask=mask.to(device)
        ).last_hidden_state  # (B, L, D)
        # the positions that predict each question token: len(head) - 1 onwards in each row
        at = torch.tensor([len(h) - 1 for h in heads])[:, None] + torch.arange(len(asked))
        picked = hidden.gather(1, at.to(device)[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = self.model.get_output_embeddings()(picked).float()  # (B, Q, V)
        targets = torch.tensor(asked, device=device)[None, :, None].expand(len(heads), -1, 1)
        scores = logits.log_softmax(-1).gather(2, targets).squeeze(2)  # (B, Q)
        return scores.mean(1).cpu().numpy()
