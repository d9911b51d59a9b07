"""`k2deploy serve`: an OpenAI-compatible HTTP server over an exported artifact, with continuous batching.

No torch: ONNX Runtime (or the TensorRT engines, `--backend tensorrt`) runs the artifact,
Starlette and uvicorn carry the HTTP. The modules: protocol.py (request checking, OpenAI
response shapes), engine_thread.py (the thread that runs the steps of runtime/engine/, sized by its one
configuration, runtime/engine/config.py), metrics.py (Prometheus), app.py (the routes), connections.py (a
deadline for each request's headers); the `serve` command is commands/serve_command.py.
"""
