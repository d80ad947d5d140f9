"""Regenerate protos/*_pb2*.py from protos/*.proto (run from anywhere): python -m moe_core.gen_protos

`--check` compares freshly generated code with the checked-in files and exits 1 if stale.
"""
import argparse
import filecmp
import pathlib
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "protos").glob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    import grpc_tools  # a development tool's (grpcio-tools, the test extras), not the services'

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}"] + [str(p.relative_to(ROOT)) for p in PROTOS]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_names(d: pathlib.Path) -> list[str]:
    return sorted(p.name for p in (d / "protos").glob("*_pb2*.py*"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if the checked-in code is stale")
    args = ap.parse_args()
    if not args.check:
        generate(ROOT)
        print("generated:", ", ".join(generated_names(ROOT)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        generate(tmp)
        fresh, ours = generated_names(tmp), generated_names(ROOT)
        stale = [n for n in fresh if n not in ours or not filecmp.cmp(tmp / "protos" / n, ROOT / "protos" / n, shallow=False)]
        stale += [n for n in ours if n not in fresh]
        if stale:
            print("stale generated code:", ", ".join(stale), "- run: python -m moe_core.gen_protos")
            sys.exit(1)
        print("generated code is up to date")


if __name__ == "__main__":
    main()
