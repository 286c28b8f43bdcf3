"""`prunepipe latents encode`: image shards -> latent shards with the same ids, VAE latents and text
features beside each sample (tools/commands/latents.py), over processes or ranks."""

from __future__ import annotations

from prunepipe.launch.cli.options import add_job_arguments, add_read_retry_arguments, read_retry


def add_commands(sub, argv: list[str]) -> None:
    latents = sub.add_parser("latents", help="precompute VAE latents (and text features) of image shards")
    latents_sub = latents.add_subparsers(dest="latents_command", required=True)
    encode = latents_sub.add_parser("encode", help="image shards -> latent shards with the same ids")
    encode.add_argument("shards", help="image shard folder (with index.json)")
    encode.add_argument("--vae", required=True, help="local AutoencoderKL folder or a hub repo id in the cache")
    encode.add_argument("--out", required=True, help="output folder for the latent shards")
    encode.add_argument(
        "--resolution",
        type=int,
        help="image side fed to the VAE (default: the size the image shards' index.json records); with --buckets, "
        "the square base side latent_shape records (default: a named table's, e.g. 512 for pixart512)",
    )
    encode.add_argument("--subfolder", default="", help="e.g. vae, inside a Stable Diffusion repo")
    encode.add_argument("--cache-dir", default="", help="hub cache holding --vae (default: HF_HUB_CACHE)")
    encode.add_argument("--batch-size", type=int, default=32, help="images a VAE call (default: %(default)s)")
    encode.add_argument(
        "--dtype",
        default="float16",
        choices=("float16", "float32"),
        help="of the stored latents and text features (default: %(default)s)",
    )
    encode.add_argument(
        "--flip",
        action="store_true",
        help="also store each mirrored image's latent, for data.hflip runs (twice the encoding)",
    )
    encode.add_argument(
        "--text-encoder",
        default="",
        help="local CLIP text or T5 encoder folder: also store each caption's features (text.npy, "
        "real tokens only) for ldm.text.features=precomputed",
    )
    encode.add_argument("--tokenizer", default="", help="its tokenizer's folder (default: the encoder's)")
    encode.add_argument(
        "--text-max-length",
        type=int,
        help="tokens per caption, as ldm.text.max_length (default: the encoder's, CLIP 77; PixArt-alpha's T5 uses 120)",
    )
    encode.add_argument(
        "--buckets",
        default="",
        metavar="NAME|FILE",
        help="cut each image to its nearest aspect-ratio bucket, not the square: diffusers' PixArt table "
        "pixart256|pixart512|pixart1024|pixart2048 (or 256|512|1024|2048), or a file of sizes (HxW a line, or a "
        "JSON list of [h, w]); one tar per bucket of each shard, its latents [C, H/f, W/f] (docs/buckets.md)",
    )
    add_job_arguments(
        encode,
        "stop",
        "left out and listed in OUT/skipped.json; every later sample's id moves "
        "down, so embeddings or groups made on the image shards no longer line up",
        "cannot be read or decoded, or has no caption (txt, or json's 'caption') where one is needed",
    )
    add_read_retry_arguments(encode)
    encode.set_defaults(func=_encode)


def _encode(args) -> None:
    from prunepipe.tools.commands.latents import encode_shards

    path = encode_shards(
        args.shards,
        args.vae,
        args.out,
        resolution=args.resolution,
        batch_size=args.batch_size,
        subfolder=args.subfolder,
        cache_dir=args.cache_dir,
        dtype=args.dtype,
        flip=args.flip,
        text_encoder=args.text_encoder,
        tokenizer=args.tokenizer,
        text_max_length=args.text_max_length,
        on_bad_sample=args.on_bad_sample,
        rank=args.rank,
        world=args.world,
        wait_hours=args.wait_hours,
        retry=read_retry(args),
        buckets=args.buckets,
    )
    if path:
        print(path)
