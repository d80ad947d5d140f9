"""The README's main job: both services on the embedded default model, a prompt streamed back."""
import json
import os
import subprocess

from harness import ROOT, free_port


def test_run_local_streams_a_completion():
    env = {**os.environ, "MAX_TOKENS": "12", "EXPERT_PORT": str(free_port()), "GPU_PORT": str(free_port())}
    p = subprocess.run([str(ROOT / "scripts" / "run_local.sh"), "def fibonacci(n):", "--json"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    chunks = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(chunks) == 12 or chunks[-1]["finish_reason"] == "eos"
    assert chunks[-1]["finish_reason"] in ("length", "eos")
    assert all(c["token_ids"] for c in chunks)
