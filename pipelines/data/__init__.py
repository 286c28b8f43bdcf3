"""Shards to batches: index.json and the tar reader, the pass layout, the pre-decode stream, decoding.
Imports only pruning's frozen plan; never a task, a model or the loop."""
