"""The ONNX Runtime backend: one session per graph of an artifact (embedding, each decoder layer, head).

`model` runs the sessions; `host_pages` is the latent cache's pages in host memory, bound to the graphs in place
(the native step runs over them too); `thread_pool` is the process's one intra-op pool, with the host's cores
grouped by physical core; `memory_arena` the process's one CPU arena that every session draws from.
"""
