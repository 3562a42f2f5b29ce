"""The wheels ``benchmarks/gpu_e2e.py`` needs on a GPU machine without network: what logra-pl needs and its image lacks.

A GPU machine without network (one H200 was measured: docs/benchmarks.md "On a GPU") has torch, transformers, lightning,
peft, tensorboard, matplotlib and many other packages, but no network. logra-pl's other requirements (reasoning-gym and
its puzzle libraries, jsonargparse, pebble, math-verify, datasets, ...) travel with the checkout as a folder of wheels.
This script builds that folder on a machine with network:

1. It walks logra-pl's requirements (``pyproject.toml``'s ``[project].dependencies``, extras included), evaluating
   markers for the target interpreter (``--python-version``, Linux x86-64), and stops at every distribution the target
   image already has (``--have``: a ``pip list``/``pip freeze`` of the target, or this script's list of the measured
   H200 image). Each distribution it keeps is pinned to the version installed *here*, the version the tests ran with.
2. ``pip download --no-deps --only-binary=:all:`` fetches those pins as wheels for the target platform; a
   distribution published only as a source archive is built here with ``pip wheel --no-deps`` (pure Python ones only:
   a wheel tagged for this interpreter's ABI is refused).
3. It writes ``requirements.txt`` (the pins) beside the wheels and refuses a folder over ``--max-mib`` (the device
   tool carries at most 64 MiB of working tree per call).

Run here, from the checkout's root, then install there without network (docs/benchmarks.md, "On a GPU")::

    python benchmarks/gpu_wheels.py --out .whl            # needs network and logra-pl's dependencies installed here
    python3 -m pip install -q --no-index --no-deps --no-compile --no-build-isolation --find-links .whl \\
        --target /tmp/site -r .whl/requirements.txt && export PYTHONPATH=/tmp/site   # there

The wheels are installed with ``--no-deps`` into their own folder, so the image's packages are never replaced. A
source archive is built there with the image's setuptools (``--no-build-isolation``: no network to fetch a build
backend), its C compiler and Python headers.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024**2

# The Python distributions of the measured H200 image ('cuda'), as listed on 2026-11-17. Only
# names matter: a distribution listed here is taken from the image, whatever its version there.
H200_IMAGE = """  # whitespace-separated
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
# manylinux tags pip must be told one by one (it matches each exactly); 2_17 … 2_39 cover today's wheels.
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(path: str | None) -> set[str]:
    """Distribution names the target already has: a ``pip list``/``pip freeze`` file, or :data:`H200_IMAGE`."""
    if path is None:
        return {canonical(n) for n in H200_IMAGE.split()}
    names = set()
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "Package", "---")):
            continue
        names.add(canonical(re.split(r"[\s=<>!~@]", line, maxsplit=1)[0]))
    return names


@dataclass
class Closure:
    """The distributions to carry, pinned, and why each is needed (its first requirer)."""

    pins: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    missing_here: list[str] = field(default_factory=list)


def marker_env(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of the target: CPython ``python_version`` on Linux x86-64."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }


def applies(req: Requirement, extras: set[str], env: dict[str, str]) -> bool:
    """Whether ``req`` is needed on the target when its parent was asked for with ``extras``."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": extra}) for extra in (extras or {""}))


def closure(roots: list[str], have: set[str], python_version: str) -> Closure:
    """Every distribution reachable from ``roots`` that the target lacks, pinned to the version installed here."""
    env = marker_env(python_version)
    out = Closure()
    queue = [(Requirement(r), "logra-pl") for r in roots]
    seen: dict[str, set[str]] = {}
    while queue:
        req, parent = queue.pop(0)
        name = canonical(req.name)
        if name in have or name == "logra-pl":
            continue
        wanted = set(req.extras)
        if name in seen and wanted <= seen[name]:
            continue
        seen[name] = seen.get(name, set()) | wanted
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            out.missing_here.append(f"{req} (needed by {parent})")
            continue
        out.pins[name] = dist.version
        out.why.setdefault(name, parent)
        for text in dist.requires or []:
            child = Requirement(text)
            if applies(child, seen[name], env):
                queue.append((child, f"{name} {dist.version}"))
    return out


def project_requirements() -> list[str]:
    """``[project].dependencies`` of this checkout's ``pyproject.toml``."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def download(pins: dict[str, str], out: Path, python_version: str) -> tuple[list[str], list[str]]:
    """Fetch each pin for the target: its wheel; else a wheel built here from a pure-Python source archive; else the
    source archive itself, built there at install time. Returns (failures, pins carried as source)."""
    target = ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
    target += [arg for p in PLATFORMS for arg in ("--platform", p)]
    failed, sources = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, version in sorted(pins.items()):
            spec = f"{name}=={version}"
            if pip("download", "--no-deps", "--quiet", "-d", str(out), *target, spec).returncode == 0:
                continue
            built = Path(tmp) / name
            pip("wheel", "--no-deps", "--quiet", "-w", str(built), spec)
            pure = sorted(built.glob("*-none-any.whl"))
            if pure:
                shutil.move(pure[0], out / pure[0].name)
                continue
            # An extension module without a wheel for the target (pycosat: source only on PyPI): carried as source.
            got = pip("download", "--no-deps", "--quiet", "--no-binary=:all:", "-d", str(out), spec)
            if got.returncode == 0:
                sources.append(spec)
            else:
                failed.append(f"{spec}: {got.stderr.strip().splitlines()[-1:]}")
    return failed, sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".whl", help="wheel folder to write (default .whl, ignored by git)")
    parser.add_argument("--have", default=None, help="pip list/freeze of the target; default: the measured H200 image")
    parser.add_argument("--python-version", default="3.12", help="target interpreter (default 3.12: the H200 image)")
    parser.add_argument("--max-mib", type=float, default=48.0, help="refuse a folder larger than this (default 48)")
    parser.add_argument("--dry-run", action="store_true", help="print the pins, download nothing")
    args = parser.parse_args(argv)

    found = closure(project_requirements(), read_have(args.have), args.python_version)
    if found.missing_here:
        print("not installed here (install logra-pl's dependencies first):", *found.missing_here, sep="\n  ")
        return 2
    for name, version in sorted(found.pins.items()):
        print(f"{name + '==' + version:<36} needed by {found.why[name]}")
    if args.dry_run:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed, sources = download(found.pins, out, args.python_version)
    if failed:
        print("neither a wheel nor a source archive for the target:", *failed, sep="\n  ")
        return 1
    (out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(found.pins.items())))
    files = sorted(p for p in out.iterdir() if p.name != "requirements.txt")
    size = sum(p.stat().st_size for p in files) / MiB
    print(f"{len(files)} files, {size:.1f} MiB in {out}/ (+ requirements.txt)")
    if sources:
        print("built at install time from source (a C compiler and the Python headers there):", ", ".join(sources))
    if size > args.max_mib:
        print(f"over --max-mib {args.max_mib}: the device tool carries at most 64 MiB of working tree per call")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
