"""The one checkpoint format: where a run is (position.py), the manifest that proves a checkpoint
intact (manifest.py), and saving, choosing and reading checkpoints on disk (store.py). Imports
nothing else of the project but pruning's packed bitmaps."""
