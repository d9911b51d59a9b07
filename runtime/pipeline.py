"""A model split into pipeline stages behind the runtime interface: each stage a contiguous range of decoder
layers on its own device, with its slice of the latent cache; only the hidden state [b, s, m] crosses
from one stage to the next.

The stages run in this process (`LocalStages`) or each in a Ray actor (`ray_stages.RayStages`); the
driver holds no weights and no cache entries, only the slots' lengths (`PipelineCache`). A `StageRunner`
is the same object in both: in a Ray actor it is the actor's state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.errors import K2Error
from ..core.manifest import load_manifest
from ..core.placement import Stage as Placement
from .cache import Cache, SlotView
from .ort_backend import OrtModel


class StageRunner:
    """One stage, loaded: the sessions of its layers (the embedding first, the head last) and its slice of the
    cache."""

    def __init__(self, artifact: str, placement: Placement, provider: str, threads: int | None,
                 device_id: int | None = None, host_share: int = 1):
        """host_share: how many stage processes share this stage's host (they divide its cores when threads is None)."""
        manifest = load_manifest(artifact)
        self.model = OrtModel(manifest, provider="cpu" if placement.device == "cpu" else provider, threads=threads,
                              layers=range(placement.start, placement.stop), device_id=device_id, host_share=host_share)
        self.cache = None

    def allocate(self, batch: int, max_len: int) -> int:
        """A cache of `batch` slots of `max_len` positions for this stage's layers -> its bytes."""
        self.cache = self.model.new_cache(batch, max_len)
        return self.cache.nbytes

    def threads(self) -> int:
        """The size of this stage's process's intra-op thread pool."""
        return self.model.threads

    def ready(self) -> bool:
        """Whether the stage has its cache (a restarted Ray actor has none until `allocate` again)."""
        return self.cache is not None

    def forward(self, inputs: np.ndarray, positions: np.ndarray, valid: np.ndarray,
                slots: Sequence[int]) -> np.ndarray:
        """inputs: token_ids [b, s] on the first stage, else the previous stage's hidden [b, s, m] -> hidden."""
        if self.cache is None:
            raise K2Error("this pipeline stage has no cache (it was restarted); the request that used it failed")
        view = self.cache.view(slots)
        hidden = self.model.forward(inputs, positions, valid, view)
        view.commit()
        return hidden

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.model.logits(hidden)

    def stage_seconds(self) -> dict[str, float]:
        return dict(self.model.stage_seconds)

    def clear_stage_seconds(self) -> None:
        self.model.stage_seconds.clear()


def device_id(placement: Placement) -> int | None:
    """The GPU index of a cuda:N device (local to its host), None for cpu."""
    return None if placement.device == "cpu" else int(placement.device.partition(":")[2] or 0)


class LocalStages:
    """The stages in this process, called one after the other."""

    def __init__(self, artifact: str, placements: list[Placement], provider: str, threads: int | None):
        self.stages = [StageRunner(artifact, p, provider, threads, device_id(p)) for p in placements]

    def allocate(self, batch: int, max_len: int) -> int:
        return sum(stage.allocate(batch, max_len) for stage in self.stages)

    def threads(self) -> list[int]:
        return [stage.threads() for stage in self.stages]

    def forward(self, token_ids, positions, valid, slots) -> np.ndarray:
        hidden = token_ids
        for stage in self.stages:
            hidden = stage.forward(hidden, positions, valid, slots)
        return hidden

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.stages[-1].logits(hidden)

    def stage_seconds(self) -> dict[str, float]:
        return {name: s for stage in self.stages for name, s in stage.stage_seconds().items()}

    def clear_stage_seconds(self) -> None:
        for stage in self.stages:
            stage.clear_stage_seconds()

    def problem(self) -> str | None:
        return None


class PipelineCache(Cache):
    """The driver's side of a pipeline's cache: the slots' lengths; each stage holds its layers' entries (a
    forward's view is a `SlotView`: the stages make their own views of the same slots)."""

    def __init__(self, stages, batch: int, max_len: int):
        super().__init__(batch)
        self.stages = stages
        self._nbytes = stages.allocate(batch, max_len)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def view(self, slots: Sequence[int]) -> SlotView:
        return SlotView(self, slots)


class PipelineModel:
    """Stages behind the runtime interface (`runtime.interface.Model`)."""

    def __init__(self, manifest, stages, placements: list[Placement]):
        self.config = manifest.config
        self.kv_cache = manifest.kv_cache
        self.stages = stages
        self.placements = placements
        self.threads = stages.threads()[0]  # the first stage's intra-op pool (stages on one host have alike pools)
        self.num_layers = sum(p.stop - p.start for p in placements)

    @property
    def stage_seconds(self) -> dict[str, float]:
        """Per layer where the stages run here, else the stages' own totals, fetched when read."""
        return StageSeconds(self.stages)

    def new_cache(self, batch: int, max_len: int) -> PipelineCache:
        return PipelineCache(self.stages, batch, max_len)

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView) -> np.ndarray:
        hidden = self.stages.forward(token_ids, positions, valid, view.slots)
        view.grow(positions, valid)
        return hidden

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.stages.logits(hidden)

    def problem(self) -> str | None:
        """None while every stage is up; else what is wrong, in one line (`/health` reports it)."""
        return self.stages.problem()


class StageSeconds(dict):
    """The stages' cumulative seconds per stage name, as a dict; `clear()` clears them on the stages too."""

    def __init__(self, stages):
        super().__init__(stages.stage_seconds())
        self.stages = stages

    def clear(self) -> None:
        super().clear()
        self.stages.clear_stage_seconds()
