"""k2deploy: compiled deployment of Kimi K2 (DeepSeek-V3 architecture) checkpoints."""

__version__ = "0.1.0"
