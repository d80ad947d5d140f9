"""Read-only, memory-mapped access to a checkpoint's safetensors shards.

One shard (model.safetensors) or several (model.safetensors.index.json). Tensors are read
one at a time from the mmap'ed files, never the whole checkpoint into Python objects.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from .config import ModelConfigError


class Checkpoint:
    def __init__(self, model_dir: str | pathlib.Path):
        self.dir = pathlib.Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ModelConfigError(f"no *.safetensors files in {self.dir}")
            weight_map = {}
            for f in files:
                with safe_open(f, framework="pt") as h:
                    weight_map.update({k: f.name for k in h.keys()})
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}
        self._stack = contextlib.ExitStack()

    def _handle(self, fname: str):
        if fname not in self._handles:
            path = self.dir / fname
            if not path.exists():
                raise ModelConfigError(f"shard {path} named in the index is missing")
            self._handles[fname] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[fname]

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self, keep: Callable[[str], bool] = lambda n: True) -> Iterator[str]:
        return (n for n in sorted(self.weight_map) if keep(n))

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ModelConfigError(f"tensor {name!r} is missing from the checkpoint in {self.dir}")
        return self._handle(self.weight_map[name]).get_tensor(name)

    def meta(self, name: str) -> tuple[list[int], str]:
        s = self._handle(self.weight_map[name]).get_slice(name)
        return list(s.get_shape()), s.get_dtype()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()
