"""A chat tokenizer built from a GGUF file's metadata: byte-level BPE and its chat template.

A GGUF file carries no ``tokenizer.json``: the vocabulary (``tokenizer.ggml.tokens``), the
merges, each token's type and the chat template are metadata. ``ChatTokenizer.from_gguf``
builds the same tokenizer with the ``tokenizers`` package:

- BPE over the byte-level spelling (GPT-2's byte-to-unicode table) from the vocabulary and
  the merges; no unknown token, no BOS added (``encode`` is the plain text's tokens);
- the pre-tokenizer named by ``tokenizer.ggml.pre``, looked up in ``PRE_TOKENIZERS``
  (SmolLM2's ``smollm``: every numeric character on its own, then GPT-2's split regex, as
  llama.cpp does; transformers' GGUF conversion knows no ``smollm`` and applies GPT-2's
  regex alone, which differs on a space before a non-ASCII numeral such as ``" ½"``);
- control tokens (type 3: ``<|im_start|>``, ``<|im_end|>``, ...) as special tokens, matched
  whole in any text, and user-defined ones (type 4) as plain added tokens.

The chat side: ``render(messages)`` is the GGUF's Jinja chat template in a sandbox;
``turn_tokens(content, first=...)`` is what one more message appends to a running chat, so
that turn tokens, each reply as generated (ending in its stop token) and the next turn's
tokens concatenate to ``encode(render(conversation))``. ``stop_token_ids`` ends a reply: EOS
and the token the template closes an assistant turn with (``<|im_end|>`` in ChatML, which is
SmolLM2's EOS too).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import PreTokenizer

from kvstore.inference_adapter.gguf import read_gguf_metadata

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
_REPLY_PROBE = "\x00kvstore reply probe\x00"  # an assistant reply no template changes


def _gpt2_split() -> PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm_split() -> PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


# ``tokenizer.ggml.pre`` -> how text is cut before BPE.
PRE_TOKENIZERS: dict[str, Callable[[], PreTokenizer]] = {
    "gpt-2": _gpt2_split,
    "smollm": _smollm_split,
}

Message = Mapping[str, str]


class ChatTokenizer:
    """Text to token ids and back, and chat turns rendered by the model's template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_id: int,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self._template = (
            None if chat_template is None else _environment().from_string(chat_template)
        )
        self.end_of_turn_id = self._end_of_turn() if self._template else None

    @classmethod
    def from_gguf(cls, path: str | Path) -> ChatTokenizer:
        """The tokenizer of the GGUF file ``path``.

        Raises:
            FileNotFoundError: No such file.
            ValueError: A tokenizer other than byte-level BPE (``gpt2``), a pre-tokenizer not
                in ``PRE_TOKENIZERS``, or metadata missing.
        """
        meta = read_gguf_metadata(path)
        kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer {kind!r} is not supported (supported: gpt2)")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                f"{', '.join(PRE_TOKENIZERS)})"
            )
        tokens = _strings(meta, "tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type", [])
        if not isinstance(types, list):
            raise ValueError(f"GGUF tokenizer.ggml.token_type must be a list, got {types!r}")
        control = _of_type(tokens, types, CONTROL)
        user_defined = _of_type(tokens, types, USER_DEFINED)
        merges = _strings(meta, "tokenizer.ggml.merges")
        tokenizer = _byte_level_bpe(tokens, merges, verbatim={*control, *user_defined})
        tokenizer.pre_tokenizer = PRE_TOKENIZERS[str(pre)]()
        tokenizer.add_special_tokens([_added(token, special=True) for token in control])
        tokenizer.add_tokens([_added(token, special=False) for token in user_defined])
        eos, bos = meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.bos_token_id")
        if not isinstance(eos, int):
            raise ValueError(f"GGUF metadata in {path} needs tokenizer.ggml.eos_token_id")
        template = meta.get("tokenizer.chat_template")
        return cls(
            tokenizer,
            eos_token_id=eos,
            bos_token_id=bos if isinstance(bos, int) else None,
            chat_template=template if isinstance(template, str) else None,
        )

    @property
    def vocab_size(self) -> int:
        """Token ids are ``0 .. vocab_size - 1``."""
        size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end a reply: EOS, and the template's end of turn when distinct."""
        if self.end_of_turn_id is None or self.end_of_turn_id == self.eos_token_id:
            return (self.eos_token_id,)
        return (self.eos_token_id, self.end_of_turn_id)

    def encode(self, text: str) -> list[int]:
        """The tokens of ``text``; special tokens spelled out in it become their ids."""
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens included."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        return text

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the chat template writes it.

        Args:
            messages: ``{"role": ..., "content": ...}`` mappings, oldest first.
            add_generation_prompt: End with the opening of an assistant reply.

        Raises:
            ValueError: The file has no chat template, or the template refused the messages.
        """
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        try:
            return self._template.render(
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token(self.bos_token_id),
                eos_token=self._token(self.eos_token_id),
            )
        except jinja2.TemplateError as error:  # raise_exception(), or the sandbox said no
            raise ValueError(f"the chat template refused the messages: {error}") from error

    def turn_tokens(self, content: str, *, first: bool, role: str = "user") -> list[int]:
        """The tokens a chat appends for one more message, up to the opening of the reply.

        ``first``: the chat's first message (with it come whatever the template puts before,
        such as a default system message). Otherwise the tokens follow a reply that ended with
        its stop token: ``turn_tokens(m1, first=True) + reply1 + turn_tokens(m2, first=False)
        + ...`` is ``encode(render([...]))`` of the whole conversation, token for token, when
        each reply is what ``encode`` makes of its text.

        Raises:
            ValueError: No chat template, or one that writes earlier turns differently once a
                message follows them (no prefix to append to).
        """
        message = {"role": role, "content": content}
        if first:
            return self.encode(self.render([message]))
        probe: list[Message] = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _REPLY_PROBE},
        ]
        before = self.render(probe, add_generation_prompt=False)
        after = self.render([*probe, message])
        if self.end_of_turn_id is None:
            raise ValueError("the chat template ends a reply with no special token")
        end = before.index(_REPLY_PROBE) + len(_REPLY_PROBE) + len(self._token(self.end_of_turn_id))
        if not after.startswith(before[:end]):
            raise ValueError("the chat template rewrites earlier turns: nothing to append to")
        return self.encode(after[end:])

    def _end_of_turn(self) -> int | None:
        """The special token the template writes right after an assistant reply, if any."""
        probe: list[Message] = [{"role": "assistant", "content": _REPLY_PROBE}]
        text = self.render(probe, add_generation_prompt=False)
        ids = self.encode(text[text.index(_REPLY_PROBE) + len(_REPLY_PROBE) :])
        special = self._tokenizer.get_added_tokens_decoder()
        return ids[0] if ids and ids[0] in special and special[ids[0]].special else None

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else str(self._tokenizer.id_to_token(token_id))


def _environment() -> ImmutableSandboxedEnvironment:
    """Jinja as transformers sets it up for chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def _byte_level_bpe(tokens: list[str], merges: list[str], *, verbatim: set[str]) -> Tokenizer:
    """BPE over the byte-level spelling; ``verbatim`` tokens (the added ones, matched whole by
    their text) keep theirs, so adding them finds their ids."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if token in verbatim or set(token) <= alphabet else _respelled(token, spelling): index
        for index, token in enumerate(tokens)
    }
    pairs = [_pair(merge) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _respelled(token: str, spelling: Mapping[int, str]) -> str:
    """A token the file stores as plain text, in the byte alphabet its merges use."""
    return "".join(spelling[byte] for byte in token.encode("utf-8"))


def _pair(merge: str) -> tuple[str, str]:
    left, space, right = merge.partition(" ")
    if not (left and space and right):
        raise ValueError(f"GGUF merge {merge!r} is not two tokens")
    return left, right


def _of_type(tokens: list[str], types: list[object], kind: int) -> list[str]:
    return [token for token, token_type in zip(tokens, types, strict=False) if token_type == kind]


def _added(token: str, *, special: bool) -> AddedToken:
    return AddedToken(token, special=special, normalized=False)


def _strings(meta: Mapping[str, object], key: str) -> list[str]:
    value = meta.get(key)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"GGUF metadata needs {key}, a list of strings")
    return value


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens in it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {byte: chr(byte) for byte in printable}
    extra = (byte for byte in range(256) if byte not in table)
    for offset, byte in enumerate(extra):
        table[byte] = chr(256 + offset)
    return dict(sorted(table.items()))
