"""Entry points: the `prunepipe` command line and multi-node launching; nothing else."""
