"""k2deploy bench on the tiny artifacts: the result document and its schema, the files, the
per-stage breakdown, compare over two saved results, device naming, and the errors."""

import json
import re
import shutil
import subprocess
import sys

import pytest
from child_env import blocked, child_env
from decode_path import named_decode

from k2deploy.bench.compare import load_result, run_compare
from k2deploy.bench.device import describe_device, nominal_gib, slugify
from k2deploy.bench.report import RESULT_FILE, csv_rows, format_result, write_result
from k2deploy.bench.run import BenchOptions, run_bench
from k2deploy.bench.schema import SCHEMA_VERSION, validate
from k2deploy.core.errors import K2Error

pytestmark = pytest.mark.slow  # bench runs with their baselines

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("matplotlib")

FAST = dict(gen_len=3, repeats=3, warmup=1, bandwidth_bytes=8 << 20, bandwidth_repeats=3)


def bench_cli(*args, env=None) -> subprocess.CompletedProcess:
    """`k2deploy bench ...` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "k2deploy", *named_decode(["bench", *map(str, args)])],
                          capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def bench_run(tiny_artifacts, tmp_path_factory):
    """One run with the eager baseline: two batch sizes, two prompt lengths -> (document, files)."""
    doc = run_bench(BenchOptions(str(tiny_artifacts["fp8"]), batches=[1, 2], prompt_lens=[4, 12], threads=1,
                                 baseline="eager", **FAST))
    return doc, write_result(doc, tmp_path_factory.mktemp("bench") / "one-thread")


def test_result_validates_against_its_schema(bench_run):
    doc, files = bench_run
    validate(doc)
    saved = json.loads(files["json"].read_text())
    validate(saved)
    assert saved["schema_version"] == SCHEMA_VERSION
    # an fp8-cache artifact decodes through its graphs, and the result says why the native step did not run
    assert saved["decode_kernels"].startswith("onnx (native: ") and "int8 cache" in saved["decode_kernels"]
    assert json.loads(files["schema"].read_text())["$id"].endswith(f"v{SCHEMA_VERSION}.json")
    broken = json.loads(json.dumps(saved))
    del broken["cells"][0]["tpot_ms"]
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = dict(saved, schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_figures_breakdown_memory_and_bound(bench_run, tiny_artifacts):
    doc, _ = bench_run
    assert [(c["batch"], c["prompt_len"]) for c in doc["cells"]] == [(1, 4), (1, 12), (2, 4), (2, 12)]
    for cell in doc["cells"]:
        for figure in ("ttft_ms", "tpot_ms", "prefill_tokens_per_s", "stream_tokens_per_s", "batch_tokens_per_s"):
            s = cell[figure]
            assert 0 < s["p10"] <= s["median"] <= s["p90"], (figure, s)
        assert cell["tpot_ms"]["n"] == 3 and cell["ttft_ms"]["n"] == 3  # one sample per timed run
        steps = cell["decode_step_ms"]
        assert len(steps["layers"]) == 3 and steps["overhead"]["median"] >= 0
        # run by run the stages add up to the step exactly, so their means do; their medians nearly
        parts = [steps["embed"], *steps["layers"], steps["head"], steps["sampling"], steps["overhead"]]
        assert sum(p["mean"] for p in parts) == pytest.approx(steps["step"]["mean"], rel=1e-9)
        # how close the stages' medians come to the step's is the machine's noise, not a property (the exact
        # sum is the means' above): only its presence is asserted; timing ratios belong to the benchmarks
        assert cell["breakdown_sum_ratio"] > 0
        assert steps["step"] == cell["tpot_ms"]
        assert cell["batch_tokens_per_s"]["median"] == pytest.approx(cell["batch"] * cell["stream_tokens_per_s"]["median"])
        # the cache holds prompt + generated tokens for every row, in whole 64-token pages: 100 bytes per token per
        # layer in tiny's fp8 format
        pages = -(-(cell["prompt_len"] + 3) // 64)
        assert cell["kv_cache_bytes_allocated"] == cell["batch"] * pages * 64 * 3 * 100
        assert cell["bound"]["ms"] > 0 and cell["bound"]["ratio"] > 0
        base = cell["baseline"]
        assert base["tpot_ratio"] > 0 and base["ttft_ratio"] > 0 and base["tpot_ratio_paired"]["n"] == 3
    memory = doc["memory"]
    assert memory["kv_bytes_per_token"] == 300 and memory["peak_rss_bytes"] > 0
    manifest = json.loads((tiny_artifacts["fp8"] / "manifest.json").read_text())
    assert memory["weights_bytes"] == sum(r["bytes"] for f, r in manifest["files"].items() if f.startswith("graphs/"))
    assert doc["bandwidth"]["gb_per_s"]["n"] == 6 and doc["bandwidth"]["gb_per_s"]["median"] > 0
    assert doc["baseline"]["kind"] == "eager" and doc["versions"]["torch"]
    assert len(doc["artifact"]["manifest_sha256"]) == 64 and doc["device"]["kind"] == "cpu"


def test_csv_and_real_plots(bench_run):
    _, files = bench_run
    assert files["json"].parent.name == describe_device("cpu")["slug"]
    lines = files["csv"].read_text().splitlines()
    assert len(lines) == 1 + 4 and "tpot_ms_median" in lines[0] and "baseline_tpot_ratio" in lines[0]
    from matplotlib.image import imread

    for key in ("per_layer_png", "tpot_png"):
        assert files[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        pixels = imread(files[key])
        assert pixels.shape[0] > 300 and pixels.shape[1] > 500
        assert pixels[..., :3].std() > 0.05  # drawn on, not a blank canvas


def test_second_run_without_torch_and_compare(bench_run, tiny_artifacts, tmp_path):
    """A second result (2 threads, where torch cannot import: no baseline), then compare over both."""
    _, files = bench_run
    env = child_env(blocked(tmp_path, "torch"))
    second = tmp_path / "two-threads"
    run = bench_cli(tiny_artifacts["fp8"], "--batch", "1", "--prompt-len", "4,12", "--gen-len", "3", "--repeats", "2",
                    "--threads", "2", "--bandwidth-mib", "8", "--out", second, "--json", env=env)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["baseline"] is None and any("no baseline" in note for note in doc["notes"]), doc["notes"]
    validate(load_result(doc["files"]["json"]))

    first = files["json"].parent.parent
    compared = bench_cli("compare", first, second, "--out", tmp_path / "cmp")
    assert compared.returncode == 0, compared.stderr
    table = compared.stdout
    assert "1 thread " in table and "2 threads" in table and "eager" in table
    assert len(table.strip().splitlines()) == 2 + 4 + 2  # header, rule, 4 + 2 cells
    markdown = (tmp_path / "cmp" / "compare.md").read_text()
    assert markdown.startswith("| device / runs on / threads |") and markdown.count("\n") == 2 + 6
    from matplotlib.image import imread

    assert imread(tmp_path / "cmp" / "compare.png")[..., :3].std() > 0.05
    as_json = bench_cli("compare", first / describe_device("cpu")["slug"] / RESULT_FILE, second, "--json",
                        "--out", tmp_path / "cmp2")
    assert as_json.returncode == 0, as_json.stderr
    assert len(json.loads(as_json.stdout)["table"]["rows"]) == 6


def test_device_naming_without_a_gpu():
    cpuinfo = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+ CPU @ 2.00GHz\nflags\t\t: fpu\n"
    meminfo = "MemTotal:       527952252 kB\nMemFree: 1 kB\n"  # 503.5 GiB: a 512 GiB machine
    device = describe_device("cpu", cpuinfo=cpuinfo, meminfo=meminfo, cores=16)
    assert device["kind"] == "cpu" and device["gpu"] is None
    assert device["label"] == "Intel Xeon Platinum 8480+ CPU @ 2.00GHz, 16 cores, 512 GiB".replace(
        "Intel Xeon", "Intel(R) Xeon(R)")
    assert device["slug"] == "cpu-intel-xeon-platinum-8480-plus-16c-512gib"
    # another machine of the type, with a little less memory left to the kernel, names the same row
    other = describe_device("cpu", cpuinfo=cpuinfo, meminfo="MemTotal:       526000000 kB\n", cores=16)
    assert other["slug"] == device["slug"]
    arm = describe_device("cpu", cpuinfo="processor : 0\nBogoMIPS : 50\n", meminfo="", cores=1)
    assert arm["slug"].startswith("cpu-") and "1 core" in arm["label"]
    assert [nominal_gib(int(g * (1 << 30))) for g in (0.5, 7.7, 15.6, 23.4, 62.8, 125.8, 503.5)] == [1, 8, 16, 24, 64, 128, 512]
    assert slugify("AMD EPYC 7763 64-Core Processor") == "amd-epyc-7763-64-core"
    # a GPU provider where nvidia-smi sees no GPU: said so, not named after a GPU
    blind = describe_device("cuda", cpuinfo=cpuinfo, meminfo=meminfo, cores=16, nvidia_smi="")
    assert blind["kind"] == "gpu" and blind["gpu"]["name"] == "unknown GPU" and blind["slug"].startswith("gpu-unknown-")
    h200 = describe_device("cuda", cpuinfo=cpuinfo, meminfo=meminfo, cores=16, nvidia_smi="NVIDIA H200, 143771\n")
    assert h200["label"] == "NVIDIA H200, 140 GiB" and h200["slug"] == "gpu-nvidia-h200-140gib"
    here = describe_device("cpu")
    assert here["gpu"] is None and here["cpu"]["cores"] >= 1 and re.fullmatch(r"cpu(-[a-z0-9]+)+", here["slug"])


def test_missing_or_foreign_artifact_is_one_clear_line(tiny_artifacts, tmp_path):
    missing = bench_cli(tmp_path / "nowhere")
    assert missing.returncode == 2 and "not an artifact directory" in missing.stderr
    assert missing.stderr.startswith("k2deploy bench: error:") and len(missing.stderr.strip().splitlines()) == 1
    old = tmp_path / "old"
    old.mkdir()
    manifest = json.loads((tiny_artifacts["fp8"] / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps(dict(manifest, format_version=0)))
    foreign = bench_cli(old)
    assert foreign.returncode == 2 and "format version 0" in foreign.stderr and "re-export" in foreign.stderr
    assert len(foreign.stderr.strip().splitlines()) == 1
    unfinished = tmp_path / "unfinished"
    shutil.copytree(tiny_artifacts["fp8"] / "graphs", unfinished / "graphs")
    assert "no manifest.json" in bench_cli(unfinished).stderr
    bad = bench_cli(tiny_artifacts["fp8"], "--batch", "1,x")
    assert bad.returncode == 2 and "--batch '1,x'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    with pytest.raises(K2Error, match="exceeds the model's 4096 positions"):
        run_bench(BenchOptions(str(tiny_artifacts["fp8"]), prompt_lens=[4090], gen_len=8))


def test_compare_refuses_another_schema_version(bench_run, tmp_path):
    doc, _ = bench_run
    path = tmp_path / "future" / RESULT_FILE
    path.parent.mkdir()
    path.write_text(json.dumps(dict(doc, schema_version=SCHEMA_VERSION + 1)))
    with pytest.raises(K2Error, match=f"schema version {SCHEMA_VERSION + 1}"):
        run_compare([path.parent], tmp_path)
    result = bench_cli("compare", tmp_path / "empty-nothing")
    assert result.returncode == 2 and "no such file or directory" in result.stderr
    assert csv_rows(doc)[0]["device"] == doc["device"]["label"]


def test_bench_side_imports_no_torch():
    code = ("import sys; import k2deploy.commands.bench_command, k2deploy.bench.run, k2deploy.bench.report, k2deploy.bench.compare; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def test_saved_samples_match_the_schema():
    """The results shown in docs/performance.md (bench/samples/) are documents of the current schema version."""
    from pathlib import Path

    import k2deploy.bench

    samples = sorted((Path(k2deploy.bench.__file__).parent / "samples").rglob("bench.json"))
    assert samples
    for path in samples:
        validate(load_result(path))


def test_registered_in_the_main_command_line():
    from cli_runner import run_cli

    result = run_cli("bench", "--help")
    if result.returncode != 0 and "invalid choice" in result.stderr:
        pytest.skip("`bench` is not registered in k2deploy's parser yet (core/cli.py: add_bench_parser(sub))")
    assert result.returncode == 0 and "k2deploy bench compare DIR" in result.stdout


def test_without_the_checkpoint_it_says_so_and_runs_without_the_baseline(tiny_artifacts, tmp_path):
    moved = tmp_path / "art"
    shutil.copytree(tiny_artifacts["fp8"], moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["checkpoint"]["path"] = str(tmp_path / "deleted-checkpoint")
    (moved / "manifest.json").write_text(json.dumps(manifest))
    doc = run_bench(BenchOptions(str(moved), batches=[1], prompt_lens=[4], **FAST))  # the default: eager if it can
    validate(doc)
    assert doc["baseline"] is None and doc["cells"][0]["baseline"] is None
    assert any("deleted-checkpoint" in note and "is gone" in note for note in doc["notes"]), doc["notes"]
    with pytest.raises(K2Error, match="--baseline eager: the checkpoint .* is gone"):  # asked for by name: an error
        run_bench(BenchOptions(str(moved), batches=[1], prompt_lens=[4], baseline="eager", **FAST))


def test_a_native_decode_step_is_one_stage_of_the_breakdown(tiny_cpu_artifact, tmp_path):
    """The native step runs the embedding and every layer in one call: the breakdown gives it as one stage (the
    layers' own entries 0), the stages still add up to the step, and the report and table name it."""
    doc = run_bench(BenchOptions(str(tiny_cpu_artifact), batches=[1], prompt_lens=[4], threads=1, baseline="none",
                                 decode="native", **FAST))
    validate(doc)
    assert doc["speculative"] == "auto" and doc["cells"][0]["speculative"]["forward_steps"] > 0
    steps = doc["cells"][0]["decode_step_ms"]
    assert steps["native_step"]["median"] > 0 and all(layer["median"] == 0 for layer in steps["layers"])
    parts = [steps["embed"], *steps["layers"], steps["native_step"], steps["head"], steps["sampling"], steps["overhead"]]
    assert sum(p["mean"] for p in parts) == pytest.approx(steps["step"]["mean"], rel=1e-9)
    assert "native step (embedding and layers in one call)" in format_result(doc)
    assert csv_rows(doc)[0]["native_step_ms_median"] == steps["native_step"]["median"]
    assert write_result(doc, tmp_path)["per_layer_png"].is_file()  # with the native step's bars
