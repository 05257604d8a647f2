"""Random-weight models built in code (nothing downloaded): a byte-level BPE tokenizer trained
on given text, with the chat template the engine's prompt needs, and a Llama model of the
default model's shape (SmolLM2-135M) or a narrow one, with any window.

``scripts/random_model.py`` writes one for speed runs past the default's 8,192 tokens; the tests
build their tiny models with the same tokenizer.
"""

from __future__ import annotations

import random
from pathlib import Path

from .haystack import NEEDLES, sentence

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SHAPE = dict(  # SmolLM2-135M-Instruct's
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)
NARROW = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
)
ROPE = {"rope_type": "default", "rope_theta": 100000.0}
RMS_EPS = 1e-5


def byte_bpe(
    out: Path,
    corpus: list[str],
    vocab: int,
    specials: list[str],
    pad: str,
    unk: str | None = None,
):
    """Train a byte-level BPE of ``vocab`` tokens on ``corpus`` (``specials`` first), with the
    chat template; saved to ``out`` and returned (bos ``<|im_start|>``, eos ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    extra = {"unk_token": unk} if unk else {}
    ends = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": pad}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **ends, **extra)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def filler_corpus(seed: int = 0, sentences: int = 20_000) -> list[str]:
    """The speed benchmark's filler sentences, and its needles' facts, questions and answers."""
    rng = random.Random(seed)
    corpus = [sentence(rng) for _ in range(sentences)]
    return corpus + [text for n in NEEDLES for text in (n.fact, n.question, n.answer)]


def write_model(
    out: Path, window: int, layers: int, vocab: int = 4096, narrow: bool = False
) -> Path:
    """Save a random Llama model of the default model's shape (``narrow``: 4 heads of 16, a
    hidden size of 64: a quick check on a CPU) with ``window`` positions, and its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = byte_bpe(out, filler_corpus(), vocab, specials, pad="<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        num_hidden_layers=layers,
        max_position_embeddings=window,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        rope_parameters=dict(ROPE),
        rms_norm_eps=RMS_EPS,
        **(NARROW if narrow else SHAPE),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out
