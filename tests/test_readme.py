"""The README's examples run as written: each command line of its examples block, in turn, in an empty folder."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from child_env import child_env

README = Path(__file__).resolve().parents[1] / "README.md"


def _examples() -> list[str]:
    block = re.search(r"<!-- examples -->\n```bash\n(.*?)```\n<!-- /examples -->", README.read_text(), re.S)
    assert block, "README.md has no examples block"
    return [line for line in block.group(1).splitlines() if line.strip()]


@pytest.mark.slow
def test_the_readme_examples_run_as_written(tmp_path):
    lines = _examples()
    assert {shlex.split(line)[1] for line in lines} >= {"make-checkpoint", "export", "generate", "bench", "plan"}
    for line in lines:
        words = shlex.split(line)
        assert words[0] == "k2deploy", line
        done = subprocess.run([sys.executable, "-m", "k2deploy", *words[1:]], cwd=tmp_path, env=child_env(),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}: {done.stderr[-2000:]}"
