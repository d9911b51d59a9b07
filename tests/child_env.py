"""Environments for the child processes the tests start: packages blocked, stand-ins in front."""

import os
from pathlib import Path

STAND_IN = Path(__file__).parent / "stand_in"  # stand-ins for TensorRT and cuda-python


def blocked(workdir: Path, *modules: str) -> Path:
    """A folder whose packages `modules` raise ImportError: put it in front of the path of a child that must
    do without them (a serving host without torch)."""
    folder = Path(workdir) / "blocked"
    for name in modules:
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed on this serving host')\n")
    return folder


def child_env(*front: Path) -> dict:
    """This process's environment with `front` first on PYTHONPATH, without TRITON_INTERPRET (set in this
    process without a GPU; a child that compiles Triton kernels must not inherit it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, front), env.get("PYTHONPATH", "")])
    return env
