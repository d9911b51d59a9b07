"""Stand-in for `tensorrt.plugin` (quickly deployable plugins), as TensorRT documents it: the
decorators record each plugin's functions and check their signatures the way TensorRT does when
it registers them (annotations are classes; TensorDesc inputs first, then attributes of serialisable
types; impl, aot_impl and autotune take the registered inputs, a subset of the attributes in order,
then their trailing arguments; an aot_impl declares its 4-tuple return). Shape expressions are ints
or named symbols with the documented `is_fake`, `is_constant`, `constant_value()` and `*`."""

import inspect
import typing

import tensorrt as trt

REGISTRY: dict[str, dict] = {}
ATTRIBUTE_TYPES = (int, float, str, bool, bytes)


class ShapeExpr:
    def __init__(self, value):
        self.value = value  # an int (a build-time constant) or a str (a symbolic dimension)

    is_fake = False

    @property
    def is_constant(self) -> bool:
        return isinstance(self.value, int)

    def constant_value(self) -> int:
        if not self.is_constant:
            raise RuntimeError("Not accessible for non-constant shape expressions")
        return self.value

    def __mul__(self, other):
        other = other.value if isinstance(other, ShapeExpr) else other
        if isinstance(self.value, int) and isinstance(other, int):
            return ShapeExpr(self.value * other)
        return ShapeExpr(f"{self.value}*{other}")

    def __eq__(self, other):  # TensorRT builds a symbolic expression here, never a bool
        raise TypeError("== on a ShapeExpr builds a symbolic expression, not a bool")

    __hash__ = object.__hash__

    def __repr__(self):
        return f"ShapeExpr[{self.value}]"


class TensorDesc:
    def __init__(self, shape_expr=(), dtype=None):
        self.shape_expr = [e if isinstance(e, ShapeExpr) else ShapeExpr(e) for e in shape_expr]
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape_expr)


class Tensor:
    pass


def from_shape_expr(shape_expr, dtype):
    return TensorDesc(tuple(shape_expr), dtype)


class AutoTuneCombination:
    def __init__(self, io_types=None, layouts=None, tactics=None):
        self.io_types = io_types.split(",")
        known = {d.value for d in trt.DataType} | {d.name for d in trt.DataType}
        if any(t not in known for t in self.io_types):
            raise ValueError(f"unknown type names in {io_types!r}")


class KernelLaunchParams:
    def __init__(self):
        self.grid_x = self.grid_y = self.grid_z = self.block_x = self.block_y = self.block_z = 1
        self.shared_mem = 0


class SymInt32:
    def __init__(self, value):
        if not isinstance(value, (int, ShapeExpr)):
            raise TypeError(f"SymInt32 of a {type(value).__name__}")
        self.value = value


class SymIntExprs(list):
    @classmethod
    def from_tuple(cls, exprs):
        return cls(exprs)


def _is_class(annotation, cls) -> bool:
    return inspect.isclass(annotation) and issubclass(annotation, cls)


def register(plugin_id: str):
    def decorate(fn):
        if plugin_id in REGISTRY:
            raise ValueError(f"plugin {plugin_id} registered twice")
        signature = inspect.signature(fn)
        inputs, attributes = [], {}
        for name, parameter in signature.parameters.items():
            annotation = parameter.annotation
            if annotation is inspect.Parameter.empty:
                raise ValueError(f"{plugin_id}: argument {name} has no type annotation")
            if _is_class(annotation, TensorDesc):
                if attributes:
                    raise ValueError(f"{plugin_id}: TensorDesc {name} after an attribute")
                inputs.append(name)
            elif annotation in ATTRIBUTE_TYPES:
                attributes[name] = annotation
            else:
                raise ValueError(f"{plugin_id}: attribute {name} of type {annotation!r} is not serialisable")
        returned = signature.return_annotation
        outputs = typing.get_args(returned) if typing.get_origin(returned) is tuple else (returned,)
        if not all(_is_class(o, TensorDesc) for o in outputs):
            raise ValueError(f"{plugin_id}: returns {returned!r}, not TensorDesc or Tuple[TensorDesc, ...]")
        REGISTRY[plugin_id] = {"register": fn, "inputs": inputs, "attributes": attributes,
                               "num_outputs": len(outputs)}
        return fn
    return decorate


def _attach(kind: str, trailing: tuple):
    def wrapper(plugin_id: str):
        def decorate(fn):
            entry = REGISTRY[plugin_id]  # KeyError: TensorRT too wants register first
            signature = inspect.signature(fn)
            names = list(signature.parameters)
            used = [n for n in entry["attributes"] if n in names]
            for n in used:
                annotation = signature.parameters[n].annotation
                if annotation is not inspect.Parameter.empty and annotation != entry["attributes"][n]:
                    raise ValueError(f"{kind} of {plugin_id}: attribute {n} annotated {annotation!r}")
            if not any(names == entry["inputs"] + used + list(t) for t in trailing):
                raise ValueError(f"{kind} of {plugin_id}: parameters {names}, expected the inputs "
                                 f"{entry['inputs']}, attributes in their order, then one of {trailing}")
            if kind == "aot_impl":
                args = typing.get_args(signature.return_annotation)
                if len(args) != 4 or not _is_class(args[2], KernelLaunchParams) or not _is_class(args[3], SymIntExprs):
                    raise ValueError(f"aot_impl of {plugin_id}: return annotation {signature.return_annotation!r} is "
                                     "not Tuple[str | bytes, str | bytes, KernelLaunchParams, SymIntExprs]")
            entry[kind] = fn
            return fn
        return decorate
    return wrapper


impl = _attach("impl", (("outputs", "stream"), ("outputs", "stream", "tactic")))
aot_impl = _attach("aot_impl", (("outputs", "tactic"),))
autotune = _attach("autotune", (("outputs",),))
