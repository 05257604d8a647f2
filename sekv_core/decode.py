"""Decoding over a model step function (shared by every method).

:func:`decode_tokens` chooses each answer token greedily, or under a
:class:`~sekv_core.sampling.Sampling`; given a :class:`Forcing` it feeds given answer tokens
instead (teacher forcing) and records each step's log-probabilities: the fidelity benchmark
compares a method's next-token distributions with full KV's along full KV's own answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .sampling import Sampling, chooser

Step = Callable[[torch.Tensor], torch.Tensor]
"""Feeds token ids (1, T) at the next positions; returns next-token logits (1, vocab)."""


class PositionedStep:
    """A :data:`Step` over ``cache`` whose tokens take the positions ``start``, ``start`` + 1, …

    ``model_kwargs`` go to every forward call (a custom attention's inputs). ``fed`` counts the
    tokens fed so far (the local window's length); ``last_position`` is the largest position used.
    """

    def __init__(self, model, cache, start: int, device, **model_kwargs) -> None:
        self.model, self.cache, self.start, self.device = model, cache, start, device
        self.model_kwargs = model_kwargs
        self.fed = 0
        self.last_position = start - 1

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=self.device)[None] + self.start + self.fed
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=pos,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
            **self.model_kwargs,
        )
        self.fed += ids.shape[1]
        self.last_position = int(pos[0, -1])
        return out.logits[:, -1].float()


@dataclass
class Forcing:
    """Answer tokens to feed (None: the method's own choices) and, filled in while decoding,
    each step's log-probabilities (vocab,) the method predicted (on the CPU)."""

    tokens: list[int] | None = None
    logprobs: list[torch.Tensor] = field(default_factory=list)


def decode_tokens(
    step: Step,
    prompt_ids: list[int],
    stop: set[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    forcing: Forcing | None = None,
) -> Iterator[int]:
    """Yield answer token ids until a stop token or ``max_new_tokens``: the arg-max, or drawn
    under ``sampling``; with ``forcing``, every step's log-probabilities are recorded into it
    and its tokens (if any) are fed instead of chosen (no stop token ends them)."""
    given = forcing.tokens if forcing is not None else None
    choose = chooser(sampling) if given is None else None  # None: the arg-max
    answer: list[int] = []
    if given is not None:
        max_new_tokens = min(max_new_tokens, len(given))
    device_ids = torch.tensor([prompt_ids], dtype=torch.long)
    logits = step(device_ids)
    for i in range(max_new_tokens):
        if forcing is not None:
            forcing.logprobs.append(logits[0].float().log_softmax(-1).cpu())
        if given is not None:
            token = given[i]
        else:
            token = choose(logits, answer) if choose else int(logits[0].argmax())
        if given is None and token in stop:
            return
        answer.append(token)
        yield token
        if i + 1 < max_new_tokens:
            logits = step(torch.tensor([[token]], dtype=torch.long))


class TextStream:
    """Turns a growing list of token ids into text deltas (safe across multi-byte tokens).

    With ``stop`` strings the text ends before the first one found (``stopped`` turns true), and
    a tail that could be the start of one is held back until the next tokens tell
    (:meth:`flush` hands out what is left at the end).

    An answer also ends where it starts to repeat itself (unless ``allow_repeats``): a sentence that
    is one it already wrote, word for word, is not shown and ends the answer (greedy decoding
    that repeats a sentence has entered a loop). While the sentence being written could still
    become such a repeat, it is held back. A loop inside a sentence ends it too: tokens that
    repeat a unit of at most ``LOOP_PERIOD`` tokens back to back (``BREAKER-BREAKER-…``, ``a
    19-year-old, a 19-year-old, …``) for ``LOOP_TOKENS`` tokens and ``LOOP_REPEATS`` units are
    cut after the first unit (:func:`token_loop`); the copies after it are held back while
    they could become such a loop, and shown once the repetition stops short of one.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), allow_repeats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.allow_repeats = allow_repeats
        self.ids: list[int] = []
        self.text = ""
        self.shown = 0  # characters of text handed out
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            text, self.stopped = text[: min(found)], True
        repeat_at, repeat_hold = (None, 0) if self.allow_repeats else repeated_sentence(text)
        if repeat_at is not None:
            text, self.stopped = text[:repeat_at].rstrip(), True
        loop_hold = 0
        if not self.allow_repeats and not self.stopped:
            first_unit, looping = token_loop(self.ids)
            if first_unit is not None:
                kept = len(self.tokenizer.decode(self.ids[:first_unit], skip_special_tokens=True))
                kept = max(kept, self.shown)  # what is shown stays shown
                if looping:
                    text, self.stopped = text[: word_end(text, kept)].rstrip(), True
                else:
                    loop_hold = max(len(text) - kept, 0)
        self.text = text
        hold = 0 if self.stopped else max(self._held(text), repeat_hold, loop_hold)
        return self._hand_out(len(text) - hold)

    def flush(self) -> str:
        """What is held back, at the end of the answer (a last sentence that repeats an
        earlier one is dropped)."""
        if not self.allow_repeats and not self.stopped:
            at, _ = repeated_sentence(self.text + "\n")  # the answer's end ends its sentence
            if at is not None and at >= self.shown:
                self.text = self.text[:at].rstrip()
        return self._hand_out(len(self.text))

    def _held(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins a stop string."""
        return max(
            (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0
        )

    def _hand_out(self, upto: int) -> str:
        delta = self.text[self.shown : upto] if upto > self.shown else ""
        self.shown = max(self.shown, upto)
        return delta


LOOP_PERIOD = 32  # the longest unit (tokens) a token loop repeats
LOOP_TOKENS = 48  # a loop: its units cover at least this many tokens…
LOOP_REPEATS = 3  # …in at least this many units
LOOP_HOLD = 4  # a repeat of this many tokens (or a whole unit) may start a loop: held back


def token_loop(ids: Sequence[int]) -> tuple[int | None, bool]:
    """The longest run at the end of ``ids`` that repeats the tokens ``p`` before it
    (``p`` ≤ ``LOOP_PERIOD``, the smallest such ``p`` for a run of that length): where the
    first unit of that repetition ends (an index into ``ids``; None when the run is shorter
    than ``LOOP_HOLD`` and than a unit), and whether it is a loop (units covering
    ``LOOP_TOKENS`` tokens and ``LOOP_REPEATS`` units at least)."""
    n = len(ids)
    best_run, best_period = 0, 0
    for period in range(1, min(LOOP_PERIOD, n - 1) + 1):
        run = 0
        while run < n - period and ids[n - 1 - run] == ids[n - 1 - run - period]:
            run += 1
        if run > best_run:
            best_run, best_period = run, period
    if best_run < min(LOOP_HOLD, best_period):
        return None, False
    covered = best_run + best_period
    looping = covered >= LOOP_TOKENS and covered >= LOOP_REPEATS * best_period
    return n - best_run, looping


WORD_END = re.compile(r"\S*?(?:\s|$)")


def word_end(text: str, at: int, reach: int = 16) -> int:
    """``at``, or where the word ``at`` falls inside ends (its next white space, within
    ``reach`` characters): a loop's first unit can end inside a word."""
    if at == 0 or at >= len(text) or text[at - 1].isspace() or text[at].isspace():
        return at
    end = WORD_END.match(text, at).end()  # type: ignore[union-attr]
    return end if end - at <= reach else at


SENTENCE = re.compile(r".*?(?:[.!?]+(?=\s)|\n)")  # one sentence and its end mark


def repeated_sentence(text: str) -> tuple[int | None, int]:
    """Where ``text``'s last complete sentence begins if it repeats an earlier one word for
    word (else None), and how many characters at its end to hold back: the unfinished
    sentence, while it is the beginning of an earlier one."""
    seen: set[str] = set()
    end = 0
    for m in SENTENCE.finditer(text):
        words = " ".join(m.group().split())
        if words in seen and len(words.split()) > 1:
            return m.start(), 0
        if words:
            seen.add(words)
        end = m.end()
    tail = " ".join(text[end:].split())  # white space alone is held too
    if not tail or any(earlier.startswith(tail) for earlier in seen):
        return None, len(text) - end
    return None, 0
