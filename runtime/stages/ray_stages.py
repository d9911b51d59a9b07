"""Pipeline stages on Ray: each stage's sessions and slice of the cache live in one actor on its device (a GPU
stage asks Ray for one GPU; a stage of host N runs on the N-th node), except a first stage on the CPUs of the
driver's own host, which runs in the driver (as a serving engine's driver worker does): on a decode step the driver
would otherwise only wait, and a stage in it saves a hop and an actor that polls for its next message.

Before any actor loads, each stage checks its own host's memory for its weights and its share of the cache.
A step runs as a Ray Compiled Graph (`ray_compiled.CompiledStep`): the driver's stage first, then the actors'
stages chained by channels, the last one running the head, so that only the logits of the rows asked for come
back; a batch of several rows goes as micro-batches, one per stage, in flight together so that the stages work at
the same time (the driver runs micro-batch i + 1 while the actors run micro-batch i). Where Ray cannot
compile the graph, one line says so at start and each step chains the stages' calls by object reference
through Ray's object store instead. A stage that dies fails the forwards that used it and closes the graph;
Ray restarts its actor (up to ACTOR_RESTARTS times), which loads its sessions again, `problem()` gives it a
fresh cache once it answers, and the next step compiles the graph again. No torch is imported here or in the
actors.

A compiled graph's actors wait for their next message by polling (Ray's shared-memory channels spin with
sched_yield): each stage actor keeps a core busy, idle or not. Actors that share a host therefore keep to
disjoint shares of its cores (`StageRunner`, `thread_pool.pin_to_share`), so that a waiting stage does not take
turns on a computing stage's core; the driver's stage counts as one of them (its pool takes its share of the
cores; the driver itself is not pinned: it does more than its stage). `release()` tears the graph down, so that idle
stages cost nothing; the next step compiles it again (about 0.2 s on 2 CPU cores). The server releases it after
`serve.engine_thread.IDLE_RELEASE_S` without a request.
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections import Counter

import numpy as np

from ...core.errors import K2Error
from ...core.placement import Stage as Placement
from ..backends.interface import logits_at
from .pipeline import StageRunner, device_id
from .ray_compiled import compile_step

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
    """The stages in placement order: the first in the driver where it can run there (`local`), the others as Ray
    actors (`actors`)."""

    def __init__(self, artifact: str, placements: list[Placement], provider: str, threads: int | None,
                 check_memory, row_bytes: int, compiled: bool = True, driver_stage: bool = True, decode: str = "auto"):
        """check_memory(index, placement): raises a K2Error where the stage does not fit; it runs on the stage's
        host. row_bytes: one row's hidden state or logits, whichever is larger (sizes the graph's channels).
        decode: the kernels of each cpu stage (runtime/stages/pipeline.py StageRunner).
        compiled False: the task path, without trying a compiled graph (benchmarks compare the two).
        driver_stage False: the first stage on an actor too, wherever it is (benchmarks compare the two)."""
        import ray

        self.ray = ray
        self.placements = placements
        self.pages: int | None = None  # the cache's pages, once allocated (a restarted stage gets them again)
        self.row_bytes = row_bytes
        nodes = _nodes_by_host(ray, max(p.host for p in placements) + 1)
        self._check_hosts(check_memory, nodes)
        per_host = Counter(p.host for p in placements)  # the stages of one host divide its cores between them
        index_on_host = [sum(p.host == placement.host for p in placements[:i]) for i, placement in enumerate(placements)]
        in_driver = driver_stage and _runs_in_driver(ray, nodes, placements)
        self.first_actor = 1 if in_driver else 0  # the placement index of the first actor's stage
        remote = ray.remote(StageRunner)
        prefix = f"k2deploy-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # the driver pid: whose stages these are
        self.names = [f"{prefix}-stage-{i}" for i in range(self.first_actor, len(placements))]
        self.actors = []
        for name, placement, host_index in zip(self.names, placements[self.first_actor:],
                                               index_on_host[self.first_actor:]):
            gpu = placement.device != "cpu"
            options = {"name": name, "namespace": NAMESPACE, "max_restarts": ACTOR_RESTARTS, "max_task_retries": 0,
                       "num_cpus": 0, "num_gpus": 1 if gpu else 0,  # the stage's own thread pool sizes its CPU use
                       **_on_host(nodes, placement)}
            # Ray shows a GPU actor its one GPU as device 0
            self.actors.append(remote.options(**options).remote(artifact, placement, provider, threads,
                                                                0 if gpu else device_id(placement), per_host[placement.host],
                                                                host_index, decode=decode))
        # loads while the actors load theirs
        self.local = (StageRunner(artifact, placements[0], provider, threads, None, per_host[placements[0].host], 0,
                                  pin=False, decode=decode) if in_driver else None)
        self._get([actor.ready.remote() for actor in self.actors], "loading")
        self.graph = None
        self.compiled = compiled
        if compiled:
            self.graph, why_not = compile_step(self.actors, row_bytes)
            if self.graph is None:
                self.compiled = False
                print(f"k2deploy: note: Ray stages run as tasks through the object store: {why_not}", file=sys.stderr,
                      flush=True)

    def _check_hosts(self, check_memory, nodes: list[str] | None) -> None:
        """Each stage's memory check, run on its own host; the first refusal as its own one line."""
        check = self.ray.remote(_call)
        refs = [check.options(num_cpus=0, **_on_host(nodes, placement)).remote(check_memory, i, placement)
                for i, placement in enumerate(self.placements)]
        try:
            self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as exc:
            raise K2Error(_first_line(exc.cause or exc)) from None

    def allocate(self, pages: int) -> int:
        self.pages = pages
        local = self.local.allocate(pages) if self.local else 0
        return local + sum(self._get([actor.allocate.remote(pages) for actor in self.actors], "allocating the cache"))

    def threads(self) -> list[int]:
        local = [self.local.threads()] if self.local else []
        return local + self._get([actor.threads.remote() for actor in self.actors], "reading thread counts")

    def decode_kernels(self) -> list[str]:
        local = [self.local.decode_kernels()] if self.local else []
        return local + self._get([actor.decode_kernels.remote() for actor in self.actors], "reading their kernels")

    def forward_logits(self, token_ids, positions, valid, page_table, last) -> np.ndarray:
        """The rows as up to one micro-batch per stage, all in flight at once: while stage k runs micro-batch i,
        stage k + 1 runs micro-batch i - 1 (each actor takes them in order) -> the logits `logits_at` gives."""
        parts = np.array_split(np.arange(len(page_table)), min(len(page_table), len(self.placements)))
        messages = ((token_ids[p], positions[p], valid[p], page_table[p], None if last is None else last[p])
                    for p in parts)
        if not self.compiled:
            return np.concatenate([self._through_tasks(*self._through_driver(message)) for message in messages])
        try:
            if self.graph is None:  # closed by a fault: the stages are back (`problem`), compile it again
                self.graph, why_not = compile_step(self.actors, self.row_bytes)
                if self.graph is None:
                    raise K2Error(f"a pipeline stage is down (compiling the step): {why_not}")
            # the driver's stage runs micro-batch i + 1 while the actors run micro-batch i
            refs = [self.graph.submit(self._through_driver(message)) for message in messages]
            return np.concatenate([self.graph.result(ref) for ref in refs])
        except self.ray.exceptions.RayError as exc:
            self._close_graph()
            if isinstance(exc, self.ray.exceptions.RayTaskError):
                raise K2Error(f"a pipeline stage failed in a step: {_first_line(exc.cause or exc)}") from None
            raise K2Error(f"a pipeline stage is down (a step): {_first_line(exc)}") from None
        except BaseException:  # the driver's stage failed with micro-batches in flight: their results go unread, so
            self._close_graph()  # the graph goes (the next step compiles it again) rather than answer out of turn
            raise

    def release(self) -> None:
        """Tears the compiled graph down (its actors stop polling for messages); the next step compiles it again."""
        self._close_graph()

    def _through_driver(self, message: tuple) -> tuple:
        """A micro-batch's message for the first actor: its inputs through the driver's stage where there is one."""
        if self.local is None:
            return message
        inputs, positions, valid, page_table, last = message
        return self.local.forward(inputs, positions, valid, page_table), positions, valid, page_table, last

    def _through_tasks(self, inputs, positions, valid, page_table, last) -> np.ndarray:
        """One micro-batch as chained actor calls: each stage's hidden goes straight to the next by reference."""
        ref = inputs
        for actor in self.actors:
            ref = actor.forward.remote(ref, positions, valid, page_table)
        head = self.actors[-1].logits.remote
        return logits_at(lambda hidden: self._get(head(hidden), "the head"), self._get(ref, "a forward"), last)

    def _close_graph(self) -> None:
        if self.graph is not None:
            graph, self.graph = self.graph, None
            try:
                graph.close()
            except Exception:  # noqa: BLE001 - a graph whose actor died may fail to tear down; it is dropped anyway
                pass

    def stage_seconds(self) -> dict[str, float]:
        seconds = [self.local.stage_seconds()] if self.local else []
        seconds += self._get([actor.stage_seconds.remote() for actor in self.actors], "reading timings")
        return {name: s for stage in seconds for name, s in stage.items()}

    def clear_stage_seconds(self) -> None:
        if self.local:
            self.local.clear_stage_seconds()
        self._get([actor.clear_stage_seconds.remote() for actor in self.actors], "clearing timings")

    def problem(self) -> str | None:
        """None when every actor's stage answers with its cache (a restarted one is given a fresh cache here first);
        the driver's own stage is up while the driver is."""
        for i, (actor, placement) in enumerate(zip(self.actors, self.placements[self.first_actor:]), self.first_actor):
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


def _runs_in_driver(ray, nodes: list[str] | None, placements: list[Placement]) -> bool:
    """Whether the first stage runs in the driver: a CPU stage, not the only one, on the driver's own host (any
    node where every stage is on host 0)."""
    first = placements[0]
    if len(placements) < 2 or first.device != "cpu":
        return False
    return nodes is None or nodes[first.host] == ray.get_runtime_context().get_node_id()


def _call(function, *args) -> None:
    """A callable (a partial too, which Ray does not take as a remote function) run as a Ray task."""
    function(*args)


def _on_host(nodes: list[str] | None, placement: Placement) -> dict:
    """Ray options that pin a task or actor to the placement's host (none when every stage is on host 0)."""
    if nodes is None:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[placement.host], soft=False)}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
