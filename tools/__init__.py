"""Programs around a run: write and index shards, encode latents, benchmarks."""
