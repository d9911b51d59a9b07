"""One step of Ray stages as a Ray Compiled Graph (`ray.dag`, `experimental_compile`): the stages' actors chained
by channels (shared memory between actors of one host), compiled once and run each step with the step's arrays
as its input, so that a step submits no task and puts nothing in the object store. Each stage's
`StageRunner.step` passes its hidden state to the next; the last stage runs the head and gives the logits of
the rows asked for, which alone come back to the driver. Every message is one bytes object
(runtime/stages/stage_messages.py), which Ray's channels pass several times faster than a tuple of arrays.

Steps may overlap: the driver submits several micro-batches before it reads the first result, and each actor
takes them in order, so stage k runs micro-batch i while stage k + 1 runs micro-batch i - 1.
"""

from __future__ import annotations

import numpy as np

from .stage_messages import pack, unpack

BUFFER_ROWS = 8  # channels start with room for this many rows of a decode step's hidden state or logits
MIN_BUFFER_BYTES = 1 << 20
MAX_IN_FLIGHT = 16  # micro-batches submitted before the first is read; a step has at most one per stage
STEP_TIMEOUT_S = 300  # a stage that takes longer to take or give a step's message is taken for hung


class CompiledStep:
    """The stages' actors (in order) compiled into one graph: `submit` a step's message, `result` its logits."""

    def __init__(self, actors: list, row_bytes: int):
        """row_bytes: the larger of one row's hidden state and one row's logits (float32). A message that outgrows
        a channel's buffer (a long prompt chunk) makes Ray grow that channel once; it is not refused."""
        from ray.dag import InputNode

        with InputNode() as message:
            node = message
            for actor in actors:
                node = actor.step.bind(node)
        self.graph = node.experimental_compile(_buffer_size_bytes=max(MIN_BUFFER_BYTES, BUFFER_ROWS * row_bytes),
                                               _submit_timeout=STEP_TIMEOUT_S,
                                               _max_inflight_executions=MAX_IN_FLIGHT)
        self.result(self.submit(None))  # Ray's one-time setup of a graph (seconds) is paid here, not by a step

    def submit(self, message: tuple | None):
        """message (token_ids, positions, valid, page_table, last), or None to run the graph empty -> a reference
        to its logits."""
        return self.graph.execute(None if message is None else pack(message))

    @staticmethod
    def result(ref) -> np.ndarray | None:
        """The logits of a submitted step. A dead stage's actor closes the graph's channels, which ends the wait
        with an error; so does a wait past STEP_TIMEOUT_S."""
        message = ref.get(timeout=STEP_TIMEOUT_S)
        return None if message is None else unpack(message)[0]

    def close(self) -> None:
        self.graph.teardown()


def compile_step(actors: list, row_bytes: int) -> tuple[CompiledStep | None, str | None]:
    """The compiled step, or None and why there is none (this Ray has no compiled graphs, or it cannot build one
    for these actors)."""
    try:
        return CompiledStep(actors, row_bytes), None
    except ImportError as exc:
        return None, f"this Ray has no compiled graphs ({exc})"
    except Exception as exc:  # noqa: BLE001 - whatever Ray refuses, the task path still runs the stages
        text = str(exc).strip().splitlines()
        return None, f"Ray could not compile the stages into a graph ({text[0][:200] if text else type(exc).__name__})"
