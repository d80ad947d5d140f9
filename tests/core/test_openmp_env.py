"""OpenMP's wait policy: our services set OMP_WAIT_POLICY=PASSIVE for their own torch (moe_core/openmp.py), but a
program they or a benchmark start (llama.cpp, whose OpenMP threads then sleep between ops) gets the environment as
the user gave it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import os, gpu_service
from moe_core.openmp import environ_for_others
print(os.environ.get("OMP_WAIT_POLICY"), environ_for_others().get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize("given, ours, others", [(None, "PASSIVE", "None"), ("active", "active", "active")])
def test_the_wait_policy_set_for_our_torch_is_not_passed_on(given, ours, others):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [ours, others]
