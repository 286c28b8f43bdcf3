"""The frozen AutoencoderKL of a latent run: loaded from a local folder or the hub cache (never
downloaded), and the folder it was read from, which an export links or copies as its vae/.
"""

from __future__ import annotations

import os
import warnings

from diffusers import AutoencoderKL
from huggingface_hub import constants as hub_constants


def _is_path(name: str) -> bool:
    """A folder rather than a hub repo id (which is OWNER/NAME)."""
    path = os.path.expanduser(name)
    return os.path.isdir(path) or name.startswith(("/", ".", "~")) or name.count("/") != 1


def load_autoencoder(name: str, subfolder: str = "", cache_dir: str = "", *, setting: str = "ldm.vae") -> AutoencoderKL:
    """A frozen AutoencoderKL in eval mode from a local folder or the hub cache; never downloads.
    `setting` names where `name` came from, for the error message."""
    path, is_path = os.path.expanduser(name), _is_path(name)
    problem = None
    if is_path and not os.path.isdir(path):
        problem = "the folder does not exist"
    else:
        try:
            with warnings.catch_warnings():
                # diffusers 0.42 still passes an argument that current huggingface_hub deprecates
                warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*")
                vae = AutoencoderKL.from_pretrained(
                    path, subfolder=subfolder or None, local_files_only=True, cache_dir=cache_dir or None
                )
        except (OSError, ValueError) as e:
            problem = str(e).splitlines()[0].rstrip(".")
    if problem is not None:
        where = f"the folder {path!r}" if is_path else f"the hub cache {cache_dir or hub_constants.HF_HUB_CACHE!r}"
        raise FileNotFoundError(
            f"{setting}={name!r} (subfolder {subfolder!r}): no diffusers AutoencoderKL "
            f"(config.json + diffusion_pytorch_model.safetensors) in {where}: {problem}. Accepted: a local "
            f"folder or a hub repo id already in the cache. "
            f"This machine never downloads: on a connected machine run `hf download REPO_ID` (e.g. "
            f"stabilityai/sd-vae-ft-mse), copy the folder it prints here and set {setting} to it, "
            f"or copy the whole hub cache and set the cache dir (ldm.cache_dir or HF_HUB_CACHE)"
        )
    return vae.eval().requires_grad_(False)


def autoencoder_folder(name: str, subfolder: str = "", cache_dir: str = "") -> str:
    """The local folder holding the AutoencoderKL `name` names (its `subfolder` included): the folder
    itself, or the repo's snapshot in the hub cache (OSError when the cache lacks it); nothing is read."""
    if _is_path(name):
        folder = os.path.abspath(os.path.expanduser(name))
    else:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name, local_files_only=True, cache_dir=cache_dir or None)
    return os.path.join(folder, subfolder) if subfolder else folder


def vae_factor(autoencoder) -> int:
    """The AutoencoderKL's downsampling factor: 2 per down block but the last (diffusers' vae_scale_factor)."""
    return 2 ** (len(autoencoder.config.block_out_channels) - 1)
