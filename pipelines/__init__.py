"""The training side: shard streaming, the MAE and latent-diffusion tasks, the one training loop,
checkpoints and evaluators."""
