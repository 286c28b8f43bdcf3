"""`prunepipe text-encoder tiny | vae tiny`: a tiny random CLIP text encoder and a tiny random
AutoencoderKL, saved as real ones are (tools/fixtures/), for CPU tests, demos and recipes."""

from __future__ import annotations


def add_commands(sub, argv: list[str]) -> None:
    text = sub.add_parser("text-encoder", help="text encoders for ldm.conditioning=text")
    text_sub = text.add_subparsers(dest="text_encoder_command", required=True)
    tiny = text_sub.add_parser(
        "tiny",
        help="a tiny random CLIP text model and a word-level tokenizer of the "
        "shards' captions, for CPU tests and demos",
    )
    tiny.add_argument("shards", nargs="+", help="captioned shard folders (with index.json) whose words it knows")
    tiny.add_argument("--out", required=True, help="output folder (ldm.text.encoder)")
    tiny.add_argument("--hidden-size", type=int, default=32)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--max-length", type=int, default=16, help="tokens per caption (ldm.text.max_length)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_text_encoder_tiny)

    vae = sub.add_parser("vae", help="autoencoders for ldm.space=vae and latents encode")
    vae_sub = vae.add_subparsers(dest="vae_command", required=True)
    tiny_vae = vae_sub.add_parser("tiny", help="a tiny random AutoencoderKL folder, for CPU tests and recipes")
    tiny_vae.add_argument("--out", required=True, help="output folder (ldm.vae, latents encode --vae)")
    tiny_vae.add_argument("--channels", type=int, default=3, help="image channels (default: %(default)s)")
    tiny_vae.add_argument(
        "--levels", type=int, default=2, help="resolution levels: downsampling 2**(levels-1) (default: %(default)s)"
    )
    tiny_vae.add_argument("--seed", type=int, default=0)
    tiny_vae.set_defaults(func=_vae_tiny)


def _text_encoder_tiny(args) -> None:
    from prunepipe.pipelines.data.shards import BadInputError
    from prunepipe.pipelines.data.splits import read_captions
    from prunepipe.tools.fixtures.tiny_text_encoder import write_tiny_text_encoder

    hint = "write them with `prunepipe shards write --captions`"
    try:
        captions = [text for folder in args.shards for text in read_captions(folder)]
    except BadInputError as e:  # a sample without a caption
        raise SystemExit(f"{e}: {hint}") from None
    if not captions:
        raise SystemExit(f"no captions (txt fields) in {', '.join(args.shards)}: {hint}")
    path = write_tiny_text_encoder(
        args.out, captions, hidden_size=args.hidden_size, layers=args.layers, max_length=args.max_length, seed=args.seed
    )
    print(
        f"{path}: a tiny CLIP text model (random weights) and the tokenizer of {len(captions)} captions' words; "
        f"set ldm.text.encoder={path} ldm.text.max_length={args.max_length}"
    )


def _vae_tiny(args) -> None:
    from prunepipe.tools.fixtures.tiny_vae import write_tiny_vae

    path = write_tiny_vae(args.out, channels=args.channels, levels=args.levels, seed=args.seed)
    print(f"{path}: a tiny AutoencoderKL (random weights, {2 ** (args.levels - 1)}x downsampling); --vae {path}")
