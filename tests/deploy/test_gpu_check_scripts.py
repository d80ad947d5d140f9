"""The benchmarks scripts/gpu_check.sh runs on a lent GPU, run here on the CPU at toy sizes: a GPU lease is a few
minutes, and a script that breaks on its first step spends it (bench_graphs crashed at its prefill for any context
above 64 rows, the check's 512 included, and nothing had run it since)."""
import subprocess
import sys

import pytest

from harness import ROOT

pytestmark = pytest.mark.slow  # benchmarks at toy sizes: the full suite runs them

NARROW = {  # the presets' shapes at toy width (every field the preset's attention and routing read)
    "qwen3-30b-a3b": ["hidden_size=128", "num_attention_heads=4", "num_key_value_heads=2", "head_dim=32",
                      "moe_intermediate_size=64", "num_experts=8"],
    "deepseek-v3": ["hidden_size=128", "num_attention_heads=4", "num_key_value_heads=4", "q_lora_rank=64",
                    "kv_lora_rank=32", "qk_nope_head_dim=16", "qk_rope_head_dim=16", "v_head_dim=16",
                    "n_routed_experts=16", "moe_intermediate_size=32", "n_group=4", "topk_group=2",
                    "num_experts_per_tok=4"],
}


def run_bench(script: str, *args: str, timeout: float = 300) -> str:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.parametrize("arch", sorted(NARROW))
def test_bench_graphs_runs_past_a_prompt_of_more_than_64_rows(arch, tmp_path):
    sets = [a for s in NARROW[arch] + ["vocab_size=512", "intermediate_size=256"] for a in ("--set", s)]
    out = run_bench("bench_graphs.py", "--arch", arch, "--layers", "2", *sets, "--device", "cpu", "--batch", "1,2",
                    "--context", "80", "--steps", "2", "--rounds", "1", "--prepare", "2,128", "--work", str(tmp_path))
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2, out
    assert "span attention" in out and "start-up capture (--max-batch 2" in out


def test_bench_e2e_compares_the_split_with_local_experts():
    out = run_bench("bench_e2e.py", "--device", "cpu", "--runs", "1", "--tokens", "8", "--exchanges", "20")
    split = next(line for line in out.splitlines() if line.startswith("| decode tok/s, split"))
    assert "--experts local, no exchange" in split
    ratio = float(split.rstrip(" |").rsplit("|", 1)[1])
    assert ratio > 0, split  # a ratio of two measured rates (its size is the benchmark's figure, not a test's)
