"""The candidates for the cpu lowering, measured side by side on ONNX Runtime's CPU provider.

    . .venv/bin/activate && python benchmarks/cpu_kernels.py [--threads 1] [--json]

Each candidate is one small ONNX graph timed alone (median of --repeats runs after one warm-up),
at the `small` preset's dimensions by default (hidden 1024, dense MLP 2816, 64 experts of width
256, top-8, vocab 32768, latent 512) and at batch 1 (decode) and --prefill rows:

  linear     y = x W^T, W [2816, 1024]: float32 MatMul (what ONNX Runtime's constant folding makes of
             the exact graph's Cast + Mul of FP8 initializers) against com.microsoft MatMulNBits with
             8-bit blocks of 32 or 128 along the input dim, accuracy_level 0 (float activations) or 4
             (int8 activations); also the head, [32768, 1024].
  experts    k of e routed experts' SwiGLU for one token: the exact graph's body (a 256-entry table
             Gather turning the chosen experts' e4m3 bits into float32, block scales, MatMul) against
             com.microsoft QMoE with 8-bit experts (block 32 and 128), and QMoE's FP8 mode.
  cache      widening the latent cache of T tokens to float32: Cast of e4m3, DequantizeLinear of e4m3
             with its block scales, Cast of int8.
  attention  one decode step's two products over an int8 cache of T tokens with 16 heads, in float32
             after widening the codes, or in integer arithmetic (MatMulInteger): the scores with the queries as
             int8 (uint8 x int8, whose sums saturate on x86 CPUs without VNNI) or as bytes q + 128 (uint8 x
             uint8, exact everywhere, as the cpu target runs them).

Errors are against float32 numpy on the same (re-quantised) weights, relative to the largest output.
A candidate ONNX Runtime cannot run here is listed with its error message.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from k2deploy.bench.device import cpu_model
from k2deploy.plugins.fp8 import E4M3_VALUES
from k2deploy.plugins.int8 import quantize_rows

FP8_BLOCK = 128


def session(nodes, inputs, initializers, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "candidate", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def timed(run, repeats: int) -> float:
    run()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return float(np.median(samples) * 1e3)


def fp8_weight(rng, shape) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 bits [..., rows, cols] and 128x128 block scales, like a checkpoint's."""
    bits = (rng.standard_normal(shape) * 100).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    blocks = (*shape[:-2], -(-shape[-2] // FP8_BLOCK), -(-shape[-1] // FP8_BLOCK))
    return bits, (rng.random(blocks) * 1e-4 + 1e-4).astype(np.float32)


def dequantized(bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    rows, cols = bits.shape[-2:]
    expanded = np.repeat(np.repeat(scale, FP8_BLOCK, -2)[..., :rows, :], FP8_BLOCK, -1)[..., :cols]
    return E4M3_VALUES[bits] * expanded


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(got.reshape(expected.shape) - expected).max() / np.abs(expected).max())


def linear_candidates(rng, rows: int, cols: int, batches: list[int], threads: int, repeats: int) -> list[dict]:
    weight = dequantized(*fp8_weight(rng, (rows, cols)))
    x_input = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", cols])
    candidates = {"float32 MatMul": session([helper.make_node("MatMul", ["x", "w"], ["y"])], [x_input],
                                            [numpy_helper.from_array(weight.T.copy(), "w")], threads)}
    for block in (32, 128):
        codes, scales = quantize_rows(weight, block)
        for level in (0, 4):
            node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=cols, N=rows, bits=8,
                                    block_size=block, accuracy_level=level)
            candidates[f"MatMulNBits 8-bit block {block} accuracy {level}"] = session(
                [node], [x_input], [numpy_helper.from_array(codes, "b"), numpy_helper.from_array(scales, "s")], threads)
    results = []
    for name, runner in candidates.items():
        row = {"op": f"linear [{rows}, {cols}]", "candidate": name}
        for batch in batches:
            x = rng.standard_normal((batch, cols)).astype(np.float32)
            row[f"ms_{batch}"] = timed(lambda: runner.run(None, {"x": x}), repeats)
            if batch == 1:
                row["error"] = relative_error(runner.run(None, {"x": x})[0], x @ weight.T)
        results.append(row)
    return results


def experts_candidates(rng, e: int, f: int, m: int, k: int, batches: list[int], threads: int, repeats: int) -> list[dict]:
    gate, up, down = fp8_weight(rng, (e, f, m)), fp8_weight(rng, (e, f, m)), fp8_weight(rng, (e, m, f))
    gate_f, up_f, down_f = (dequantized(*w) for w in (gate, up, down))
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", width])
              for name, width in (("x", m), ("chosen", e), ("mixing", e))]
    qmoe_inputs = ["x", "chosen", "fc1", "fc1_s", "", "fc2", "fc2_s", "", "", "", "", "", "", "", "mixing"]
    swiglu = dict(k=k, activation_type="swiglu", activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=0)
    candidates = {}
    for block in (32, 128):
        fc1 = [quantize_rows(np.stack([g, u], 1).reshape(2 * f, m), block) for g, u in zip(gate_f, up_f)]
        fc2 = [quantize_rows(d, block) for d in down_f]
        weights = {"fc1": np.stack([c for c, _ in fc1]).reshape(e, 2 * f, m), "fc1_s": np.stack([s for _, s in fc1]),
                   "fc2": np.stack([c for c, _ in fc2]).reshape(e, m, f), "fc2_s": np.stack([s for _, s in fc2])}
        node = helper.make_node("QMoE", qmoe_inputs, ["y"], domain="com.microsoft", swiglu_fusion=1, expert_weight_bits=8,
                                block_size=block, accuracy_level=4, quant_type="int", **swiglu)
        candidates[f"QMoE int8 block {block}"] = lambda node=node, weights=weights: session(
            [node], inputs, [numpy_helper.from_array(v, n) for n, v in weights.items()], threads)
    fp8_inputs = ["x", "chosen", "g", "g_s", "", "d", "d_s", "", "u", "u_s", "", "", "", "", "mixing"]
    fp8_node = helper.make_node("QMoE", fp8_inputs, ["y"], domain="com.microsoft", swiglu_fusion=0, expert_weight_bits=8,
                                block_size=FP8_BLOCK, quant_type="fp8", **swiglu)

    def fp8_tensor(name, bits):
        return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, bits.shape, bits.tobytes(), raw=True)

    candidates["QMoE fp8 block 128"] = lambda: session(
        [fp8_node], inputs, [fp8_tensor("g", gate[0]), numpy_helper.from_array(gate[1], "g_s"), fp8_tensor("u", up[0]),
                             numpy_helper.from_array(up[1], "u_s"), fp8_tensor("d", down[0]),
                             numpy_helper.from_array(down[1], "d_s")], threads)
    candidates["table Gather + MatMul (the exact graph's decode body)"] = lambda: _gathered_experts(
        gate, up, down, k, threads)
    results = []
    for name, make in candidates.items():
        row = {"op": f"experts {k} of {e} [{f}, {m}]", "candidate": name}
        try:
            runner = make()
        except Exception as error:  # a candidate ONNX Runtime does not implement on this provider
            row["unavailable"] = str(error).splitlines()[0][:160]
            results.append(row)
            continue
        for batch in batches[:1] if name.startswith("table") else batches:  # a decode body: at 128 rows it
            x = rng.standard_normal((batch, m)).astype(np.float32)                   # would hold 1 GB of floats
            ids = np.stack([rng.choice(e, k, replace=False) for _ in range(batch)])
            route = rng.random((batch, k)).astype(np.float32)
            chosen, mixing = np.zeros((batch, e), np.float32), np.zeros((batch, e), np.float32)
            np.put_along_axis(chosen, ids, 1.0, 1)
            np.put_along_axis(mixing, ids, route, 1)
            feeds = {"x": x, "chosen": chosen, "mixing": mixing}
            row[f"ms_{batch}"] = timed(lambda: runner.run(None, feeds), repeats)
            if batch == 1:
                expected = sum(w * (down_f[i] @ (_silu(gate_f[i] @ x[0]) * (up_f[i] @ x[0])))
                               for i, w in zip(ids[0], route[0]))
                row["error"] = relative_error(runner.run(None, feeds)[0], expected[None])
        results.append(row)
    return results


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (1 + np.exp(-v))


def _gathered_experts(gate, up, down, k: int, threads: int) -> ort.InferenceSession:
    """The exact graph's decode body: the chosen experts' bits gathered, decoded through a 256-entry table."""
    e = gate[0].shape[0]
    table = numpy_helper.from_array(E4M3_VALUES, "table")
    nodes = [helper.make_node("TopK", ["chosen", "k"], ["top", "ids"], axis=-1),
             helper.make_node("GatherElements", ["mixing", "ids"], ["route"], axis=1)]
    initializers = [table, numpy_helper.from_array(np.array([k]), "k")]

    def times(name: str, bits, scale, vector: str) -> str:
        rows, cols = bits.shape[1:]
        initializers.extend([numpy_helper.from_array(bits, f"{name}_bits"),
                             numpy_helper.from_array(np.repeat(np.repeat(scale, FP8_BLOCK, 1)[:, :rows], FP8_BLOCK, 2)
                                                     [:, :, :cols].copy(), f"{name}_scale")])
        nodes.extend([
            helper.make_node("Gather", [f"{name}_bits", "ids"], [f"{name}_g"], axis=0),
            helper.make_node("Cast", [f"{name}_g"], [f"{name}_i"], to=TensorProto.INT32),
            helper.make_node("Gather", ["table", f"{name}_i"], [f"{name}_v"], axis=0),
            helper.make_node("Gather", [f"{name}_scale", "ids"], [f"{name}_sg"], axis=0),
            helper.make_node("Mul", [f"{name}_v", f"{name}_sg"], [f"{name}_w"]),  # [n, k, rows, cols]
            helper.make_node("MatMul", [f"{name}_w", vector], [f"{name}_out"]),  # [n, k, rows, 1]
        ])
        return f"{name}_out"

    nodes.append(helper.make_node("Unsqueeze", ["x", "axes12"], ["x_col"]))  # [n, 1, m, 1]
    initializers.append(numpy_helper.from_array(np.array([1, 3]), "axes12"))
    g, u = times("gate", *gate, "x_col"), times("up", *up, "x_col")
    nodes += [helper.make_node("Sigmoid", [g], ["sig"]), helper.make_node("Mul", [g, "sig"], ["silu"]),
              helper.make_node("Mul", ["silu", u], ["hidden"])]  # [n, k, f, 1]
    d = times("down", *down, "hidden")  # [n, k, m, 1]
    nodes += [helper.make_node("Squeeze", [d, "axis3"], ["per_expert"]),
              helper.make_node("Unsqueeze", ["route", "axis2"], ["route3"]),
              helper.make_node("Mul", ["per_expert", "route3"], ["weighted"]),
              helper.make_node("ReduceSum", ["weighted", "axis1"], ["y"], keepdims=0)]
    initializers += [numpy_helper.from_array(np.array([a]), f"axis{a}") for a in (1, 2, 3)]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", width])
              for name, width in (("x", gate[0].shape[2]), ("chosen", e), ("mixing", e))]
    return session(nodes, inputs, initializers, threads)


def cache_candidates(rng, contexts: list[int], latent: int, threads: int, repeats: int) -> list[dict]:
    results = []
    for context in contexts:
        bits = rng.integers(0, 0x7E, (context, latent)).astype(np.uint8)
        fp8 = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.FLOAT8E4M3FN)
        scale = rng.random((context, latent // 128)).astype(np.float32)
        codes = rng.integers(-127, 128, (context, latent)).astype(np.int8)
        cases = {
            "Cast e4m3 -> float32": ([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
                                     [("x", TensorProto.FLOAT8E4M3FN, fp8)]),
            "DequantizeLinear e4m3 with block scales": (
                [helper.make_node("DequantizeLinear", ["x", "s"], ["y"], axis=1, block_size=128)],
                [("x", TensorProto.FLOAT8E4M3FN, fp8), ("s", TensorProto.FLOAT, scale)]),
            "Cast int8 -> float32": ([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)],
                                     [("x", TensorProto.INT8, codes)]),
        }
        for name, (nodes, feeds) in cases.items():
            runner = session(nodes, [helper.make_tensor_value_info(n, t, None) for n, t, _ in feeds], [], threads)
            binding = runner.io_binding()
            for n, _, value in feeds:
                (binding.bind_ortvalue_input if isinstance(value, ort.OrtValue) else binding.bind_cpu_input)(n, value)
            binding.bind_output("y")
            results.append({"op": f"widen cache [{context}, {latent}]", "candidate": name,
                            "ms_1": timed(lambda: runner.run_with_iobinding(binding), repeats)})
    return results


def attention_candidates(rng, contexts: list[int], heads: int, latent: int, threads: int, repeats: int) -> list[dict]:
    """One decode step's two products over an int8 cache of T tokens (codes stored as q + 128): the scores (the
    heads' absorbed queries against every cached latent) and the values (their probabilities times the latent),
    in float32 after widening the codes, or in integer arithmetic as MlaAttentionInt8Cache runs them."""
    results = []
    for context in contexts:
        zero = numpy_helper.from_array(np.array(128, np.uint8), "zero")
        typed = lambda name, dtype, shape: helper.make_tensor_value_info(name, dtype, shape)  # noqa: E731
        widened = [helper.make_node("Cast", ["codes"], ["shifted"], to=TensorProto.FLOAT),
                   helper.make_node("Sub", ["shifted", "zero_f"], ["wide"])]
        zero_f = numpy_helper.from_array(np.array(128.0, np.float32), "zero_f")
        cases = {
            "scores, float32 (widen + FusedMatMul transB)": (
                widened + [helper.make_node("FusedMatMul", ["a", "wide"], ["y"], domain="com.microsoft", transB=1)],
                ("a", TensorProto.FLOAT, (heads, latent)), [zero_f]),
            "scores, int8 (MatMulInteger, uint8 x int8 queries)": (
                [helper.make_node("MatMulInteger", ["codes", "a", "zero"], ["y32"]),
                 helper.make_node("Transpose", ["y32"], ["y32t"], perm=[1, 0]),
                 helper.make_node("Cast", ["y32t"], ["y"], to=TensorProto.FLOAT)],
                ("a", TensorProto.INT8, (latent, heads)), [zero]),
            "scores, int8 (MatMulInteger, uint8 x uint8 queries)": (
                [helper.make_node("MatMulInteger", ["codes", "a", "zero", "zero"], ["y32"]),
                 helper.make_node("Transpose", ["y32"], ["y32t"], perm=[1, 0]),
                 helper.make_node("Cast", ["y32t"], ["y"], to=TensorProto.FLOAT)],
                ("a", TensorProto.UINT8, (latent, heads)), [zero]),
            "values, float32 (widen + MatMul)": (
                widened + [helper.make_node("MatMul", ["a", "wide"], ["y"])],
                ("a", TensorProto.FLOAT, (heads, context)), [zero_f]),
            "values, int8 (MatMulInteger, uint8 probabilities)": (
                [helper.make_node("MatMulInteger", ["a", "codes", "", "zero"], ["y32"]),
                 helper.make_node("Cast", ["y32"], ["y"], to=TensorProto.FLOAT)],
                ("a", TensorProto.UINT8, (heads, context)), [zero]),
        }
        codes = rng.integers(1, 256, (context, latent)).astype(np.uint8)
        arrays = {TensorProto.FLOAT: lambda shape: rng.random(shape).astype(np.float32),
                  TensorProto.INT8: lambda shape: rng.integers(-127, 128, shape).astype(np.int8),
                  TensorProto.UINT8: lambda shape: rng.integers(0, 256, shape).astype(np.uint8)}
        for name, (nodes, (a_name, a_type, a_shape), constants) in cases.items():
            runner = session(nodes, [typed(a_name, a_type, list(a_shape)),
                                     typed("codes", TensorProto.UINT8, [context, latent])], constants, threads)
            feeds = {"a": arrays[a_type](a_shape), "codes": codes}
            results.append({"op": f"attention {heads} heads, T={context}", "candidate": name,
                            "ms_1": timed(lambda: runner.run(None, feeds), repeats)})
    return results


def print_table(report: dict) -> None:
    setup = report["setup"]
    print(f"cpu lowering candidates: {setup['cpu']}, {setup['threads']} thread(s), onnxruntime {setup['onnxruntime']}; "
          f"median of {setup['repeats']} runs; error relative to the largest output")
    columns = [f"ms_{b}" for b in setup["batches"]]
    print(f"{'op':<28} {'candidate':<48}" + "".join(f"{'ms @ ' + c[3:] + ' rows':>14}" for c in columns)
          + f"{'error':>9}")
    for row in report["results"]:
        if "unavailable" in row:
            print(f"{row['op']:<28} {row['candidate']:<48} not available here: {row['unavailable']}")
            continue
        cells = "".join(f"{row[c]:>14.3f}" if c in row else f"{'':>14}" for c in columns)
        error = f"{row['error']:>9.4f}" if "error" in row else ""
        print(f"{row['op']:<28} {row['candidate']:<48}{cells}{error}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per candidate and size (default 30)")
    parser.add_argument("--prefill", type=int, default=128, help="rows of the prefill-sized runs (default 128)")
    parser.add_argument("--contexts", default="128,2048", help="cache lengths to widen (default 128,2048)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    batches = [1, args.prefill]
    results = (linear_candidates(rng, 2816, 1024, batches, args.threads, args.repeats)
               + linear_candidates(rng, 32768, 1024, [1], args.threads, args.repeats)
               + experts_candidates(rng, 64, 256, 1024, 8, batches, args.threads, args.repeats)
               + cache_candidates(rng, [int(c) for c in args.contexts.split(",")], 512, args.threads, args.repeats)
               + attention_candidates(rng, [int(c) for c in args.contexts.split(",")], 16, 512, args.threads,
                                      args.repeats))
    report = {"setup": {"cpu": cpu_model(), "threads": args.threads, "repeats": args.repeats, "batches": batches,
                        "onnxruntime": ort.__version__, "onnx": onnx.__version__, "python": platform.python_version()},
              "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
