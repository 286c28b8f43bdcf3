"""`prunepipe shards embed | import-embeddings | dedup`: an embedding per sample, computed
(tools/commands/embed.py) or joined from a web dataset's (embedding_import.py), and the near-duplicate
groups they give (dedup.py)."""

from __future__ import annotations

import os

from prunepipe.launch.cli.options import add_job_arguments, add_read_retry_arguments, read_retry


def add_commands(shards_sub) -> None:
    embed = shards_sub.add_parser(
        "embed", help="one L2-normalised float16 embedding per sample, beside index.json (resumable)"
    )
    embed.add_argument("location", help="split folder with index.json (gets embeddings/NAME.npy and NAME.json)")
    embed.add_argument(
        "--model",
        required=True,
        help="timm:ARCH (with --weights FILE), timm:FOLDER (config.json + weights), mae:RUN_OR_EXPORT_DIR, "
        "feature-net[:FILE], or phash[:SIDE] (the model-free perceptual hash: SIDE x SIDE bits, "
        "8 by default)",
    )
    embed.add_argument("--weights", help="for timm:ARCH: a local .safetensors or .pth file (nothing is downloaded)")
    embed.add_argument("--batch-size", type=int, default=64)
    embed.add_argument("--image-size", type=int, help="decode side (default: the model's input size)")
    embed.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    embed.add_argument(
        "--out", help="the embeddings' name (default from the model: phash, feature-net, timm-ARCH, ...)"
    )
    add_job_arguments(embed, "skip", "a zero row, listed as missing; no id moves", "cannot be read or decoded")
    add_read_retry_arguments(embed)
    embed.set_defaults(func=_embed)
    imports = shards_sub.add_parser(
        "import-embeddings",
        help="embeddings a web dataset ships (clip-retrieval, DataComp), joined to the samples by key",
    )
    imports.add_argument("location", help="split folder with index.json")
    imports.add_argument("--format", required=True, choices=("clip-retrieval", "datacomp"))
    imports.add_argument(
        "--from",
        dest="source",
        required=True,
        help="clip-retrieval: the folder holding img_emb/ and metadata/; datacomp: the folder of "
        "STEM.parquet + STEM.npz",
    )
    imports.add_argument("--embedding", default="l14_img", choices=("l14_img", "b32_img"), help="for datacomp")
    imports.add_argument(
        "--sample-key",
        help="what a sample is joined by: key (its WebDataset key; clip-retrieval's "
        "default) or json:FIELD (a field of its .json; datacomp's default "
        "json:uid)",
    )
    imports.add_argument("--out", help="the embeddings' name (default: the format's)")
    imports.set_defaults(func=_import_embeddings)
    dedup = shards_sub.add_parser(
        "dedup",
        help="near-duplicate groups from embeddings: spherical k-means, exact "
        "inner-product pairs per cluster, connected components",
    )
    dedup.add_argument("location", help="split folder with index.json and embeddings/")
    dedup.add_argument("--embeddings", required=True, help="name of the embeddings (embeddings/NAME.npy)")
    dedup.add_argument(
        "--threshold",
        type=float,
        required=True,
        help="inner product of normalised rows at or above which two samples are near-duplicates "
        "(phash: 1 - 2 * hamming / 64, so 0.74 keeps hamming <= 8)",
    )
    dedup.add_argument("--clusters", type=int, help="k-means clusters (default: sqrt of the samples)")
    dedup.add_argument(
        "--report-thresholds",
        type=float,
        nargs="+",
        default=[0.8, 0.85, 0.9, 0.95, 0.98],
        help="thresholds the report also counts groups at (the same pairwise similarities)",
    )
    dedup.add_argument("--out", help="the groups' name (default: EMBEDDINGS_THRESHOLD)")
    dedup.add_argument("--no-picture", action="store_true", help="skip the PNG of a few groups")
    dedup.add_argument(
        "--no-spill",
        action="store_true",
        help="search each cluster alone (SemDeDup); by default a cluster's search also holds the rows "
        "whose second-nearest centroid it is, which finds pairs split across two clusters",
    )
    dedup.add_argument("--seed", type=int, default=0, help="k-means and the picture's random groups")
    dedup.set_defaults(func=_dedup)


def _embed(args) -> None:
    from prunepipe.pipelines.data.side_tables import open_embeddings
    from prunepipe.tools.commands.embed import embed_shards

    path = embed_shards(
        args.location,
        args.model,
        weights=args.weights,
        name=args.out,
        batch_size=args.batch_size,
        image_size=args.image_size,
        device=args.device,
        on_bad_sample=args.on_bad_sample,
        rank=args.rank,
        world=args.world,
        wait_hours=args.wait_hours,
        retry=read_retry(args),
    )
    if path is None:
        return
    table = open_embeddings(args.location, os.path.basename(path)[: -len(".npy")])
    print(
        f"{path}: {len(table)} x {table.dim} float16 rows by {table.header['model']}; "
        f"{table.header['missing']['count']} sample(s) without an embedding"
    )


def _import_embeddings(args) -> None:
    from prunepipe.tools.commands.embedding_import import import_embeddings

    summary = import_embeddings(
        args.location,
        args.source,
        format=args.format,
        name=args.out,
        embedding=args.embedding,
        sample_key=args.sample_key,
    )
    print(
        f"{summary['path']}: {summary['matched']} of {summary['samples']} samples joined by key; "
        f"{summary['missing']} without an embedding"
        + (f" (first keys: {', '.join(map(repr, summary['missing_first_keys']))})" if summary["missing"] else "")
        + f"; {summary['rows_matching_no_sample']} imported row(s) named no sample of this split"
    )


def _dedup(args) -> None:
    from prunepipe.tools.commands.dedup import dedup_shards, report_lines

    report = dedup_shards(
        args.location,
        args.embeddings,
        args.threshold,
        clusters=args.clusters,
        report_thresholds=args.report_thresholds,
        out=args.out,
        picture=not args.no_picture,
        spill=not args.no_spill,
        seed=args.seed,
    )
    print("\n".join(report_lines(report)))
