"""Programs around a run: commands/ (what the `prunepipe` subcommands run: shards, embeddings, dedup,
latents), fixtures/ (small real things the tests and the demo build), benchmarks/ (measurements side by
side, the cluster rehearsal, the GPU checks' report)."""
