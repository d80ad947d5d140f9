"""Accuracy harness: what expert deferral costs, against simply skipping the same experts.

    python bench/accuracy.py [--models models/default build/deep-model] [--windows 24] [--len 256]
                             [--plot docs/performance/deferral_cost.png] [--json bench/results/accuracy.json]

Runs held-out text (the models' held-out split of Python's standard library: every 20th file, never
trained on) through both services (real processes, fp32 so the comparison with the reference is
exact), with Score for each mode: exact (defer 0), deferral d = 1..4 (of top-k; at most k - 1), and
skipping those d experts. Reports perplexity, greedy next-token agreement with the exact mode and
next-token accuracy, plus transformers' own perplexity on the same windows as the reference, and
checks that each model's greedy tokens and exact logits equal transformers'.

For models with at least 6 MoE layers (the deep one: tools/train_default_model.py --preset deep) it
also measures how the cost depends on depth: deferral (and skipping) of d experts in only the first,
middle or last third of the MoE layers, in one process (gpu_service.model.model's defer_layers).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import tempfile

import torch

from common import ROOT, Services, windows  # noqa: E402
from moe_exchange import codec  # noqa: E402
from moe_core.config import load_config  # noqa: E402
from protos import generate_pb2  # noqa: E402


def score(stub, win, defer, skip):  # -> logits [len, vocab] fp32
    req = generate_pb2.ScoreRequest(token_ids=generate_pb2.TokenIds(ids=win), defer=defer, skip_deferred=skip)
    return codec.decode(stub.Score(req, timeout=600).logits, "logits")


def evaluate(all_logits, wins, exact_argmax=None):
    nll, n, agree, correct, argmaxes = 0.0, 0, 0, 0, []
    for logits, win in zip(all_logits, wins):
        target = torch.tensor(win[1:])
        lp = logits[:-1].log_softmax(-1)
        nll += float(-lp.gather(1, target[:, None]).sum())
        am = logits[:-1].argmax(-1)
        argmaxes.append(am)
        correct += int((am == target).sum())
        n += len(target)
    if exact_argmax is not None:
        agree = sum(int((a == b).sum()) for a, b in zip(argmaxes, exact_argmax))
    return {"ppl": math.exp(nll / n), "agree": agree / n if exact_argmax is not None else 1.0, "acc": correct / n,
            "tokens": n}, argmaxes


def thirds(cfg) -> dict[str, range]:
    """The MoE layers that can defer (all but the last), in three runs of consecutive layers."""
    moe = list(cfg.moe_layers[:-1])
    cut = [0, len(moe) // 3, 2 * len(moe) // 3, len(moe)]
    names = ("first third", "middle third", "last third")
    return {n: range(moe[cut[i]], moe[cut[i + 1] - 1] + 1) for i, n in enumerate(names)}


def depth_rows(model_dir: str, wins, d: int, exact_am) -> list[dict]:
    """Deferral / skipping of d experts in one third of the layers at a time, in one process (fp32)."""
    from moe_experts.store import load_expert_layers
    from gpu_service.experts.local import LocalExperts
    from gpu_service.model.model import Model, Segment
    from moe_core.checkpoint import Checkpoint

    cfg, ckpt = load_config(model_dir), Checkpoint(model_dir)
    model = Model(cfg, ckpt, torch.device("cpu"), torch.float32)
    experts = LocalExperts(load_expert_layers(cfg, ckpt, "fp32", torch.get_num_threads()))
    rows = []
    for name, layers in [("every layer", None), *thirds(cfg).items()]:
        for skip in (False, True):
            logits = []
            for w in wins:
                seg = Segment(model.new_cache(), torch.tensor(w), 0, all_logits=True)
                logits.append(model.forward([seg], experts, defer=d, skip=skip, defer_layers=layers))
            r, _ = evaluate(logits, wins, exact_am)
            span = "all" if layers is None else f"{layers.start}-{layers.stop - 1}"
            rows.append({"mode": f"{'skip' if skip else 'defer'} {d} of {cfg.top_k}, {name} (layers {span})",
                         "d": d, "skip": skip, "where": name, **r})
    return rows


def matches_transformers(stub, ref, wins, exact_logits, n: int = 32) -> dict:
    """Greedy tokens through the services vs transformers' generate, and the exact mode's logits vs
    transformers' on the first window."""
    prompt = wins[0][:32]
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), max_tokens=n, ignore_eos=True,
                                       sampling=generate_pb2.SamplingParams(temperature=0))
    got = [t for c in stub.Generate(req, timeout=600) for t in c.token_ids]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        diff = float((ref(torch.tensor([wins[0]])).logits[0] - exact_logits).abs().max())
    return {"greedy_tokens_equal": sum(a == b for a, b in zip(got, want)), "greedy_tokens": n,
            "max_abs_logit_diff": diff}


def run_model(model_dir: str, wins, max_defer: int, depth_d: int) -> tuple[list[dict], dict]:
    import transformers
    cfg = load_config(model_dir)
    svc = Services(model_dir, pathlib.Path(tempfile.mkdtemp()), gpu_args=("--dtype", "fp32"),
                   expert_args=("--weight-format", "fp32"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    try:
        exact_logits = [score(svc.stub, w, 0, False) for w in wins]
        exact, exact_am = evaluate(exact_logits, wins)
        rows.append({"mode": "exact (defer 0)", "d": 0, "skip": False, **exact})
        for d in range(1, min(max_defer, cfg.top_k - 1) + 1):
            for skip in (False, True):
                r, _ = evaluate([score(svc.stub, w, d, skip) for w in wins], wins, exact_am)
                rows.append({"mode": f"{'skip' if skip else 'defer'} {d} of {cfg.top_k}", "d": d, "skip": skip, **r})
        check = matches_transformers(svc.stub, ref, wins, exact_logits[0])
    finally:
        svc.stop()
    with torch.no_grad():
        ref_logits = [ref(torch.tensor([w])).logits[0] for w in wins]
    hf, _ = evaluate(ref_logits, wins, exact_am)
    rows.append({"mode": "transformers (reference)", **hf})
    if depth_d and len(cfg.moe_layers) >= 6:
        rows += depth_rows(model_dir, wins, depth_d, exact_am)
    for r in rows:
        r["ppl_change"] = r["ppl"] / exact["ppl"] - 1
        r["agree_drop"] = 1 - r["agree"]
    shape = {"layers": cfg.num_layers, "moe_layers": len(cfg.moe_layers), "experts": cfg.n_routed_experts,
             "top_k": cfg.top_k, "hidden": cfg.hidden_size, **check}
    return rows, shape


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (name, (rows, shape)), color in zip(results.items(), ("tab:blue", "tab:red")):
        label = f"{name} ({shape['layers']} layers, top-{shape['top_k']} of {shape['experts']})"
        for skip, style in ((False, "-o"), (True, "--s")):
            pts = [(r["d"], r) for r in rows if "where" not in r and r.get("d") and r["skip"] == skip]
            xs = [d / shape["top_k"] for d, _ in pts]
            axes[0].plot(xs, [100 * r["ppl_change"] for _, r in pts], style, color=color,
                         label=f"{'skip' if skip else 'defer'}: {label}")
            axes[1].plot(xs, [100 * r["agree_drop"] for _, r in pts], style, color=color)
    axes[0].set_ylabel("perplexity increase vs exact (%)")
    axes[1].set_ylabel("top-1 disagreement with exact (%)")
    axes[0].set_yscale("symlog", linthresh=0.1)  # small changes can be negative (noise)
    for ax in axes:
        ax.set_xlabel("experts deferred or skipped per token (share of top-k)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("What expert deferral costs, against skipping the same experts (held-out Python, fp32)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    deep = ROOT / "build" / "deep-model"
    ap.add_argument("--models", nargs="+",
                    default=[str(ROOT / "models" / "default"), *([str(deep)] if deep.exists() else [])])
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--len", type=int, default=256)
    ap.add_argument("--max-defer", type=int, default=4)
    ap.add_argument("--depth-defer", type=int, default=2, help="d of the depth study (0: none)")
    ap.add_argument("--plot", type=pathlib.Path, help="write the cost-vs-d plot (PNG; needs matplotlib)")
    ap.add_argument("--json", type=pathlib.Path, help="write every row as JSON")
    a = ap.parse_args()
    results = {}
    for m in a.models:
        name = pathlib.Path(m).name
        wins = windows(m, a.windows, a.len)
        results[name] = run_model(m, wins, a.max_defer, a.depth_defer)
        rows, shape = results[name]
        print(json.dumps({"model": name, **shape}), flush=True)
        for r in rows:
            print(json.dumps({"model": name, **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}}),
                  flush=True)
    print(f"\n{a.windows} held-out windows x {a.len} tokens per model, fp32\n")
    print("| model | mode | perplexity | vs exact | top-1 agreement with exact | next-token accuracy |")
    print("|---|---|---|---|---|---|")
    for name, (rows, shape) in results.items():
        for r in rows:
            print(f"| {name} | {r['mode']} | {r['ppl']:.3f} | {r['ppl_change']:+.2%} | {r['agree']:.2%} "
                  f"| {r['acc']:.2%} |")
    for name, (rows, shape) in results.items():
        print(f"{name}: {shape['layers']} layers ({shape['moe_layers']} MoE), top-{shape['top_k']} of "
              f"{shape['experts']}; greedy tokens equal to transformers' {shape['greedy_tokens_equal']}/"
              f"{shape['greedy_tokens']}, exact logits within {shape['max_abs_logit_diff']:.2e} of transformers'")
        by = {(r.get("d"), r.get("skip")): r for r in rows if "where" not in r}
        ratios = [f"d={d}: {by[d, False]['ppl_change'] / by[d, True]['ppl_change']:.2f}"
                  for d in range(1, a.max_defer + 1) if (d, True) in by and by[d, True]["ppl_change"] > 0]
        print(f"  deferral's perplexity cost / skipping's: {', '.join(ratios)}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({n: {"shape": s, "rows": r} for n, (r, s) in results.items()}, indent=1))
    if a.plot:
        plot(results, a.plot)
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
