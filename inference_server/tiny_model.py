"""Build a small random-initialised causal LM plus a locally trained tokenizer.

    python -m inference_server.tiny_model OUT_DIR [--hidden 384 --layers 4 --vocab 8000]

The result is an ordinary Hugging Face checkpoint directory: `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load it exactly as they load a downloaded one. Nothing is fetched.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Qwen2's and Llama's tokenizer classes add an unk token of their own if it is missing: give them one.
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|endoftext|>", "<unk>",
                  "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]


def _training_corpus() -> list[str]:
    """Text made in code: digits, arithmetic, words; enough to give a tokenizer sensible merges."""
    words = ("the a of to and in is it you that he was for on are with as his they be at one have "
             "this from or had by word but what some we can out other were all there when up use your "
             "how said an each she which do their time if will way about many then them write would "
             "like so these her long make thing see him two has look more day could go come did number "
             "sound no most people my over know water than call first who may down side been now find "
             "answer question reverse copy sort add sum digits list result think step").split()
    lines = []
    for i in range(4000):
        a, b = (i * 7919) % 1000, (i * 104729) % 997
        seq = " ".join(words[(i * k) % len(words)] for k in range(1, 12))
        lines.append(f"{seq}. {a} + {b} = {a + b}. reverse {a}{b} -> {str(a)[::-1]}")
    return lines


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        unk_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS[5:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


CHARS = "0123456789 =+-*:;,.?!>()[]abcdefghijklmnopqrstuvwxyz"


def build_char_tokenizer():
    """One token per character of CHARS: small vocabularies make RL from scratch feasible on a CPU."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        unk_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS[5:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(out_dir: str | Path, hidden: int = 384, layers: int = 4, heads: int = 6,
                     kv_heads: int = 2, intermediate: int | None = None, vocab: int = 8000,
                     max_positions: int = 2048, seed: int = 0, arch: str = "qwen2",
                     tokenizer: str = "bpe") -> Path:
    """Write a random-initialised Llama or Qwen2 model and its tokenizer to `out_dir`.

    `tokenizer`: "bpe" (trained locally to `vocab` tokens) or "chars" (one token per character; the
    vocabulary is then the character set's size and `vocab` is ignored).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer not in ("bpe", "chars"):
        raise ValueError(f"tokenizer={tokenizer!r}: expected 'bpe' or 'chars'")
    tokenizer = build_tokenizer(vocab) if tokenizer == "bpe" else build_char_tokenizer()
    vocab = len(tokenizer)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate or hidden * 8 // 3,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )
    if arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise ValueError(f"arch={arch!r}: expected 'qwen2' or 'llama'")
    torch.manual_seed(seed)
    model = cls(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="bpe", choices=["bpe", "chars"])
    a = p.parse_args(argv)
    out = build_tiny_model(a.out_dir, a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate,
                           a.vocab, a.max_positions, a.seed, a.arch, a.tokenizer)
    print(out)


if __name__ == "__main__":
    main()
