"""The figure tables in docs/ are generated, not typed: each `<!-- table: COMMAND -->` block holds what COMMAND (a
`k2deploy bench compare ... --markdown` over saved results under bench/samples/) prints now."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- table: (?P<command>.+?) -->\n(?P<table>.*?)\n<!-- end table -->", re.S)
BLOCKS = [(doc.relative_to(ROOT), m["command"], m["table"]) for doc in sorted((ROOT / "docs").glob("*.md"))
          for m in BLOCK.finditer(doc.read_text())]


def test_the_docs_have_generated_tables():
    assert BLOCKS, "no generated table in docs/"


@pytest.mark.parametrize("doc, command, table", BLOCKS, ids=[f"{d}:{i}" for i, (d, _, _) in enumerate(BLOCKS)])
def test_a_generated_table_is_what_its_command_prints(doc, command, table, tmp_path):
    words = shlex.split(command)
    assert words[:3] == ["k2deploy", "bench", "compare"] and "--markdown" in words, command  # files alone, no model
    run = subprocess.run([sys.executable, "-m", "k2deploy", *words[1:], "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    printed = "\n".join(line for line in run.stdout.splitlines() if line.startswith("|"))
    assert printed == table, f"{doc}: the table under `{command}` is not what it prints now; paste its output"
