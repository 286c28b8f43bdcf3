"""What the `prunepipe` subcommands run around a run: writing, indexing, embedding and deduplicating
shards, encoding latents and text features, preprocessing split over many processes."""
