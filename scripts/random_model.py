"""Write a random-weight model of the default model's shape, with a long window, for speed runs.

    python scripts/random_model.py /tmp/random-135m [--window 40960] [--layers 30]
    sekv bench speed --model /tmp/random-135m --sizes 16000,32000 --no-processes

The default model reads 8,192 tokens; this one has the same layers, heads and widths
(SmolLM2-135M: 30 layers, 9 query and 3 KV heads of 64, hidden 576) and ``--window`` positions,
so full KV and SeKV can be timed side by side at 16K-32K tokens (e.g. on a GPU, where nothing can
be downloaded). Its answers mean nothing; its speed and memory are the default model's. The
tokenizer is a byte-level BPE trained here on the speed benchmark's own filler sentences, with
the chat tokens the engine's prompt needs. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sekv_bench.haystack import NEEDLES, sentence  # noqa: E402

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SHAPE = dict(  # SmolLM2-135M-Instruct's
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)
ROPE = {"rope_type": "default", "rope_theta": 100000.0}
RMS_EPS = 1e-5


def train_tokenizer(out: Path, vocab: int, seed: int = 0):
    """A byte-level BPE of ``vocab`` tokens trained on filler sentences, questions and needles."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [sentence(rng) for _ in range(20_000)]
    corpus += [text for n in NEEDLES for text in (n.fact, n.question, n.answer)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def write_model(out: Path, window: int, layers: int, vocab: int, small: bool = False) -> Path:
    """Save a random Llama model and its tokenizer to ``out``. ``small``: 4 heads of 16 and a
    hidden size of 64 instead of the default model's widths (a quick check on a CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out, vocab)
    shape = dict(SHAPE)
    if small:
        shape.update(hidden_size=64, intermediate_size=128, num_attention_heads=4)
        shape.update(num_key_value_heads=2, head_dim=16)
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
        **shape,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--window", type=int, default=40_960, help="positions the model reads")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=4096, help="the tokenizer's size")
    parser.add_argument("--small", action="store_true", help="narrow heads (a quick CPU check)")
    args = parser.parse_args()
    path = write_model(args.out, args.window, args.layers, args.vocab, args.small)
    print(f"{path}: random model, {args.layers} layers, {args.window:,} positions")


if __name__ == "__main__":
    main()
