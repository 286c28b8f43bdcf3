"""The frozen text encoder of text-conditional diffusion: a transformers CLIP text model or T5 encoder
and its tokenizer from local folders (never a download); captions -> TextCondition (features [B, L, D],
mask [B, L]); and the features of the empty caption, computed once: the null condition that caption
dropout trains on and guidance samples against (Sana's choice; PixArt-alpha's learned null is a
parameter of the model instead). It never trains, and it never draws random numbers (the task does).
`PrecomputedText` stands in for it when the shards hold the features (`prunepipe latents encode
--text-encoder`, PixArt's way): no encoder in the training process, the same conditions.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from prunepipe.pipelines.data.description import SplitRecords, TextFeatureRecord

# config.model_type -> the transformers class holding the encoder alone (a T5 folder also has a decoder)
ENCODER_CLASSES = {
    "clip_text_model": "CLIPTextModel",
    "clip": "CLIPTextModel",
    "t5": "T5EncoderModel",
    "mt5": "MT5EncoderModel",
    "umt5": "UMT5EncoderModel",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "spiece.model",
)


@dataclass
class TextCondition:
    """What the transformer cross-attends to: per-token features and which tokens are real."""

    features: torch.Tensor  # float [B, L, D]: the encoder's last hidden state
    mask: torch.Tensor  # int64 [B, L]: 1 = a real token, 0 = padding

    def __len__(self) -> int:
        return len(self.features)

    def to(self, device) -> "TextCondition":
        return TextCondition(self.features.to(device), self.mask.to(device))

    def where(self, dropped: torch.Tensor, null: "TextCondition") -> "TextCondition":
        """Each sample where `dropped` [B] is true replaced by `null` (a batch of 1)."""
        features = torch.where(dropped[:, None, None], null.features.to(self.features.dtype), self.features)
        return TextCondition(features, torch.where(dropped[:, None], null.mask, self.mask))

    def expand(self, batch_size: int) -> "TextCondition":
        """A batch of 1 repeated `batch_size` times (views, no copies)."""
        return TextCondition(self.features.expand(batch_size, -1, -1), self.mask.expand(batch_size, -1))

    @staticmethod
    def cat(parts: list["TextCondition"]) -> "TextCondition":
        return TextCondition(torch.cat([p.features for p in parts]), torch.cat([p.mask for p in parts]))


def named(setting: str, value: str) -> str:
    """`value` as the user gave it: `--flag 'value'` for a command-line flag, `key='value'` for a config key."""
    return f"{setting} {value!r}" if setting.startswith("--") else f"{setting}={value!r}"


def whole(error: Exception) -> str:
    """An exception's message on one line, all of it: transformers' messages run over several lines,
    and their first alone can stop mid-sentence."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own noise off while a model loads from a local folder, restored after: its
    "Loading weights" bar and its logged warnings, chiefly the LOAD REPORT table of every tensor the
    class does not use when an encoder alone loads from a larger checkpoint (a T5 folder's decoder, a
    full CLIP's vision tower). Errors still show; the project's own progress bars are not
    transformers', and a missing tensor is said by `said_missing`."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def said_missing(setting: str, path: str, class_name: str, info: dict) -> None:
    """One line where a checkpoint lacks tensors of the model loaded from it (transformers starts
    them random): the only part of the LOAD REPORT `quiet_transformers` hides that changes results."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        listed = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        print(
            f"prunepipe: warning: {setting}={path!r}: {len(missing)} tensor(s) of {class_name} are not in its "
            f"weights and start random ({listed}): its outputs are not the trained model's",
            flush=True,
        )


def caption_dropped(draws, rate: float, device) -> torch.Tensor:
    """bool [B]: which samples train on the null caption this pass, one uniform of the sample's own
    draws each (keyed by (seed, pass, id): the same whatever the batch, the rank or a resume)."""
    return draws.rand().to(device) < rate


TEXT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def text_dtype(name: str) -> torch.dtype:
    """ldm.text.dtype as a torch dtype: auto = bfloat16 where CUDA has it, else float32."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return TEXT_DTYPES[name]


class TextEncoder:
    """A frozen encoder in eval mode and its tokenizer, both read from local folders only."""

    def __init__(
        self,
        path: str,
        tokenizer: str = "",
        max_length: int = 77,
        *,
        setting: str = "ldm.text.encoder",
        tokenizer_setting: str = "ldm.text.tokenizer",
        dtype: str = "auto",
    ):
        """`setting` and `tokenizer_setting` name where `path` and `tokenizer` came from (a config key,
        or the flags of `prunepipe latents encode`), for the messages. `dtype` (ldm.text.dtype): what the
        weights are loaded in; auto = bf16 on CUDA (T5-XXL: 9.5 GB instead of 19 on every GPU), fp32 on a CPU."""
        import transformers

        # absolute: an export records them, and is sampled from anywhere
        self.path = os.path.abspath(os.path.expanduser(path))
        self.tokenizer_path = os.path.abspath(os.path.expanduser(tokenizer or path))
        self.max_length = int(max_length)
        encoder_at = named(setting, path)
        tokenizer_at = named(tokenizer_setting, tokenizer) if tokenizer else encoder_at
        for where, folder in ((encoder_at, self.path), (tokenizer_at, self.tokenizer_path)):
            if not os.path.isdir(folder):
                raise FileNotFoundError(
                    f"{where}: no such folder. Give the local folder of a transformers "
                    f"CLIP text model or T5 encoder (config.json + weights) and its tokenizer; "
                    f"this machine never downloads (on a connected machine `hf download REPO` "
                    f"and copy the folder)"
                )
        with quiet_transformers():
            try:
                config = transformers.AutoConfig.from_pretrained(self.path, local_files_only=True)
            except (OSError, ValueError) as e:
                raise FileNotFoundError(f"{encoder_at}: no transformers config.json there: {whole(e)}") from None
            if config.model_type not in ENCODER_CLASSES:
                raise ValueError(
                    f"{encoder_at} holds a {config.model_type!r} model; accepted: "
                    f"{', '.join(sorted(ENCODER_CLASSES))} (a CLIP text model or a T5 encoder)"
                )
            self.class_name = ENCODER_CLASSES[config.model_type]
            try:
                self.model, info = getattr(transformers, self.class_name).from_pretrained(
                    self.path, local_files_only=True, output_loading_info=True, dtype=text_dtype(dtype)
                )
            except (OSError, ValueError) as e:
                raise FileNotFoundError(
                    f"{encoder_at}: cannot load its {self.class_name} weights: {whole(e)}"
                ) from None
            self.model.eval().requires_grad_(False)
            try:
                self.tokenizer = transformers.AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
            except (OSError, ValueError) as e:
                if tokenizer:
                    raise FileNotFoundError(
                        f"{tokenizer_at}: no tokenizer there ({', '.join(TOKENIZER_FILES)}): {whole(e)}"
                    ) from None
                raise FileNotFoundError(
                    f"{encoder_at}: no tokenizer beside the encoder "
                    f"({', '.join(TOKENIZER_FILES)}); give its folder with {tokenizer_setting} "
                    f"(Stable Diffusion and PixArt repos keep it in tokenizer/ beside "
                    f"text_encoder/). transformers said: {whole(e)}"
                ) from None
        said_missing(setting, self.path, self.class_name, info)
        self._null: TextCondition | None = None
        self._identity: dict | None = None

    @property
    def hidden_size(self) -> int:
        """D, the width of the features (PixArtTransformer2DModel's caption_channels)."""
        return int(
            self.model.config.hidden_size if hasattr(self.model.config, "hidden_size") else self.model.config.d_model
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, captions: list[str] | tuple[str, ...], device=None) -> TextCondition:
        """Captions -> their features, padded to max_length (a fixed shape: a sample's features do not
        depend on its batch-mates) and truncated beyond it; float32, whatever autocast runs the encoder in."""
        device = indexed(device) if device is not None else self.device
        if self.device != device:
            self.model.to(device)  # the loop moves only the trained model
        tokens = self.tokenizer(
            list(captions), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        ids, mask = tokens["input_ids"].to(device), tokens["attention_mask"].to(device).long()
        features = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return TextCondition(features.float(), mask)

    def null(self, device=None) -> TextCondition:
        """The features of the empty caption, a batch of 1, encoded once and kept on `device`."""
        device = indexed(device) if device is not None else self.device
        if self._null is None or self._null.features.device != device:
            self._null = self.encode([""], device)
        return self._null

    def identity(self) -> dict:
        """What an export records to find this encoder again and notice another in its place: the
        folders, the class, max_length, and a SHA-256 of the config and tokenizer files with each
        weight file's name and size (not its bytes: T5-XXL's are ~9 GB). Hashed once: the start, a
        resume and the export ask for it, every rank of a job from a shared file system."""
        if self._identity is None:
            self._identity = self._hashed_identity()
        return dict(self._identity)

    def _hashed_identity(self) -> dict:
        digest = hashlib.sha256()
        # by real folder: an export's tokenizer/ may be a link to its text_encoder/, one folder as the run's was
        for folder in dict.fromkeys(os.path.realpath(f) for f in (self.path, self.tokenizer_path)):
            for name in sorted(os.listdir(folder)):
                full = os.path.join(folder, name)
                if not os.path.isfile(full):
                    continue
                digest.update(name.encode())
                if name == "config.json" or name in TOKENIZER_FILES:
                    with open(full, "rb") as f:
                        digest.update(f.read())
                else:
                    digest.update(str(os.path.getsize(full)).encode())
        return {
            "text_encoder": self.path,
            "tokenizer": self.tokenizer_path,
            "class": self.class_name,
            "max_length": self.max_length,
            "digest": digest.hexdigest(),
        }


def indexed(device) -> torch.device:
    """`device` as tensors report theirs ("cuda" -> "cuda:N", the current one): a cache keyed by it
    must not miss on every call."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def identity_key(info: dict) -> str:
    """What makes two sets of features the same, from an identity (TextEncoder.identity): the encoder's
    files and the caption length, not the folders they were read from."""
    return f"{info['digest']} ({info['max_length']} tokens)"


def stored_identity(meta: dict) -> str:
    """identity_key of the text features a split's index.json records (`latents encode
    --text-encoder`), "" where it records none."""
    info = meta.get("text_encoder")
    return identity_key(info) if isinstance(info, dict) else ""


class PrecomputedText:
    """The text features `prunepipe latents encode --text-encoder` stored beside the latents: each
    sample's real tokens (text.npy), the empty caption's (text_null.npy beside index.json), and the
    encoder's identity in index.json. Answers what TextEncoder answers, without the encoder."""

    def __init__(self, record: TextFeatureRecord | None, index_path: str = ""):
        """`record`: the train split's text features as its index.json records them (None: it records
        none, an error naming `index_path`)."""
        if record is None:
            raise ValueError(
                f"ldm.text.features=precomputed: {index_path or 'data.train'} records no text features; write "
                f"them with `prunepipe latents encode ... --text-encoder PATH`, or set "
                f"ldm.text.features=encoder and ldm.text.encoder to the encoder's folder to encode captions in the loop"
            )
        self.index_path = record.index_path
        self.info = dict(record.encoder)
        self.width = record.width
        self.max_length = record.max_length
        null_path = record.null_path
        try:
            self._null_tokens = np.load(null_path, allow_pickle=False)
        except OSError as e:
            raise FileNotFoundError(
                f"{null_path}: the empty caption's features, written with the shards by "
                f"`prunepipe latents encode --text-encoder`, cannot be read: {e}"
            ) from None
        if self._null_tokens.ndim != 2 or self._null_tokens.shape[1] != self.width:
            raise ValueError(f"{null_path}: holds {list(self._null_tokens.shape)}, expected [tokens, {self.width}]")
        self._null: TextCondition | None = None

    @property
    def hidden_size(self) -> int:
        return self.width

    def encode(self, tokens, device=None) -> TextCondition:
        """Samples' stored features ([n, D] arrays) -> the TextCondition TextEncoder.encode gives
        their captions (float32, padded to max_length), up to the storage's precision."""
        device = indexed(device)
        lengths = torch.tensor([len(rows) for rows in tokens], device=device)
        return self.of_batch(torch.from_numpy(np.concatenate(tokens)).to(device), lengths)

    def of_batch(self, tokens: torch.Tensor, lengths: torch.Tensor) -> TextCondition:
        """A Batch's flat real tokens [T, D] and counts [B] (on one device) -> the padded condition,
        without a host round trip (T is the tensor's shape, known on the host): each token is copied to
        its row and place by index, never through a [B, L, D] mask."""
        count, device = len(tokens), tokens.device
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=count)
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths, output_size=count)
        places = rows * self.max_length + torch.arange(count, device=device) - starts
        features = torch.zeros(len(lengths) * self.max_length, self.width, device=device)
        features.index_copy_(0, places, tokens.float())
        mask = (torch.arange(self.max_length, device=device) < lengths[:, None]).long()
        return TextCondition(features.view(len(lengths), self.max_length, self.width), mask)

    def null(self, device=None) -> TextCondition:
        device = indexed(device)
        if self._null is None or self._null.features.device != device:
            self._null = self.encode([self._null_tokens], device)
        return self._null

    def identity(self) -> dict:
        """The encoder that made the features, as TextEncoder.identity() recorded it at encoding time."""
        return dict(self.info)


def load_text_encoder(cfg, records: SplitRecords) -> TextEncoder | PrecomputedText:
    """What turns captions into features for a text-conditional task (`cfg` its ldm: section): the
    encoder ldm.text names, or the features stored with the train split (`records`), checked against
    the config."""
    if cfg.text.features != "precomputed":
        return TextEncoder(cfg.text.encoder, cfg.text.tokenizer, cfg.text.max_length, dtype=cfg.text.dtype)
    text = PrecomputedText(records.text_features, records.index_path)
    if cfg.text.tokenizer:
        raise ValueError(
            f"ldm.text.tokenizer={cfg.text.tokenizer!r}: with ldm.text.features=precomputed the shards "
            f"hold features; no tokenizer runs"
        )
    if cfg.text.max_length != text.max_length:
        raise ValueError(
            f"ldm.text.max_length={cfg.text.max_length}, but {text.index_path} holds features of up to "
            f"{text.max_length} tokens (`latents encode --text-max-length`): set "
            f"ldm.text.max_length={text.max_length}"
        )
    return text
