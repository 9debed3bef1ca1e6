"""Tiny random Hugging Face checkpoints for tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BYTE_SPECIALS = ("<unk>", "<s>", "</s>")
BYTE_VOCAB = len(BYTE_SPECIALS) + 256

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None, pad_token_id=None)

VARIANTS = {
    # GQA, odd vocabulary, untied.
    "gqa": {},
    # Llama 3.1 rope scaling, tied embeddings, head_dim != hidden/heads.
    "llama3_tied": dict(tie_word_embeddings=True, head_dim=24, num_key_value_heads=1, vocab_size=97,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
    # Multi-head attention, a different eps.
    "mha": dict(num_key_value_heads=4, rms_norm_eps=1e-6, vocab_size=67),
    # "gqa" with 2 layers: for tests whose kernels run interpreted (each layer's launches cost seconds).
    "gqa_2layer": dict(num_hidden_layers=2),
    # A byte-level vocabulary (save_byte_tokenizer): random weights emit any byte, so outputs
    # end inside multi-byte characters and hold invalid UTF-8.
    "bytes": dict(vocab_size=BYTE_VOCAB),
}


def make_tiny_llama(path: Path, variant: str = "gqa", seed: int = 0, max_shard_size: str | None = None,
                    **overrides) -> Path:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**BASE, **VARIANTS[variant], **overrides})
    model = LlamaForCausalLM(cfg).eval()
    # Larger-than-default weights make logits spread out, so greedy ties are rare
    # and a wrong token shows up as a large log-prob difference.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    if variant == "bytes":
        save_byte_tokenizer(path)
    elif cfg.vocab_size >= 99:
        save_char_tokenizer(path)
    return path


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer: <unk>, <s>, </s>, then one id per byte (GPT-2's byte alphabet,
    no merges), so every string encodes and any id sequence decodes, invalid UTF-8 as U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(BYTE_SPECIALS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    assert len(vocab) == BYTE_VOCAB
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def save_char_tokenizer(path: Path) -> None:
    """A character-level tokenizer over printable ASCII (99 ids: <unk>, <s>, </s>, then characters).

    It fits the tiny models' vocabularies (>= 99) and needs no training or download.
    It has no chat template, so chat requests use the gateway's documented plain template.
    """
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in string.printable:
        if c not in "\r\x0b\x0c\t":
            vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
