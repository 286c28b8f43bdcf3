"""`prunepipe text-encoder tiny`: a tiny CLIP text model with random weights and a word-level tokenizer
of the given captions' words, saved with save_pretrained as a real encoder folder is, so that tests and
the CPU demo load it by path like any other (ldm.text.encoder); and a tiny full CLIP (both towers and
its processor) for CLIPScore (eval.clip_score.model). Random features still tell captions
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


def word_tokenizer(captions: Iterable[str], max_length: int):
    """A PreTrainedTokenizerFast of the captions' lower-cased words: <bos> caption <eos>, padded with <pad>."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *vocabulary(captions)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=max_length)


def _text_config(tokenizer, hidden_size: int, layers: int, heads: int, max_length: int) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=max_length,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _seeded(build, seed: int):
    """build() under torch.manual_seed(seed): the same folder from the same arguments, without moving
    the caller's RNG."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def write_tiny_text_encoder(out: str, captions: Iterable[str], *, hidden_size: int = 32, layers: int = 2,
                            heads: int = 2, max_length: int = 16, seed: int = 0) -> str:
    """A CLIPTextModel of `hidden_size` x `layers` and its PreTrainedTokenizerFast (lower-cased words,
    <bos> caption <eos>, padded with <pad>) in `out`; returns `out`."""
    from transformers import CLIPTextConfig, CLIPTextModel
    from transformers.utils import logging

    logging.disable_progress_bar()
    fast = word_tokenizer(captions, max_length)
    config = CLIPTextConfig(**_text_config(fast, hidden_size, layers, heads, max_length))
    model = _seeded(lambda: CLIPTextModel(config), seed)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def write_tiny_clip(out: str, captions: Iterable[str], *, image_size: int = 16, patch_size: int = 4,
                    hidden_size: int = 16, layers: int = 1, heads: int = 2, projection_dim: int = 8,
                    max_length: int = 16, seed: int = 0) -> str:
    """A CLIPModel (vision and text towers of `hidden_size` x `layers`, random weights) with its
    CLIPProcessor (CLIPImageProcessor at `image_size` px and the word tokenizer) in `out`, as a
    downloaded CLIP folder is laid out (eval.clip_score.model); returns `out`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    from transformers.utils import logging

    logging.disable_progress_bar()
    fast = word_tokenizer(captions, max_length)
    vision = dict(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                  num_attention_heads=heads, image_size=image_size, patch_size=patch_size)
    config = CLIPConfig(text_config=_text_config(fast, hidden_size, layers, heads, max_length), vision_config=vision,
                        projection_dim=projection_dim)
    model = _seeded(lambda: CLIPModel(config), seed)
    images = CLIPImageProcessor(size={"shortest_edge": image_size},
                                crop_size={"height": image_size, "width": image_size})
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    CLIPProcessor(image_processor=images, tokenizer=fast).save_pretrained(out)
    return out
