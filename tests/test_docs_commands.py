"""Every command line the README and docs/ show names a command that exists, with options it takes: `k2deploy`
subcommands against the CLI's own parser, `python benchmarks/NAME.py` against the script's arguments. (The README's
examples also run, in tests/test_readme.py.)"""

import re
from pathlib import Path

import pytest

from k2deploy.commands.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SPAN = re.compile(r"`([^`\n]+)`")
FENCED = re.compile(r"```[a-z]*\n(.*?)```", re.S)
K2DEPLOY = re.compile(r"(?:^|[\s(])k2deploy ([a-z][a-z-]*)((?: [^|;&]*)?)")
SCRIPT = re.compile(r"python (benchmarks/[\w/]+\.py)((?: [^|;&]*)?)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _command_lines() -> list[tuple[str, str]]:
    lines = []
    for doc in DOCS:
        text = doc.read_text()
        for block in FENCED.findall(text):
            lines += [(doc.name, line) for line in block.splitlines()]
        lines += [(doc.name, span) for span in SPAN.findall(FENCED.sub("", text))]
    return lines


def _subcommands() -> dict[str, set[str]]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return {name: {o for a in sub._actions for o in a.option_strings} for name, sub in action.choices.items()}


LINES = _command_lines()


def test_the_docs_show_commands():
    assert any(K2DEPLOY.search(line) for _, line in LINES) and any(SCRIPT.search(line) for _, line in LINES)


def test_every_k2deploy_command_in_the_docs_exists_with_its_options():
    commands, wrong = _subcommands(), []
    for doc, line in LINES:
        for name, rest in K2DEPLOY.findall(line):
            if name not in commands:
                wrong.append(f"{doc}: `{line}`: no command {name!r}")
                continue
            wrong += [f"{doc}: `{line}`: {name} takes no {option}" for option in OPTION.findall(rest)
                      if option not in commands[name]]
    assert not wrong, "\n".join(wrong)


def test_every_benchmark_script_in_the_docs_exists_with_its_options():
    wrong = []
    for doc, line in LINES:
        for script, rest in SCRIPT.findall(line):
            path = ROOT / script
            if not path.is_file():
                wrong.append(f"{doc}: `{line}`: no {script}")
                continue
            source = path.read_text()  # its own options, and those of the benchmarks it builds on
            source += "".join((ROOT / "benchmarks" / f"{m}.py").read_text()
                              for m in re.findall(r"^from (\w+) import", source, re.M)
                              if (ROOT / "benchmarks" / f"{m}.py").is_file())
            wrong += [f"{doc}: `{line}`: {script} takes no {option}" for option in OPTION.findall(rest)
                      if f'"{option}"' not in source and f"'{option}'" not in source]
    assert not wrong, "\n".join(wrong)
