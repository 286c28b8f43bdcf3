"""Judges of a trained run: reconstruction and linear probe (MAE), held-out denoising loss and FID
(diffusion), run on a checkpoint or from the loop. Never trains; never imports the loop."""
