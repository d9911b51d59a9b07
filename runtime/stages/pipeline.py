"""A model split into pipeline stages behind the runtime interface: each stage a contiguous range of decoder
layers on its own device, with its layers' entries of every cache page; only the hidden state [b, s, m] (and
the rows' page table) crosses from one stage to the next.

The stages run in this process (`LocalStages`) or on Ray (`ray_stages.RayStages`: a first stage on the CPUs of the
driver's host runs in the driver, every other stage in a Ray actor). The driver's cache bookkeeping is the slots,
their page tables and the prefix index (`PipelineCache`); each stage holds its own layers' entries. A `StageRunner`
is the same object everywhere: in a Ray actor it is the actor's state.
"""

from __future__ import annotations


import numpy as np

from ...core.errors import K2Error
from ...core.manifest import load_manifest
from ...core.placement import Stage as Placement
from ..backends.interface import logits_at
from ..cache.slots import Cache, SlotView, pages_for
from ..backends.native.choice import load_stage
from .stage_messages import pack, unpack
from ..backends.onnx.thread_pool import pin_to_share


class StageRunner:
    """One stage, loaded: the sessions of its layers (the embedding first, the head last) and its slice of the
    cache."""

    def __init__(self, artifact: str, placement: Placement, provider: str, threads: int | None,
                 device_id: int | None = None, host_share: int = 1, host_index: int = 0, pin: bool = True,
                 decode: str = "auto"):
        """host_share: how many stage processes share this stage's host, host_index: this one's place among them;
        with several, each keeps to its own share of the host's cores (`thread_pool.pin_to_share`; not with pin
        False, the driver's own stage, whose process does more than this stage) and its pool takes that many threads
        when threads is None. Of the graphs' files the stage hashes only its own (the other stages' are checked for
        their size). decode: the kernels of a cpu stage (`native.choice.load_stage`: the native step where it
        runs)."""
        self.cpus = pin_to_share(host_index, host_share) if pin else None
        manifest = load_manifest(artifact, hash_graphs=False)  # its graphs hashed as it opens them
        self.model = load_stage(manifest, range(placement.start, placement.stop),
                                "cpu" if placement.device == "cpu" else provider, threads, device_id,
                                host_share if self.cpus is None else 1, decode)  # pinned: its cores are its own
        self.store = None

    def allocate(self, pages: int) -> int:
        """The entries of `pages` cache pages for this stage's layers -> their bytes."""
        self.store = self.model.new_store(pages)
        return self.store.nbytes

    def threads(self) -> int:
        """The size of this stage's process's intra-op thread pool (or native step's pool)."""
        return self.model.threads

    def decode_kernels(self) -> str:
        """Which kernels run this stage's layers, and why."""
        return f"{self.model.layers.start}:{self.model.layers.stop} {self.model.decode_kernels}"

    def pinned_cpus(self) -> list[int] | None:
        """The CPUs this stage's process keeps to, or None where it is not pinned."""
        return None if self.cpus is None else sorted(self.cpus)

    def ready(self) -> bool:
        """Whether the stage has its cache pages (a restarted Ray actor has none until `allocate` again)."""
        return self.store is not None

    def forward(self, inputs: np.ndarray, positions: np.ndarray, valid: np.ndarray,
                page_table: np.ndarray) -> np.ndarray:
        """inputs: token_ids [b, s] on the first stage, else the previous stage's hidden [b, s, m] -> hidden; the
        rows' pages (page_table [b, n], the driver's) gain the valid entries."""
        if self.store is None:
            raise K2Error("this pipeline stage has no cache (it was restarted); the request that used it failed")
        return self.model.run(inputs, positions, valid, self.store.view(page_table))

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.model.logits(hidden)

    def step(self, message: bytes | None) -> bytes | None:
        """One stage of a compiled step (`ray_compiled.CompiledStep`): a message of (inputs, positions, valid,
        page_table, last) -> the same with this stage's hidden as inputs, or on the last stage a message of the
        logits that `logits_at` gives for `last` (runtime/stages/stage_messages.py); None (the graph run empty once, when
        compiled) -> None."""
        if message is None:
            return None
        inputs, positions, valid, page_table, last = unpack(message)
        hidden = self.forward(inputs, positions, valid, page_table)
        if not self.model.last:
            return pack((hidden, positions, valid, page_table, last))
        return pack((logits_at(self.model.logits, hidden, last),))

    def stage_seconds(self) -> dict[str, float]:
        return dict(self.model.stage_seconds)

    def clear_stage_seconds(self) -> None:
        self.model.stage_seconds.clear()


def device_id(placement: Placement) -> int | None:
    """The GPU index of a cuda:N device (local to its host), None for cpu."""
    return None if placement.device == "cpu" else int(placement.device.partition(":")[2] or 0)


class LocalStages:
    """The stages in this process, called one after the other."""

    def __init__(self, artifact: str, placements: list[Placement], provider: str, threads: int | None,
                 decode: str = "auto"):
        self.stages = [StageRunner(artifact, p, provider, threads, device_id(p), decode=decode) for p in placements]

    def decode_kernels(self) -> list[str]:
        return [stage.decode_kernels() for stage in self.stages]

    def allocate(self, pages: int) -> int:
        return sum(stage.allocate(pages) for stage in self.stages)

    def threads(self) -> list[int]:
        return [stage.threads() for stage in self.stages]

    def forward_logits(self, token_ids, positions, valid, page_table, last) -> np.ndarray:
        hidden = token_ids
        for stage in self.stages:
            hidden = stage.forward(hidden, positions, valid, page_table)
        return logits_at(self.stages[-1].logits, hidden, last)

    def stage_seconds(self) -> dict[str, float]:
        return {name: s for stage in self.stages for name, s in stage.stage_seconds().items()}

    def clear_stage_seconds(self) -> None:
        for stage in self.stages:
            stage.clear_stage_seconds()

    def problem(self) -> str | None:
        return None

    def release(self) -> None:
        """Stages in this process hold nothing between steps."""


class PipelineCache(Cache):
    """The driver's side of a pipeline's cache: the slots, their page tables and the prefix index; each stage holds
    its layers' entries of every page."""

    def __init__(self, stages, batch: int, max_len: int, pages: int, prefix_cache: bool, salt: bytes):
        super().__init__(batch, max_len, pages, None, prefix_cache, salt)
        self._nbytes = stages.allocate(pages)

    @property
    def nbytes(self) -> int:
        return self._nbytes


class PipelineModel:
    """Stages behind the runtime interface (`runtime.interface.Model`)."""

    def __init__(self, manifest, stages, placements: list[Placement]):
        self.config = manifest.config
        self.kv_cache = manifest.kv_cache
        self.stages = stages
        self.placements = placements
        self.threads = stages.threads()[0]  # the first stage's intra-op pool (stages on one host have alike pools)
        self.num_layers = sum(p.stop - p.start for p in placements)
        self.salt = manifest.digest.encode()  # keys the cache's prefix hashes to this artifact
        self.decode_kernels = "stages " + ", ".join(stages.decode_kernels())  # each stage's kernels, and why

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Per layer where the stages run here, else the stages' own totals, fetched when read."""
        return StageSeconds(self.stages)

    def new_cache(self, batch: int, max_len: int, pages: int | None = None, prefix_cache: bool = True) -> PipelineCache:
        return PipelineCache(self.stages, batch, max_len, pages or batch * pages_for(max_len), prefix_cache, self.salt)

    def forward_logits(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView,
                       last: np.ndarray | None) -> np.ndarray:
        """A forward and its logits in one call (`runtime.interface.Model.forward_logits`): the last stage
        runs the head, so only the logits of the rows asked for come back."""
        return self.stages.forward_logits(token_ids, positions, valid, view.page_table, last)

    def problem(self) -> str | None:
        """None while every stage is up; else what is wrong, in one line (`/health` reports it)."""
        return self.stages.problem()

    def release_idle(self) -> None:
        """Frees what the stages hold only to step fast (a compiled graph's polling actors) while no step comes; the
        next step takes it back."""
        self.stages.release()


class StageSeconds(dict):
    """The stages' cumulative seconds per stage name, as a dict; `clear()` clears them on the stages too."""

    def __init__(self, stages):
        super().__init__(stages.stage_seconds())
        self.stages = stages

    def clear(self) -> None:
        super().clear()
        self.stages.clear_stage_seconds()
