"""The custom ops as TensorRT plugins.

- `descriptors`: what each plugin is, as plain Python: its inputs, outputs and attributes
  and the shape and dtype functions over shape tuples. No TensorRT; the graph rewrite and the
  tests use it.
- `registration`: thin `tensorrt.plugin` (quickly deployable plugin) registrations that call
  the descriptors, with the GPU implementations (the Triton kernels, launched from Python) and
  the ahead-of-time Triton-to-PTX implementations. Imported only where TensorRT is installed.
"""

from .descriptors import DOMAIN_OP_PLUGINS, NAMESPACE, PLUGINS, VERSION, PluginSpec, TensorSpec, output_specs

__all__ = ["DOMAIN_OP_PLUGINS", "NAMESPACE", "PLUGINS", "VERSION", "PluginSpec", "TensorSpec", "output_specs"]
