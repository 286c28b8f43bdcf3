"""Latent diffusion: the `ldm:` settings (config.py), the task (task.py) over a UNet, a DiT or a text-
conditional PixArt DiT, the flow objective, the one sampling loop, and the export as a diffusers pipeline
folder (export.py) with what samples it (from_export.py)."""
