"""Processes of this project share the host's cores by leases: a native step runs on the cores its process holds,
and a process that stops decoding gives them back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from child_env import child_env
from k2deploy.runtime.backends.native import build
from k2deploy.runtime.backends.native.core_leases import LEASES_VARIABLE, core_leases, lease_folder
from k2deploy.runtime.backends.native.build import NativeUnavailable

# One process (a pool is sized once a process): the pool's state after a step with every core free, after a while
# idle, with another holder on its second core's lease, and once that holder lets go.
_LEASE_STATES = """
import ctypes, fcntl, json, os, sys, time
import numpy as np
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native.core_leases import lease_folder
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.backends.onnx.host_pages import LatentPages
model = load_model(load_manifest(sys.argv[1]), threads=2, decode="native")
native, store, table = model.native, LatentPages(model.kv_cache, model.num_layers, 1), np.arange(1)
def state():
    held = ctypes.c_int()
    active = native.lib.k2_pool_leases(ctypes.byref(held))
    return [active, held.value]
states = {}
native.step(5, 0, table, store.arrays)
states["free"] = state()
deadline = time.time() + 10
while state()[1] and time.time() < deadline:
    time.sleep(0.02)
states["idle"] = state()
other = os.open(lease_folder() / f"cpu{int(native.cpus(2)[1])}", os.O_RDWR)  # another holder: its own open file
fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
native.step(6, 1, table, store.arrays)
states["taken"] = state()
fcntl.flock(other, fcntl.LOCK_UN)
native.step(7, 2, table, store.arrays)
states["back"] = state()
print(json.dumps(states))
"""


def test_a_step_runs_on_the_cores_whose_leases_its_process_holds(tiny_cpu_artifact, tmp_path):
    """With both cores free a 2-thread step takes both leases and runs on two threads (or keeps one while a worker
    lately went without a core: a loaded host); idle, the process gives them back; with the second core's lease
    held elsewhere the step runs on the caller alone, and takes that core again once it is free."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: a pool of one thread takes no leases")
    try:
        build.build()
    except NativeUnavailable as exc:
        pytest.skip(f"the native decode step cannot be built here: {exc}")
    env = child_env(Path(__file__).parent)
    env[LEASES_VARIABLE] = str(tmp_path / "leases")
    run = subprocess.run([sys.executable, "-c", _LEASE_STATES, str(tiny_cpu_artifact)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    states = json.loads(run.stdout.strip().splitlines()[-1])
    for case in ("free", "back"):  # both cores; or, after a wait that found a worker without a core (a loaded
        # host), the first core's lease alone, kept from a step begun on two threads or on the caller alone
        assert states[case] in ([2, 0b11], [2, 0b01], [1, 0b01]), (case, states)
    assert states["idle"][1] == 0, states
    assert states["taken"] == [1, 0b01], states


def test_leases_live_only_in_a_folder_of_the_users_own(tmp_path, monkeypatch):
    """A folder others may write, or a link, gives no leases (each process then takes every core it asks for);
    `off` turns them off."""
    private = tmp_path / "private"
    monkeypatch.setenv(LEASES_VARIABLE, str(private))
    assert lease_folder() == private and oct(private.stat().st_mode & 0o777) == "0o700"
    leases = core_leases([0, -1])
    assert leases[0] >= 0 and leases[1] == -1 and core_leases([0]) == leases[:1]  # one open file a core
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(LEASES_VARIABLE, str(shared))
    assert lease_folder() is None and core_leases([0]) == [-1]
    link = tmp_path / "link"
    link.symlink_to(private)
    monkeypatch.setenv(LEASES_VARIABLE, str(link))
    assert lease_folder() is None
    monkeypatch.setenv(LEASES_VARIABLE, "off")
    assert lease_folder() is None
