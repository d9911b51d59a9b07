"""What TensorRT's engines are built and run against, read by both export (`build-engines`) and the runtime's
TensorRT backend; nothing here imports TensorRT at import time.

- `environment`: TensorRT and the GPU found (and one line saying what to install when TensorRT is missing), a
  GPU's engine folder named.
- `engine_record`: the engine record, ART/engines/<gpu>/engines.json, written with the engines and checked
  before they load.
"""
