"""Video dataset kinds: frames, latents and clips, with their packing and encoders."""
