"""One intra-op thread pool per process: a model of many graphs holds `threads` pool threads, not a pool per graph."""

import json
import subprocess
import sys

import pytest

from k2deploy.core.errors import K2Error
from k2deploy.runtime.backends.onnx import thread_pool

# A fresh process: loads the artifact on a pool of N threads, runs a prefill and a decode step, and says how many
# threads it held before loading and after running, and the pool size the model reports.
_COUNT_THREADS = """
import json, sys
import numpy as np

def held():
    return int(open("/proc/self/status").read().split("Threads:")[1].split()[0])

before = held()
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.backends.onnx.model import OrtModel
from k2deploy.runtime.engine.sampling import SamplingParams

model = OrtModel(load_manifest(sys.argv[1]), threads=int(sys.argv[2]))
Generator(model).generate([[5, 17, 300, 42]], SamplingParams(max_new_tokens=2))
print(json.dumps({"before": before, "after": held(), "pool": model.threads,
                  "graphs": 2 + len(model.layer_sessions)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_model_of_many_graphs_holds_one_pool_of_the_threads_asked_for(tiny_artifacts):
    threads = 3
    out = subprocess.run([sys.executable, "-c", _COUNT_THREADS, str(tiny_artifacts["fp8"]), str(threads)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    held = json.loads(out.stdout)
    assert held["pool"] == threads
    # the pool's workers are threads - 1 (the calling thread is the last); a pool per graph would add that many
    # for each of the graphs (5 here), and onnxruntime's own helper threads are few
    assert held["after"] - held["before"] <= threads - 1 + 2, held


def test_the_pool_is_made_once_and_a_request_for_another_size_says_so(monkeypatch):
    made = []
    monkeypatch.setattr(thread_pool, "_pool_threads", None)
    monkeypatch.setattr(thread_pool.ort, "set_global_thread_pool_sizes", lambda intra, inter: made.append((intra, inter)))
    assert thread_pool.process_threads(3) == 3
    assert thread_pool.process_threads() == 3  # no size asked: the pool there is
    assert thread_pool.process_threads(3) == 3
    assert made == [(3, 1)]
    with pytest.raises(K2Error, match="already runs its models on a pool of 3 threads"):
        thread_pool.process_threads(2)
    options = thread_pool.session_options()
    assert options.use_per_session_threads is False


def test_without_a_size_the_pool_has_the_hosts_physical_cores_shared_among_its_stages(monkeypatch):
    made = []
    monkeypatch.setattr(thread_pool, "_pool_threads", None)
    monkeypatch.setattr(thread_pool.ort, "set_global_thread_pool_sizes", lambda intra, inter: made.append(intra))
    monkeypatch.setattr(thread_pool, "physical_cores", lambda: 8)
    assert thread_pool.default_threads() == 8
    assert thread_pool.default_threads(share=3) == 2
    assert thread_pool.default_threads(share=16) == 1
    assert thread_pool.process_threads(share=2) == 4
    assert made == [4]


@pytest.mark.parametrize("threads", [0, thread_pool.MAX_THREADS + 1])
def test_zero_or_absurdly_many_threads_are_refused_in_one_line(monkeypatch, threads):
    monkeypatch.setattr(thread_pool, "_pool_threads", None)
    with pytest.raises(K2Error, match=f"--threads {threads}: give 1 to {thread_pool.MAX_THREADS}"):
        thread_pool.process_threads(threads)


def test_physical_cores_counts_a_core_once(monkeypatch, tmp_path):
    # two CPUs that are hyperthreads of one core, and a third on another core
    topology = {0: ("0", "0"), 1: ("0", "0"), 2: ("0", "1")}
    monkeypatch.setattr(thread_pool.os, "sched_getaffinity", lambda pid: set(topology))
    real_path = thread_pool.Path

    def fake_path(text):
        for cpu, (package, core) in topology.items():
            folder = tmp_path / f"cpu{cpu}"
            folder.mkdir(exist_ok=True)
            (folder / "physical_package_id").write_text(package)
            (folder / "core_id").write_text(core)
        return real_path(str(text).replace("/sys/devices/system/cpu", str(tmp_path)).replace("/topology", ""))

    monkeypatch.setattr(thread_pool, "Path", fake_path)
    assert thread_pool.physical_cores() == 2


def test_stages_on_one_host_keep_to_disjoint_shares_of_its_cores():
    cores = [[0, 4], [1, 5], [2, 6], [3, 7]]  # four cores, two hyperthreads each
    halves = [thread_pool.share_cpus(cores, i, 2) for i in range(2)]
    assert halves == [{0, 4, 1, 5}, {2, 6, 3, 7}]
    thirds = [thread_pool.share_cpus(cores, i, 3) for i in range(3)]
    assert set().union(*thirds) == set(range(8)) and sum(map(len, thirds)) == 8  # every CPU, each once
    assert all(len(share) % 2 == 0 for share in thirds)  # whole cores: siblings stay together
    assert [thread_pool.share_cpus(cores, i, 6) for i in range(6)] == [{0, 4}, {1, 5}, {2, 6}, {3, 7}, {0, 4}, {1, 5}]


def test_one_stage_on_a_host_is_not_pinned():
    assert thread_pool.pin_to_share(0, 1) is None
