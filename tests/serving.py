"""`python -m k2deploy serve` as a child process, for the tests that talk to a real server."""

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from child_env import blocked, child_env
from decode_path import named_decode

STARTUP_S = 90
MODEL = "tiny-k2"


class Server:
    """A `python -m k2deploy serve` process on a host without torch (and, with `front`, with more on
    its path); its output goes to files (a full pipe would stall it)."""

    def __init__(self, artifact: Path, workdir: Path, *args: str, front: tuple = ()):
        workdir.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = workdir / "stdout.txt", workdir / "stderr.txt"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "k2deploy", *named_decode(["serve", str(artifact), "--port", "0", "--model-name",
                                                                   MODEL, "--threads", "2", *args])], stdout=out, stderr=err,
                env=child_env(blocked(workdir, "torch"), *front))
        self.url = self._wait_until_up()

    def _wait_until_up(self) -> str:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", self.stdout_path.read_text())
            if match:
                try:
                    if httpx.get(f"{match.group(1)}/health", timeout=5).status_code == 200:
                        return match.group(1)
                except httpx.TransportError:
                    pass
            assert self.process.poll() is None, f"server exited: {self.stderr_path.read_text()}"
            time.sleep(0.2)
        raise AssertionError(f"server not up after {STARTUP_S} s: {self.stderr_path.read_text()}")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                             timeout=60, **kwargs)

    def metric(self, name: str, headers: dict | None = None) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def wait_for_metric(self, name: str, value: float, headers: dict | None = None, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name, headers) != value:
            assert time.monotonic() < deadline, f"{name} stayed at {self.metric(name, headers)}, expected {value}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def with_tokenizer_config(artifact: Path, copy_to: Path, change) -> Path:
    """A copy of `artifact` whose tokenizer config is change(config) (changed in place), its manifest's record of
    the file updated: a checkpoint whose tokenizer files say something else."""
    import json
    import shutil

    from k2deploy.core.manifest import MANIFEST_FILE, file_record

    copy = shutil.copytree(artifact, copy_to)
    config_path = copy / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    change(config)
    config_path.write_text(json.dumps(config))
    manifest = json.loads((copy / MANIFEST_FILE).read_text())
    manifest["files"]["tokenizer/tokenizer_config.json"] = file_record(copy, "tokenizer/tokenizer_config.json")
    (copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    return copy


def with_markers_flagged(artifact: Path, copy_to: Path, markers: tuple[str, ...], special: bool) -> Path:
    """A copy of `artifact` whose tokenizer config flags `markers` special or not (configs differ between releases
    and re-saved tokenizers)."""
    def flag(config: dict) -> None:
        for entry in config["added_tokens_decoder"].values():
            if entry["content"] in markers:
                entry["special"] = special

    return with_tokenizer_config(artifact, copy_to, flag)
