"""Pipeline stages on Ray actors: each stage's sessions and slice of the cache live in one actor on its device
(a GPU stage asks Ray for one GPU; a stage of host N runs on the N-th node); the driver holds neither.

A forward chains the stages' calls by object reference, so each stage's hidden state goes to the next
through Ray's object store without a round trip to the driver; a batch of several rows goes as
micro-batches, one per stage, so that the stages work at the same time. A stage that dies fails the forwards that
used it; Ray restarts its actor (up to ACTOR_RESTARTS times), which loads its sessions again, and
`problem()` gives it a fresh cache once it answers. No torch is imported here or in the actors.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections import Counter

import numpy as np

from ..core.errors import K2Error
from ..core.placement import Stage as Placement
from .pipeline import StageRunner, device_id

ACTOR_RESTARTS = 3
NAMESPACE = "k2deploy"
PING_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0


def connect(address: str) -> None:
    """Joins the Ray cluster at `address` (host:port), or with "auto" the one on this host, starting one there if
    none runs; a K2Error in one line when the address does not answer."""
    try:
        import ray
    except ImportError:
        raise K2Error("--ray needs Ray: pip install 'k2deploy[ray]'") from None
    if ray.is_initialized():
        return
    if address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError):
            raise K2Error(f"--ray {address}: no Ray cluster answers there (expected HOST:PORT of a running head, "
                          f"e.g. the address `ray start --head` prints); start one or pass --ray auto") from None
    try:
        ray.init(address=address if address != "auto" else None, namespace=NAMESPACE, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        raise K2Error(f"--ray {address}: cannot join the Ray cluster ({str(exc).splitlines()[0]})") from None


class RayStages:
    """The stages as Ray actors, in placement order."""

    def __init__(self, artifact: str, placements: list[Placement], provider: str, threads: int | None):
        import ray

        self.ray = ray
        self.placements = placements
        self.pages: int | None = None  # the cache's pages, once allocated (a restarted stage gets them again)
        remote = ray.remote(StageRunner)
        nodes = _nodes_by_host(ray, max(p.host for p in placements) + 1)
        prefix = f"k2deploy-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the driver pid: whose stages these are
        self.names = [f"{prefix}-stage-{i}" for i in range(len(placements))]
        self.actors = []
        per_host = Counter(p.host for p in placements)  # actors on one host divide its cores between their pools
        for name, placement in zip(self.names, placements):
            gpu = placement.device != "cpu"
            options = {"name": name, "namespace": NAMESPACE, "max_restarts": ACTOR_RESTARTS, "max_task_retries": 0,
                       "num_cpus": 0, "num_gpus": 1 if gpu else 0}  # the stage's own thread pool sizes its CPU use
            if nodes is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[placement.host], soft=False)
            # Ray shows a GPU actor its one GPU as device 0
            self.actors.append(remote.options(**options).remote(artifact, placement, provider, threads,
                                                                0 if gpu else device_id(placement), per_host[placement.host]))
        self._get([actor.ready.remote() for actor in self.actors], "loading")

    def allocate(self, pages: int) -> int:
        self.pages = pages
        return sum(self._get([actor.allocate.remote(pages) for actor in self.actors], "allocating the cache"))

    def threads(self) -> list[int]:
        return self._get([actor.threads.remote() for actor in self.actors], "reading thread counts")

    def forward(self, token_ids, positions, valid, page_table) -> np.ndarray:
        """The rows as up to one micro-batch per stage, all submitted at once: while stage k runs micro-batch i,
        stage k + 1 runs micro-batch i - 1 (each actor takes its calls in order)."""
        refs = []
        for part in np.array_split(np.arange(len(page_table)), min(len(page_table), len(self.actors))):
            ref = token_ids[part]
            for actor in self.actors:  # each stage's hidden goes straight to the next
                ref = actor.forward.remote(ref, positions[part], valid[part], page_table[part])
            refs.append(ref)
        return np.concatenate(self._get(refs, "a forward"))

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self._get(self.actors[-1].logits.remote(hidden), "the head")

    def stage_seconds(self) -> dict[str, float]:
        seconds = self._get([actor.stage_seconds.remote() for actor in self.actors], "reading timings")
        return {name: s for stage in seconds for name, s in stage.items()}

    def clear_stage_seconds(self) -> None:
        self._get([actor.clear_stage_seconds.remote() for actor in self.actors], "clearing timings")

    def problem(self) -> str | None:
        """None when every stage answers with its cache (a restarted one is given a fresh cache here first)."""
        for i, (actor, placement) in enumerate(zip(self.actors, self.placements)):
            where = f"pipeline stage {i} (layers {placement.start}:{placement.stop} on {placement.name})"
            try:
                ready = self.ray.get(actor.ready.remote(), timeout=PING_TIMEOUT_S)
                if not ready and self.pages is not None:
                    self.ray.get(actor.allocate.remote(self.pages), timeout=PING_TIMEOUT_S * 6)
            except self.ray.exceptions.GetTimeoutError:
                return f"{where} does not answer (restarting or busy)"
            except self.ray.exceptions.RayError as exc:
                return f"{where} is down: {_first_line(exc)}"
        return None

    def _get(self, refs, doing: str):
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as exc:  # the stage raised: its own error, e.g. a K2Error
            raise K2Error(f"a pipeline stage failed while {doing}: {_first_line(exc.cause or exc)}") from None
        except self.ray.exceptions.RayError as exc:  # the actor died or could not be reached
            raise K2Error(f"a pipeline stage is down ({doing}): {_first_line(exc)}") from None


def _nodes_by_host(ray, hosts: int) -> list[str] | None:
    """Node ids for hosts 0..hosts-1 (alive nodes in address order), None when every stage is on host 0."""
    if hosts == 1:
        return None
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])
    if len(nodes) < hosts:
        raise K2Error(f"the placement uses {hosts} hosts, the Ray cluster has {len(nodes)} nodes")
    return [n["NodeID"] for n in nodes[:hosts]]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
