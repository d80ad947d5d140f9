"""Bad model directories, unsupported architectures and mismatched peers: a clear message and a
non-zero exit, never a traceback."""
import json
import shutil
import socket
import subprocess
import sys

import pytest

from harness import ROOT, free_port, start, wait_healthy


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def assert_clean_failure(p, needle):
    assert p.returncode != 0
    assert needle in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
def test_missing_model_dir(tmp_path):
    for mod in ("expert_service", "gpu_service"):
        assert_clean_failure(run_cli(mod, "--model", str(tmp_path / "nope")), "does not exist")


@pytest.mark.slow
def test_not_a_checkpoint(tmp_path):
    assert_clean_failure(run_cli("expert_service", "--model", str(tmp_path)), "config.json")


def test_unsupported_architecture(tmp_path, checkpoints):
    d = tmp_path / "llama"
    shutil.copytree(checkpoints["mixtral"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    for mod in ("expert_service", "gpu_service"):
        assert_clean_failure(run_cli(mod, "--model", str(d)), "unsupported architecture")


def test_mismatched_fingerprints_refuse_to_pair(tmp_path, checkpoints):
    port = free_port()
    expert = start("expert_service", "--model", str(checkpoints["mixtral"]), "--listen", f"127.0.0.1:{port}",
                   "--threads", "1", log=tmp_path / "e.log")
    try:
        wait_healthy(port, expert)
        p = run_cli("gpu_service", "--model", str(checkpoints["qwen3_moe"]), "--experts", f"127.0.0.1:{port}",
                    "--listen", f"127.0.0.1:{free_port()}")
        assert_clean_failure(p, "model mismatch")
    finally:
        expert.terminate()
        expert.wait(10)


@pytest.mark.slow
def test_a_taken_port_is_refused_not_shared(checkpoints):
    # held the way grpc's own servers hold theirs (SO_REUSEPORT): a service that also set it would bind beside
    # it and get only some of the connections
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for mod, extra in (("expert_service", ()), ("gpu_service", ("--experts", f"127.0.0.1:{free_port()}"))):
            p = run_cli(mod, "--model", str(checkpoints["mixtral"]), "--listen", f"127.0.0.1:{port}", *extra)
            assert_clean_failure(p, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.slow
def test_expert_service_never_up(tmp_path, checkpoints):
    p = run_cli("gpu_service", "--model", str(checkpoints["mixtral"]), "--experts", f"127.0.0.1:{free_port()}",
                "--connect-timeout", "1")
    assert_clean_failure(p, "not ready")


@pytest.mark.parametrize("model_type", ["llama4", "kimi_linear"])
def test_families_not_supported_yet_are_refused_by_name(model_type, checkpoints):
    from moe_core.config import ModelConfigError, parse_config

    raw = {**json.loads((checkpoints["mixtral"] / "config.json").read_text()), "model_type": model_type}
    with pytest.raises(ModelConfigError, match=f"unsupported architecture model_type='{model_type}'"):
        parse_config(raw)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]}, "layer_types"),
    ({"attn_output_gate": False}, "attn_output_gate=false is not supported"),
    ({"linear_num_value_heads": 3}, "not a multiple"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_hybrid_variants_that_do_not_fit_are_refused(change, message, checkpoints):
    from moe_core.config import ModelConfigError, parse_config

    raw = {**json.loads((checkpoints["qwen3_next"] / "config.json").read_text()), **change}
    with pytest.raises(ModelConfigError, match=message):
        parse_config(raw)
    wrapped = json.loads((checkpoints["qwen3_5_moe"] / "config.json").read_text())
    wrapped["text_config"].update(change)
    with pytest.raises(ModelConfigError, match=message):
        parse_config(wrapped)


def test_gpt_oss_layer_types_must_name_each_layer(checkpoints):
    from moe_core.config import ModelConfigError, parse_config

    raw = {**json.loads((checkpoints["gpt_oss"] / "config.json").read_text()), "layer_types": ["chunked_attention"] * 3}
    with pytest.raises(ModelConfigError, match="layer_types"):
        parse_config(raw)


def test_minimax_routing_other_than_sigmoid_is_refused(checkpoints):
    from moe_core.config import ModelConfigError, parse_config

    raw = {**json.loads((checkpoints["minimax_m2"] / "config.json").read_text()), "scoring_func": "softmax"}
    with pytest.raises(ModelConfigError, match="scoring_func='softmax'"):
        parse_config(raw)


@pytest.mark.parametrize("experts, top_k", [(512, 257), (8, 9), (8, 0)])
def test_top_k_is_bounded_by_the_experts_and_the_kernels(checkpoints, experts, top_k):
    """One k limit: a model's num_experts_per_tok, at most its experts and the native kernels' MAX_K."""
    from moe_core.config import MAX_TOP_K, ModelConfigError, parse_config
    from moe_kernels import native

    assert native.MAX_K == MAX_TOP_K
    raw = {**json.loads((checkpoints["qwen3_moe"] / "config.json").read_text()), "num_experts": experts,
           "num_experts_per_tok": top_k}
    with pytest.raises(ModelConfigError, match="top-k"):
        parse_config(raw)
