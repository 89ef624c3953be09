"""What ``scripts/_venv.sh`` asks of a Python before it trusts the torch already there.

    python scripts/_deps.py [--cuda]              exit 0 if this Python's torch is one the project
                                                  supports (a CUDA build with --cuda), else say why
    python scripts/_deps.py --requirements FILE   the dependencies in pyproject FILE, torch left out
    python scripts/_deps.py --unmet FILE          those of them not installed at their lower bound
    python scripts/_deps.py --check-imports FILE  which of them cannot be imported: exit 1 if the
                                                  engine needs one on every run, warn for the rest

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Imported by the engine or the zoo at module level, so every run needs them; the rest are imported
# where a feature uses them (wandb, TensorBoard, diffusers' folders, PyG references in tests).
EVERY_RUN = {"transformers", "tokenizers", "safetensors", "pyyaml", "torchdata", "webdataset", "numpy", "pillow"}
MODULE = {"pyyaml": "yaml", "pillow": "PIL", "torch_geometric": "torch_geometric", "torch-geometric": "torch_geometric"}


def torch_fits(need_cuda: bool) -> str | None:
    """None if this Python's torch is supported, else the reason it is not."""
    try:
        import torch
    except ImportError:
        return "no torch installed"
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    low, high = supported_torch(str(PYPROJECT))
    if not low <= version < high:
        return f"torch {torch.__version__} is outside the supported {low[0]}.{low[1]} <= torch < {high[0]}.{high[1]}"
    if need_cuda and not torch.version.cuda:
        return f"torch {torch.__version__} is not a CUDA build"
    return None


def supported_torch(pyproject: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``(lowest, first unsupported)`` minor versions from the torch requirement of ``pyproject``
    (``torch>=2.11,<2.16``): the range lives in one place, the project's dependency list."""
    project = tomllib.load(open(pyproject, "rb"))["project"]
    spec = next(req for req in project["dependencies"] if _name(req) == "torch")
    low, high = (re.search(op + r"\s*(\d+)\.(\d+)", spec) for op in (">=", "<"))
    return (int(low[1]), int(low[2])), (int(high[1]), int(high[2]))


def requirements(pyproject: str) -> list[str]:
    project = tomllib.load(open(pyproject, "rb"))["project"]
    wanted = project["dependencies"] + project.get("optional-dependencies", {}).get("dev", [])
    return [req for req in wanted if _name(req) != "torch"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower()


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def unmet(pyproject: str) -> list[str]:
    """The requirements not installed at their lower bound (``>=``, the only bound they use)."""
    out = []
    for req in requirements(pyproject):
        bound = re.search(r">=\s*([\w.]+)", req)
        try:
            have = importlib.metadata.version(_name(req))
        except importlib.metadata.PackageNotFoundError:
            out.append(req)
            continue
        if bound and _version(have) < _version(bound.group(1)):
            out.append(req)
    return out


def missing_imports(pyproject: str) -> tuple[list[str], list[str]]:
    """(needed on every run, needed by some feature): the requirements this Python cannot import."""
    absent = [name for name in map(_name, requirements(pyproject))
              if importlib.util.find_spec(MODULE.get(name, name.replace("-", "_"))) is None]
    return [n for n in absent if n in EVERY_RUN], [n for n in absent if n not in EVERY_RUN]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--requirements", metavar="PYPROJECT")
    parser.add_argument("--unmet", metavar="PYPROJECT")
    parser.add_argument("--check-imports", metavar="PYPROJECT")
    args = parser.parse_args()
    if args.requirements or args.unmet:
        print("\n".join(requirements(args.requirements) if args.requirements else unmet(args.unmet)))
        return 0
    if args.check_imports:
        needed, optional = missing_imports(args.check_imports)
        if optional:
            print(f"[venv] not installed, needed only by the features that use them: {', '.join(optional)}",
                  file=sys.stderr)
        if needed:
            print(f"[venv] not installed, and every run needs them: {', '.join(needed)}. Without network, bring "
                  "them as wheels (pip download --no-deps --only-binary=:all: NAME==VERSION on a machine that has "
                  "network) and set VEOMNI_WHEELS=FOLDER; see docs/performance.md, 'The GPU check'", file=sys.stderr)
            return 1
        return 0
    reason = torch_fits(args.cuda)
    if reason:
        print(reason, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
