"""`prunepipe text-encoder tiny`: a tiny CLIP text model with random weights and a word-level tokenizer
of the given captions' words, saved with save_pretrained as a real encoder folder is, so that tests and
the CPU demo load it by path like any other (ldm.text_encoder). Random features still tell captions
apart, which is all a tiny text-conditional model needs; nothing is downloaded.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")  # ids 0..3
WORD = re.compile(r"\w+|[^\w\s]+")  # what the Whitespace pre-tokenizer splits into


def vocabulary(captions: Iterable[str]) -> list[str]:
    """The sorted distinct lower-cased words and punctuation runs of `captions`."""
    return sorted({word for caption in captions for word in WORD.findall(caption.lower())})


def write_tiny_text_encoder(out: str, captions: Iterable[str], *, hidden_size: int = 32, layers: int = 2,
                            heads: int = 2, max_length: int = 16, seed: int = 0) -> str:
    """A CLIPTextModel of `hidden_size` x `layers` and its PreTrainedTokenizerFast (lower-cased words,
    <bos> caption <eos>, padded with <pad>) in `out`; returns `out`."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast
    from transformers.utils import logging

    logging.disable_progress_bar()
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *vocabulary(captions)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=max_length)
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=max_length,
                            bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"])
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # the same folder from the same captions and seed, without moving the caller's RNG
    try:
        model = CLIPTextModel(config)
    finally:
        torch.random.set_rng_state(generator_state)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out
