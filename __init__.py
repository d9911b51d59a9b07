"""k2deploy: compiled deployment of Kimi K2 (DeepSeek-V3 architecture) checkpoints.

The repository root is the package: each top-level folder is a subpackage (`core/` is `k2deploy.core`,
`export/` is `k2deploy.export`, ...), and every import inside names the file it means by its path.
"""

__version__ = "0.1.0"
