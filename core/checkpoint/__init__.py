"""Hugging Face Kimi K2 checkpoints: the tensor layout, FP8 blocks, a lazy reader and a synthetic writer."""
