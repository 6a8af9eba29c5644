"""Generate the Python stubs of `pagedserve/v1/serving.proto` with grpcio-tools.

    python -m pagedserve.proto.generate          # rewrite the committed stubs in place

protoc names imports and the messages' module after the proto's path (`pagedserve.v1`), which
is not where the stubs live once installed; `generate` rewrites both to the installed path
(`pagedserve.proto.pagedserve.v1`), so that imports and pickling by reference work (Serve
pickles each request from its gRPC proxy to the replica). The unit test
`tests/unit/cluster/api/grpc/test_api_proto.py` runs the same function into a temporary directory
and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ("pagedserve/v1/serving.proto",)
INSTALLED_PREFIX = "pagedserve.proto."
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")

# `from pagedserve.v1 import serving_pb2 as ...` → `from pagedserve.proto.pagedserve.v1 import ...`
_IMPORT = re.compile(r"^from (pagedserve\.v\d+) import (\w+_pb2)", re.MULTILINE)
# The module name the message classes are built under (their `__module__`): pickle finds a
# class by it, and Serve pickles requests from its gRPC proxy to the replica.
_MODULE_NAME = re.compile(r"'(pagedserve\.v\d+\.\w+_pb2)'")


def generated_paths(root: Path = PROTO_ROOT) -> list[Path]:
    """Every stub file `generate(root)` writes, in a fixed order."""
    return [
        root / (proto.removesuffix(".proto") + suffix)
        for proto in PROTO_FILES
        for suffix in GENERATED_SUFFIXES
    ]


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on every proto file into `out_dir` and fix the imports.

    Args:
        out_dir: the directory that plays the role of `pagedserve/proto/` (the package root).

    Returns:
        The generated files.

    Raises:
        RuntimeError: protoc failed.
    """
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    paths = generated_paths(out_dir)
    for path in paths:
        text = path.read_text(encoding="utf-8")
        text = _IMPORT.sub(rf"from {INSTALLED_PREFIX}\1 import \2", text)
        text = _MODULE_NAME.sub(rf"'{INSTALLED_PREFIX}\1'", text)
        path.write_text(text, encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="default: in place")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
