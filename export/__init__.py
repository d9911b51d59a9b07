"""The offline side: the eager PyTorch reference of Kimi K2 and, from it, per-layer graph export."""
