"""Shared fixtures: tiny checkpoints (built once per session) and both services as real processes on free
localhost ports. The helpers they use, and tests import, are in harness.py."""
from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import tiny_models  # noqa: E402

from harness import Services, Sharded  # noqa: E402

# the services' packed-weight cache: one per test session, never the user's ~/.cache
if "MOE_CACHE_DIR" not in os.environ:
    os.environ["MOE_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MOE_CACHE_DIR"], True)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> fp32 checkpoint dir; deepseek_v3 is split into 3 shards with an index."""
    base = tmp_path_factory.mktemp("ckpt")
    return {f: tiny_models.build(f, base / f, shards=3 if f == "deepseek_v3" else 1) for f in tiny_models.FAMILIES}


@pytest.fixture
def services_factory(tmp_path):
    started = []

    def make(model_dir, **kw):
        d = tmp_path / f"svc{len(started)}"
        d.mkdir()
        s = Services(model_dir, d, **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def sharded(tmp_path):
    """make(model, n, ...) -> a Sharded (n expert services and a GPU service over them), stopped afterwards."""
    made = []

    def make(*a, **kw):
        d = tmp_path / f"s{len(made)}"
        d.mkdir()
        made.append(Sharded(*a, tmp=d, **kw))
        return made[-1]
    yield make
    for s in made:
        s.stop()


def pytest_collection_modifyitems(items):
    for item in items:  # an AddressSanitizer build takes minutes: never in the fast tier
        if item.get_closest_marker("asan"):
            item.add_marker(pytest.mark.slow)
