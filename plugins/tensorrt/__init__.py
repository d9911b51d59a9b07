"""The custom ops as TensorRT plugins: what is generic over the op declarations (plugins/op_spec.py).

- `descriptors`: what each plugin is, as plain Python, read off its op's declaration: its inputs,
  outputs and attributes and its shape and dtype function over shape tuples. No TensorRT; the graph
  rewrite and the tests use it.
- `registration`: the `tensorrt.plugin` (quickly deployable plugin) registrations, one loop over
  the descriptors, with the GPU implementations (each op's Triton function, launched from Python)
  and the ahead-of-time Triton-to-PTX implementations. Imported only where TensorRT is installed.
- `aot`: each plugin's ahead-of-time kernel launch and its compilation to PTX (imports triton).
"""

from ..op_spec import TensorSpec
from .descriptors import DOMAIN_OP_PLUGINS, NAMESPACE, PLUGINS, VERSION, PluginSpec, output_specs

__all__ = ["DOMAIN_OP_PLUGINS", "NAMESPACE", "PLUGINS", "VERSION", "PluginSpec", "TensorSpec", "output_specs"]
