"""`k2deploy serve`: an OpenAI-compatible HTTP server over an exported artifact, with continuous batching.

No torch: ONNX Runtime (or the TensorRT engines, `--backend tensorrt`) runs the artifact,
Starlette and uvicorn carry the HTTP. The modules: protocol.py (request checking, OpenAI
response shapes), requests.py (one request's state), scheduler.py (who runs in the next step),
engine_thread.py (the thread that runs the steps), metrics.py (Prometheus), app.py (the routes),
connections.py (a deadline for each request's headers), cli.py (the `serve` command).
"""
