"""SmolLM2's tokenizer and chat template from its GGUF file, against transformers' tokenizer
built from the same file, and the multi-turn property ``turn_tokens`` promises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvstore.inference_adapter import Engine, LlamaModel, Request, SamplingParams
from kvstore.inference_adapter.tokenizer import ChatTokenizer
from tests.inference_adapter.conftest import tiny_config, transformers
from tests.inference_adapter.gguf_files import finish, llama_writer

SAMPLE = (
    "Hello world! 12345 + 3.14159 = 12348.14159, at 09:30 on 2024-05-01.\n"
    "  Multiple   spaces,\ttabs\tand\n\n\nnewlines.   \r\n"
    "Unicode: héllo naïve café, Straße, Ωμέγα, Привет, 日本語, 한국어, emoji 🎉👨‍👩‍👧.\n"
    "def f(x: int) -> int:\n    return x ** 2  # squares\n"
    "don't I'll we've THEY'RE <|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>a/b"
)
CONVERSATION = [
    ("What is the capital of Portugal?", "The capital of Portugal is Lisbon."),
    ("And how many people live there?", "About 545,000 people live in the city itself."),
    ("Thanks!  One more: 7 * 6?", "7 * 6 = 42."),
]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name
    )


def messages(turns: int, *, replies: bool = True) -> list[dict[str, str]]:
    chat = []
    for question, answer in CONVERSATION[:turns]:
        chat += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return chat if replies else chat[:-1]


def test_ids_and_sizes(smollm2_tokenizer: ChatTokenizer) -> None:
    tokenizer = smollm2_tokenizer
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.stop_token_ids == (2,)  # <|im_end|> ends a ChatML turn and is EOS
    for token_id, text in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        assert tokenizer.encode(text) == [token_id]
        assert tokenizer.decode([token_id]) == text


def test_encodes_as_transformers_does(smollm2_tokenizer: ChatTokenizer, hf_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode(SAMPLE)
    assert ids == hf_tokenizer.encode(SAMPLE, add_special_tokens=False)
    assert smollm2_tokenizer.decode(ids) == SAMPLE
    assert ids[0] != smollm2_tokenizer.bos_token_id  # no BOS: the file says add_bos_token false


def test_numerals_stand_alone_as_in_llama_cpp(
    smollm2_tokenizer: ChatTokenizer, hf_tokenizer: Any
) -> None:
    """llama.cpp's ``smollm`` pre-tokenizer cuts every numeral (``\\p{N}``) out before GPT-2's
    regex; transformers' GGUF conversion has no ``smollm`` entry and runs GPT-2's regex
    alone. ASCII digits come out the same (no merge in the vocabulary joins a digit to
    anything); a space before another numeral does not."""
    space = smollm2_tokenizer.encode(" ")
    for numeral in ["½", "①", "٣", "Ⅻ"]:
        ids = smollm2_tokenizer.encode(f"x {numeral}")
        assert ids == smollm2_tokenizer.encode("x") + space + smollm2_tokenizer.encode(numeral)
        assert ids != hf_tokenizer.encode(f"x {numeral}", add_special_tokens=False)
    assert smollm2_tokenizer.encode("a 2024") == hf_tokenizer.encode(
        "a 2024", add_special_tokens=False
    )


def test_render_is_the_chat_template(smollm2_tokenizer: ChatTokenizer, hf_tokenizer: Any) -> None:
    chat = messages(2, replies=False)
    text = smollm2_tokenizer.render(chat)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
    assert text == hf_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert not smollm2_tokenizer.render(chat, add_generation_prompt=False).endswith("assistant\n")


def test_turns_and_replies_add_up_to_the_whole_conversation(
    smollm2_tokenizer: ChatTokenizer, hf_tokenizer: Any
) -> None:
    tokenizer = smollm2_tokenizer
    running: list[int] = []
    for turn, (question, answer) in enumerate(CONVERSATION):
        running += tokenizer.turn_tokens(question, first=turn == 0)
        whole = tokenizer.encode(tokenizer.render(messages(turn + 1, replies=False)))
        assert running == whole
        assert whole == hf_tokenizer.apply_chat_template(
            messages(turn + 1, replies=False),
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        running += [*tokenizer.encode(answer), tokenizer.stop_token_ids[0]]
    closed = tokenizer.render(messages(3), add_generation_prompt=False)
    assert running == tokenizer.encode(
        closed.removesuffix("\n")
    )  # the last "\n" is the next turn's


def test_a_chat_with_the_model_appends_turn_tokens(
    smollm2: LlamaModel, smollm2_tokenizer: ChatTokenizer
) -> None:
    """Replies as the model generates them (greedy; closed with <|im_end|> when cut at
    ``max_tokens``) fit the property too: they are what ``encode`` makes of their text."""
    tokenizer = smollm2_tokenizer
    engine = Engine(smollm2, num_pages=16, page_tokens=16)
    sampling = SamplingParams(max_tokens=12, stop_token_ids=tokenizer.stop_token_ids)
    context: list[int] = []
    chat: list[dict[str, str]] = []
    for turn, (question, _) in enumerate(CONVERSATION[:2]):
        context += tokenizer.turn_tokens(question, first=turn == 0)
        chat.append({"role": "user", "content": question})
        assert context == tokenizer.encode(tokenizer.render(chat))
        request = engine.generate([Request(f"turn-{turn}", list(context), sampling)])[0]
        stop = tokenizer.stop_token_ids[0]
        reply = request.output if request.output[-1] == stop else [*request.output, stop]
        context += reply
        chat.append({"role": "assistant", "content": tokenizer.decode(reply[:-1])})


def test_other_tokenizers_are_refused_by_name(tmp_path: Path) -> None:
    for kind, pre, message in [
        ("llama", "default", "GGUF tokenizer 'llama' is not supported"),
        ("gpt2", "qwen2", "GGUF pre-tokenizer 'qwen2' is not supported"),
    ]:
        writer = llama_writer(tmp_path / f"{kind}-{pre}.gguf", tiny_config())
        writer.add_tokenizer_model(kind)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(["a", "b"])
        finish(writer)
        with pytest.raises(ValueError, match=message):
            ChatTokenizer.from_gguf(tmp_path / f"{kind}-{pre}.gguf")
