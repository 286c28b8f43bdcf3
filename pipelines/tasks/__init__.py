"""What is trained: the MAE and latent-diffusion tasks (model, per-sample loss, held-out metric,
export), the per-sample randomness they draw from, and the factory that picks one from a config.
Knows batches, not shards; never imports the loop or the evaluators."""
