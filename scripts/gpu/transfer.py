"""Carry a file larger than one transfer to a remote GPU machine in parts, checked by sha256.

A development script (not installed). A call to the GPU machine carries at most 64 MiB with the
working tree (about 35 MB), so SmolLM2's 94 MiB GGUF goes in parts over consecutive calls; files
written outside the repository there stay while the machine is warm::

    python scripts/gpu/transfer.py split FILE .gpu/parts --part-mib 27   # here, once
    python scripts/gpu/transfer.py receive .gpu/parts /tmp/dflash2-gpu   # there, each call
    python scripts/gpu/transfer.py join /tmp/dflash2-gpu FILE_OUT        # there, after the last

``split`` writes the parts and ``manifest.json`` (the file's and each part's sha256); ``receive``
copies the parts present (each checked) next to the manifest; ``join`` rebuilds the file and
refuses it unless every part is there and the whole matches its sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

from dflash2.errors import CorruptCheckpointError

MANIFEST = "manifest.json"


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def split(file: Path, directory: Path, part_bytes: int) -> list[Path]:
    """Cut ``file`` into parts of at most ``part_bytes`` in ``directory``, with a manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    parts: list[Path] = []
    with file.open("rb") as f:
        while block := f.read(part_bytes):
            part = directory / f"{file.name}.part{len(parts)}"
            part.write_bytes(block)
            parts.append(part)
    manifest = {
        "name": file.name,
        "size": file.stat().st_size,
        "sha256": sha256(file),
        "parts": [{"name": p.name, "sha256": sha256(p)} for p in parts],
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return parts


def receive(source: Path, store: Path) -> list[str]:
    """Copy the manifest and every intact part present in ``source`` to ``store``; the names copied."""
    manifest = json.loads((source / MANIFEST).read_text())
    store.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source / MANIFEST, store / MANIFEST)
    copied = []
    for part in manifest["parts"]:
        path = source / part["name"]
        if path.is_file():
            if sha256(path) != part["sha256"]:
                raise CorruptCheckpointError(f"{path} does not match its sha256 in the manifest; split again.")
            shutil.copyfile(path, store / part["name"])
            copied.append(part["name"])
    return copied


def join(store: Path, out: Path) -> Path:
    """Rebuild the file of ``store``'s manifest at ``out``, checked part by part and whole."""
    manifest = json.loads((store / MANIFEST).read_text())
    missing = [p["name"] for p in manifest["parts"] if not (store / p["name"]).is_file()]
    if missing:
        raise CorruptCheckpointError(f"parts not received yet: {', '.join(missing)}; send them first.")
    tmp = out.with_name(out.name + ".partial")
    with tmp.open("wb") as sink:
        for part in manifest["parts"]:
            path = store / part["name"]
            if sha256(path) != part["sha256"]:
                raise CorruptCheckpointError(f"{path} is damaged (sha256 differs); send it again.")
            sink.write(path.read_bytes())
    if sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise CorruptCheckpointError(f"{manifest['name']} rebuilt from its parts does not match its sha256.")
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu/transfer.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("split")
    cut.add_argument("file", type=Path)
    cut.add_argument("directory", type=Path)
    cut.add_argument("--part-mib", type=float, default=27.0)
    take = sub.add_parser("receive")
    take.add_argument("source", type=Path)
    take.add_argument("store", type=Path)
    glue = sub.add_parser("join")
    glue.add_argument("store", type=Path)
    glue.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "split":
        parts = split(args.file, args.directory, round(args.part_mib * 2**20))
        print(f"{len(parts)} parts in {args.directory}: {', '.join(p.name for p in parts)}")
    elif args.command == "receive":
        print(f"received into {args.store}: {', '.join(receive(args.source, args.store)) or 'nothing'}")
    else:
        print(f"rebuilt {join(args.store, args.out)} (sha256 checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
