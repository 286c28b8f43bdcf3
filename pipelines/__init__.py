"""The training side, in the order data flows (docs/design.md, "Layout"): data/ (shards -> stream ->
pre-decode pruning -> decode), tasks/ (the per-sample loss), training/ (the loop), evaluation/ (the
judges of a run), report/ (pruned against full). config.py, checkpoint.py and progress.py are shared."""
