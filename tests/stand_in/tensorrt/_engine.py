"""Stand-in for the TensorRT builder, ONNX parser and runtime as k2deploy uses them.

The parser checks that every custom node names a plugin registered through `tensorrt.plugin` and
turns the TensorRT copy of a graph back into a model ONNX Runtime runs (the plugins' ONNX function
bodies, expert bits as UINT8); the "plan" is that model plus the optimisation profiles, which the
builder checks cover every input with min <= opt <= max. An execution context checks each input
shape against its profile, reads the inputs from their "device" addresses (host memory, see
cuda/bindings/runtime.py), runs the model with ONNX Runtime and writes the outputs to theirs.
"""

import ctypes
import enum
import json
from pathlib import Path

import numpy as np

MAGIC = b"K2STANDINPLAN\n"
NUMPY = {1: np.float32, 2: np.uint8, 7: np.int64, 9: np.bool_, 10: np.float16, 16: np.uint16, 17: np.uint8}  # ONNX elem type


class Logger:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    def __init__(self, severity=WARNING):
        self.severity = severity


class NetworkDefinitionCreationFlag(enum.IntEnum):
    STRONGLY_TYPED = 1
    PREFER_AOT_PYTHON_PLUGINS = 2
    PREFER_JIT_PYTHON_PLUGINS = 3


class MemoryPoolType(enum.Enum):
    WORKSPACE = 0


class _Input:
    def __init__(self, name, rank):
        self.name, self.rank = name, rank


class _Network:
    def __init__(self, flags):
        self.flags, self.inputs, self.model = flags, [], None

    @property
    def num_inputs(self):
        return len(self.inputs)

    def get_input(self, index):
        return self.inputs[index]


class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, low, opt, high):
        if not (len(low) == len(opt) == len(high)) or any(not (a <= b <= c) for a, b, c in zip(low, opt, high)):
            raise ValueError(f"profile shape for {name}: not min <= opt <= max: {low} {opt} {high}")
        self.shapes[name] = [list(low), list(opt), list(high)]


class _Config:
    def __init__(self):
        self.profiles, self.pools = [], {}

    def set_memory_pool_limit(self, pool, size):
        self.pools[pool] = size

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)
        return len(self.profiles) - 1


class Builder:
    def __init__(self, logger):
        self.logger = logger

    def create_network(self, flags=0):
        return _Network(flags)

    def create_builder_config(self):
        return _Config()

    def create_optimization_profile(self):
        return _Profile()

    def build_serialized_network(self, network, config):
        if not network.flags & (1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED):
            raise ValueError("k2deploy builds strongly typed networks (explicit Q/DQ for FP8)")
        prefer = [f for f in (NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS,
                              NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS) if network.flags & (1 << f)]
        if len(prefer) != 1:
            raise ValueError("a network with Python plugins says which implementation it prefers (AOT or JIT)")
        for index, profile in enumerate(config.profiles):
            missing = {i.name for i in network.inputs} - set(profile.shapes)
            if missing:
                raise ValueError(f"optimisation profile {index} leaves inputs {sorted(missing)} without shapes")
            for i in network.inputs:
                if len(profile.shapes[i.name][0]) != i.rank:
                    raise ValueError(f"profile {index}: {i.name} has rank {i.rank}")
        header = json.dumps({"profiles": [p.shapes for p in config.profiles]}).encode()
        return MAGIC + len(header).to_bytes(8, "little") + header + network.model.SerializeToString()


class OnnxParser:
    def __init__(self, network, logger):
        self.network, self.errors = network, []

    @property
    def num_errors(self):
        return len(self.errors)

    def get_error(self, index):
        return self.errors[index]

    def parse_from_file(self, path):
        import onnx

        from k2deploy import plugins
        from k2deploy.core.manifest import load_manifest
        from tensorrt.plugin import REGISTRY

        model = onnx.load(path)  # with its external weights
        for node in model.graph.node:
            if node.domain and node.domain != "ai.onnx":
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                plugin = f"{attrs.get('plugin_namespace', b'').decode()}::{node.op_type}"
                if plugin not in REGISTRY:
                    self.errors.append(f"node {node.name}: no plugin {plugin} registered")
        if self.errors:
            return False
        config = load_manifest(Path(path).parents[1], verify_hashes=False).config
        model.functions.extend(plugins.onnx_functions(config) + plugins.split_functions(config))
        plugin_inputs = set()
        for node in model.graph.node:
            if node.domain == "k2deploy":
                kept = [a for a in node.attribute if a.name not in ("plugin_namespace", "plugin_version", "aot")]
                del node.attribute[:]
                node.attribute.extend(kept)
                plugin_inputs.update(node.input)
        for tensor in model.graph.initializer:
            if tensor.name in plugin_inputs and tensor.data_type == onnx.TensorProto.FLOAT8E4M3FN:
                tensor.data_type = onnx.TensorProto.UINT8  # the function bodies decode expert bits from UINT8
        for value in model.graph.output:  # ONNX Runtime hands BF16 back only as FLOAT: widen here, narrow on run
            if value.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16:
                inner = value.name + "_bf16"
                for node in model.graph.node:
                    node.output[:] = [inner if o == value.name else o for o in node.output]
                model.graph.node.append(onnx.helper.make_node("Cast", [inner], [value.name],
                                                              to=onnx.TensorProto.FLOAT))
                value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
                value.doc_string = "bf16"
        self.network.model = model
        self.network.inputs = [_Input(v.name, len(v.type.tensor_type.shape.dim)) for v in model.graph.input]
        return True


class Runtime:
    def __init__(self, logger):
        self.logger = logger

    def deserialize_cuda_engine(self, plan):
        if not bytes(plan[:len(MAGIC)]) == MAGIC:
            return None
        size = int.from_bytes(plan[len(MAGIC):len(MAGIC) + 8], "little")
        header = json.loads(plan[len(MAGIC) + 8:len(MAGIC) + 8 + size])
        return _Engine(header["profiles"], bytes(plan[len(MAGIC) + 8 + size:]))


class _Engine:
    def __init__(self, profiles, model_bytes):
        import onnx

        import tensorrt as trt

        self.profiles, self.model_bytes, self.session = profiles, model_bytes, None
        graph = onnx.load_from_string(model_bytes).graph
        types = {1: trt.float32, 2: trt.uint8, 7: trt.int64, 9: trt.bool, 10: trt.float16, 16: trt.bfloat16, 17: trt.fp8}
        self.io = {v.name: types[16 if v.doc_string == "bf16" else v.type.tensor_type.elem_type]
                   for v in [*graph.input, *graph.output]}

    @property
    def num_io_tensors(self):
        return len(self.io)

    def get_tensor_name(self, index):
        return list(self.io)[index]

    def get_tensor_dtype(self, name):
        return self.io[name]

    def create_execution_context(self):
        return _Context(self)


class _Context:
    def __init__(self, engine):
        self.engine, self.profile, self.shapes, self.addresses = engine, None, {}, {}

    def set_optimization_profile_async(self, index, stream):
        if not 0 <= index < len(self.engine.profiles):
            return False
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        low, _, high = self.engine.profiles[self.profile][name]
        if len(shape) != len(low) or any(not (a <= s <= c) for a, s, c in zip(low, shape, high)):
            return False  # as TensorRT: outside the profile
        self.shapes[name] = tuple(int(s) for s in shape)
        return True

    def set_tensor_address(self, name, address):
        if not address or int(address) % 256:
            raise ValueError(f"{name}: TensorRT wants a non-null, 256-byte aligned address, got {address:#x}")
        self.addresses[name] = int(address)
        return True

    def execute_async_v3(self, stream):
        import onnxruntime as ort

        engine = self.engine
        if engine.session is None:
            import onnx

            engine.outputs = list(onnx.load_from_string(engine.model_bytes).graph.output)
            # the process's one thread pool, as every session of a k2deploy process
            from k2deploy.runtime.backends.onnx.thread_pool import session_options

            engine.session = ort.InferenceSession(engine.model_bytes, session_options(), providers=["CPUExecutionProvider"])
        feeds = {}
        for value in engine.session.get_inputs():
            elem = _elem_type(engine.session, value.name)
            shape = self.shapes[value.name]
            array = np.empty(shape, dtype=NUMPY[elem])
            ctypes.memmove(array.ctypes.data, self.addresses[value.name], array.nbytes)
            feeds[value.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, elem) if elem in (16, 17) \
                else array
        narrowed = {v.name for v in engine.outputs if v.doc_string == "bf16"}
        for value, result in zip(engine.session.get_outputs(), engine.session.run(None, feeds)):
            if value.name in narrowed:  # float32 of a bf16 is exact: its top 16 bits are the bf16
                result = (np.asarray(result, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
            result = np.ascontiguousarray(result)
            ctypes.memmove(self.addresses[value.name], result.ctypes.data, result.nbytes)
        return True


def _elem_type(session, name):
    kind = next(v.type for v in session.get_inputs() if v.name == name)  # "tensor(float8e4m3fn)" and the like
    return {"tensor(float)": 1, "tensor(uint8)": 2, "tensor(int64)": 7, "tensor(bool)": 9, "tensor(float16)": 10,
            "tensor(bfloat16)": 16, "tensor(float8e4m3fn)": 17}[kind]
