"""Benchmarks, each printing ratios measured side by side in one run: lossless/ (pruned against full
runs), stream.py (skipped against decoded samples), pruners.py (pruner call overhead)."""
