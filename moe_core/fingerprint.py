"""Model fingerprint: both services derive it from the same checkpoint and refuse to pair
when it differs. Hashes config.json and every tensor's name, shape and dtype (cheap: headers
only, no weight bytes), so two different models or two layouts of one never pair."""
import hashlib
import json

from moe_core.checkpoint import Checkpoint


def fingerprint(ckpt: Checkpoint) -> str:
    h = hashlib.sha256()
    cfg = json.loads((ckpt.dir / "config.json").read_text())
    cfg.pop("transformers_version", None)
    h.update(json.dumps(cfg, sort_keys=True).encode())
    for name in ckpt.tensors():
        shape, dtype = ckpt.meta(name)
        h.update(f"{name}:{shape}:{dtype};".encode())
    return h.hexdigest()[:16]
