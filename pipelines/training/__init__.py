"""The one training loop and what only it uses: metric logging and the cross-rank sync check."""
