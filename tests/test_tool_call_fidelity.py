"""benchmarks/tool_call_fidelity.py on the tiny artifact: every recorded agent request answered, streamed and not,
and every intended call and text of the scripted run returned byte for byte with valid arguments."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tool_call_fidelity.py"


def test_the_recorded_agent_requests_are_answered_and_intended_calls_come_back_unbent(tiny_cpu_artifact, capsys):
    spec = importlib.util.spec_from_file_location("tool_call_fidelity", SCRIPT)
    fidelity = importlib.util.module_from_spec(spec)
    sys.modules["tool_call_fidelity"] = fidelity
    spec.loader.exec_module(fidelity)
    assert fidelity.main([str(tiny_cpu_artifact), "--decode", "native", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    recorded = json.loads(fidelity.REQUESTS.read_text())["requests"]
    assert result["model"]["answered"] == result["model"]["requests"] == 2 * len(recorded)
    assert result["model"]["finish_agreement"] == 1.0  # the same seed streamed and not: the same answer
    scripted = result["scripted"]
    assert scripted["identical"] == scripted["answers"] == 2 * len(recorded), scripted["misses"]
    assert scripted["calls"] == 2 * sum(len(r["intended"]) for r in recorded if isinstance(r["intended"], list))
    assert scripted["schema_accuracy"] == 1.0
