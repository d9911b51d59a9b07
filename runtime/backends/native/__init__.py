"""The native CPU step backend: a cpu-target artifact's decoder layers and head through one C library, in place of
the layer graphs.

`decode_step.c` (over `isa.h`'s vectors) is the step; `build` compiles it once per instruction-set level and loads
it; `decoder` maps the artifact's tiles (`mapped_file`) and runs the step on the cores this process leases
(`core_leases`); `model` is the backend behind the runtime interface; `choice` decides, per artifact and host,
whether the native step or ONNX Runtime's graphs run a model. The cache's host pages and the thread pool are the
ONNX backend's (`onnx/host_pages.py`, `onnx/thread_pool.py`): both backends run over the same pages and cores.
"""
