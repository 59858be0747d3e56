"""Llama-family models from a GGUF file (llama.cpp's format), read with the ``gguf`` package.

A GGUF file holds one model: metadata (the architecture's sizes under ``<arch>.*`` keys, the
tokenizer under ``tokenizer.*``) and tensors, most of them quantised, under llama.cpp's names.
This module turns it into what ``weights.py`` reads from a Hugging Face checkpoint:

- ``read_gguf_config(path)`` -> ``LlamaConfig``. Only the ``llama`` architecture is read
  (Mistral and SmolLM files say ``llama`` too); RoPE must be plain: a scaling type, per-
  frequency factors (``rope_freqs.weight``, as Llama 3.1 files carry) or partial rotation is
  refused by name with ``UnsupportedRopeScalingError``.
- ``read_gguf_weights(path)`` -> every tensor dequantised to float32 numpy by
  ``gguf.quants.dequantize``, under the names of ``LlamaModel``'s state dict. llama.cpp's
  converter permutes the rows of Q and K (it pairs RoPE dims ``(2i, 2i + 1)``, transformers
  pairs ``(i, i + half)``); they are permuted back here, as transformers does.
- ``load_gguf_model(path, dtype=..., device=...)`` -> a ``LlamaModel`` built by
  ``LlamaModel.from_weights``.
- ``read_gguf_metadata(path)``: every key as Python values, for the tokenizer
  (``tokenizer.py``).
- ``write_hf_checkpoint(path, folder, dtype=...)``: a Gemma 3 text file (``gemma3``) as a
  Hugging Face checkpoint (``config.json`` and ``model.safetensors``) for engines that load
  those (vLLM). What the file does not record is what llama.cpp assumes for the
  architecture: every sixth layer global, the others over ``sliding_window``; local RoPE at
  base 10,000; queries scaled by ``1/sqrt(head_dim)``. llama.cpp's converter adds 1 to every
  Gemma norm weight (its RMSNorm multiplies by ``w``, Gemma's by ``1 + w``); it is taken off
  again here. Gemma does not permute Q and K.

Dequantising SmolLM2-135M (Q4_1 and Q8_0) takes about a second on one core, so no weights
are cached on disk; parsing the metadata (its 49k-token vocabulary) takes about two, so the
parse of an unchanged file is kept for the next call in the process (the tokenizer's).
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize

from kvstore.inference_adapter.model import LlamaModel
from kvstore.inference_adapter.weights import LlamaConfig
from kvstore.kernels.rope import UnsupportedRopeScalingError

SUPPORTED_ARCHITECTURES = ("llama",)
EXPORTED_ARCHITECTURES = ("gemma3",)
# llama.cpp's Gemma 3 graph: what a gemma3 file leaves out (llama-model.cpp, LLM_ARCH_GEMMA3)
_GEMMA3_GLOBAL_EVERY = 6  # layers 5, 11, 17, ... attend globally, the rest over the window
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
_GEMMA3_NORM_SHIFT = 1.0  # llama.cpp's converter adds it to every *norm.weight
_ROPE_FACTORS = "rope_freqs.weight"
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

logger = logging.getLogger(__name__)
Metadata = dict[str, object]


def load_gguf_model(
    path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> LlamaModel:
    """Load the Llama model in the GGUF file ``path``.

    Args:
        path: A ``.gguf`` file.
        dtype: Weight dtype; float32 (what the weights are dequantised to) when None.
        device: Where the model lives.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not a GGUF file, an architecture other than llama, a tensor type gguf
            cannot dequantise, or tensors that do not fit the config.
        UnsupportedRopeScalingError: RoPE other than plain (see the module docstring).
    """
    started = time.perf_counter()
    reader = _open(path)
    config = _config(reader)
    weights = {  # cast one at a time: float32 copies of them all would double the peak
        name: torch.from_numpy(array).to(dtype or torch.float32)
        for name, array in _weights(reader, config)
    }
    try:
        model = LlamaModel.from_weights(config, weights, dtype=dtype, device=device)
    except ValueError as error:
        raise ValueError(f"tensors in {path}: {error}") from error
    logger.info("loaded %s in %.1f s", path, time.perf_counter() - started)
    return model


def read_gguf_config(path: str | Path) -> LlamaConfig:
    """The ``LlamaConfig`` of the GGUF file ``path`` (dtype float32: the dequantised weights').

    Raises:
        FileNotFoundError, ValueError, UnsupportedRopeScalingError: As ``load_gguf_model``.
    """
    return _config(_open(path))


def read_gguf_weights(path: str | Path) -> dict[str, npt.NDArray[np.float32]]:
    """Every tensor of the GGUF file ``path``, dequantised to float32, by the name it has in
    ``LlamaModel``'s state dict (``layers.0.self_attn.q_proj.weight``), Q and K un-permuted.

    Raises:
        FileNotFoundError, ValueError, UnsupportedRopeScalingError: As ``load_gguf_model``.
    """
    reader = _open(path)
    return dict(_weights(reader, _config(reader)))


def read_gguf_metadata(path: str | Path) -> Metadata:
    """Every metadata key of the GGUF file ``path``: a str, int, float, bool, or a list.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not a GGUF file.
    """
    return _metadata(_open(path))


def write_hf_checkpoint(
    path: str | Path,
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
) -> Path:
    """The Gemma 3 model in the GGUF file ``path`` as a Hugging Face checkpoint in ``folder``
    (created): ``config.json`` (``Gemma3ForCausalLM``, transformers' ``Gemma3TextConfig``),
    ``model.safetensors`` with every tensor dequantised, then cast to ``dtype``, and with
    ``tokenizer`` the tokenizer's files (``tokenizer.json``, ...).

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not a GGUF file, an architecture other than those in
            ``EXPORTED_ARCHITECTURES``, or a tensor gguf cannot dequantise.
    """
    from safetensors.torch import save_file
    from transformers import Gemma3TextConfig

    reader = _open(path)
    meta = _metadata(reader, vocab=False)
    _architecture(meta, EXPORTED_ARCHITECTURES, "cannot be written as a Hugging Face checkpoint")

    def get(key: str) -> object:
        value = meta.get(f"gemma3.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata needs gemma3.{key}")
        return value

    layers, head_dim = get("block_count"), get("attention.key_length")
    assert isinstance(layers, int) and isinstance(head_dim, int)
    kinds = ("sliding_attention",) * (_GEMMA3_GLOBAL_EVERY - 1) + ("full_attention",)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    settings: dict[str, Any] = {
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": head_dim,
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "sliding_window": get("attention.sliding_window"),
        "layer_types": [kinds[layer % len(kinds)] for layer in range(layers)],
        "query_pre_attn_scalar": head_dim,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": get("rope.freq_base")},
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE},
        },
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", 2),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", 1),
    }
    config = Gemma3TextConfig(**settings)
    config.architectures = ["Gemma3ForCausalLM"]
    config.dtype = dtype
    weights = {}
    for tensor in reader.tensors:
        array = _dequantized(tensor)
        if tensor.name.endswith("norm.weight"):
            array -= _GEMMA3_NORM_SHIFT
        name = f"model.{_hf_name(tensor.name, _GEMMA3_LAYER_NAMES)}"
        weights[name.replace("model.lm_head", "lm_head")] = torch.from_numpy(array).to(dtype)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    save_file(weights, str(folder / "model.safetensors"))
    if tokenizer:  # transformers' reading of the file's vocabulary (about 30 s for Gemma 3)
        from transformers import AutoTokenizer

        source = Path(path)
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(folder)
    logger.info("wrote %s as a %s checkpoint in %s", path, dtype, folder)
    return folder


def _open(path: str | Path) -> GGUFReader:
    """The file's reader, shared by the calls that read the same unchanged file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = path.stat()
    return _reader(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _reader(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    """Parsing the metadata is the slow part of a read (gguf makes a numpy view of each of
    the ~150k values of a 49k-token vocabulary: seconds), so the model and the tokenizer
    of one file share a parse. ``size`` and ``mtime_ns`` key a changed file anew."""
    try:
        return GGUFReader(path)
    except ValueError as error:  # bad magic, an unknown tensor type, ...
        raise ValueError(f"{path} is not a GGUF file this gguf package reads: {error}") from error


def _metadata(reader: GGUFReader, *, vocab: bool = True) -> Metadata:
    """Every key; without ``vocab``, not the tokenizer's long arrays (``tokenizer.ggml.*``)."""
    return {
        name: _value(field)
        for name, field in reader.fields.items()
        if vocab or not name.startswith("tokenizer.ggml.")
    }


def _value(field: ReaderField) -> object:
    """A field as Python values. (``ReaderField.contents`` does this in newer gguf releases.)"""
    parts = [field.parts[index] for index in field.data]
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [part.tobytes().decode("utf-8") for part in parts]
        return [_scalar(part, field.types[-1]) for part in parts]
    if kind == GGUFValueType.STRING:
        return parts[0].tobytes().decode("utf-8")
    return _scalar(parts[0], kind)


def _scalar(part: npt.NDArray[np.generic], kind: GGUFValueType) -> object:
    value = part[0]
    if kind == GGUFValueType.FLOAT32:  # 1e-5 is stored as 9.99999974e-06: read it back as 1e-5
        return float(str(value))
    return value.item()


def _architecture(meta: Metadata, allowed: tuple[str, ...], refusal: str) -> str:
    """The file's architecture when it is one of ``allowed``; else ValueError."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in allowed:
        raise ValueError(f"GGUF architecture {arch!r} {refusal} (supported: {', '.join(allowed)})")
    return arch


def _config(reader: GGUFReader) -> LlamaConfig:
    meta = _metadata(reader, vocab=False)
    arch = _architecture(meta, SUPPORTED_ARCHITECTURES, "is not supported")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if _ROPE_FACTORS in tensors:
        raise UnsupportedRopeScalingError(
            f"{_ROPE_FACTORS} (per-frequency RoPE factors, as Llama 3.1 files carry) is not "
            "supported"
        )
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"mixture of experts ({arch}.expert_count) is not supported")

    def get(key: str, default: object = None) -> object:
        return meta.get(f"{arch}.{key}", default)

    for key in ("embedding_length", "feed_forward_length", "block_count", "attention.head_count"):
        if get(key) is None:
            raise ValueError(f"GGUF metadata needs {arch}.{key}")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length")
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    embeddings = tensors.get("token_embd.weight")
    return LlamaConfig.from_dict(
        {
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": get("feed_forward_length"),
            "num_hidden_layers": get("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": get("attention.head_count_kv"),
            "head_dim": head_dim,
            "vocab_size": get("vocab_size", embeddings and int(embeddings.shape[-1])),
            "max_position_embeddings": get("context_length"),
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
            "rope_theta": get("rope.freq_base", 10000.0),
            "rope_scaling": _rope_scaling(meta, arch, head_dim),
            "tie_word_embeddings": "output.weight" not in tensors,
            "attention_bias": "blk.0.attn_q.bias" in tensors,
            "mlp_bias": "blk.0.ffn_gate.bias" in tensors,
            "dtype": "float32",
        }
    )


def _rope_scaling(meta: Metadata, arch: str, head_dim: object) -> dict[str, object] | None:
    """Hugging Face's ``rope_scaling`` for what the file says, for ``RopeConfig`` to judge."""
    scaling: dict[str, object] = {}
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind != "none":
        scaling |= {"rope_type": kind, "factor": meta.get(f"{arch}.rope.scaling.factor")}
    rotated = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if isinstance(rotated, int) and isinstance(head_dim, int) and rotated != head_dim:
        scaling["partial_rotary_factor"] = rotated / head_dim
    return scaling or None


def _weights(
    reader: GGUFReader, config: LlamaConfig
) -> Iterator[tuple[str, npt.NDArray[np.float32]]]:
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        array = _dequantized(tensor)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _unpermute(array, config.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _unpermute(array, config.num_key_value_heads)
        yield name, array


def _hf_name(name: str, layer_names: dict[str, str] = _LAYER_NAMES) -> str:
    """llama.cpp's tensor name -> ``LlamaModel``'s (or, with Gemma's ``layer_names``,
    ``Gemma3TextModel``'s): ``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``."""
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    match = _LAYER.fullmatch(name)
    if match is None or match[2] not in layer_names:
        raise ValueError(f"GGUF tensor {name!r} has no place in the model")
    return f"layers.{match[1]}.{layer_names[match[2]]}.{match[3]}"


def _dequantized(tensor: ReaderTensor) -> npt.NDArray[np.float32]:
    """The tensor as a writable float32 array in torch's order (GGUF lists dims reversed)."""
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, which the gguf "
            "package cannot dequantise"
        ) from error
    shape = [int(size) for size in reversed(tensor.shape)]
    # float32 already, but read-only (a view of the file's map) for F32 tensors: copy those
    return np.require(array.reshape(shape), dtype=np.float32, requirements=["C", "W"])


def _unpermute(array: npt.NDArray[np.float32], num_heads: int) -> npt.NDArray[np.float32]:
    """Undo llama.cpp's ``permute``: per head, rows ``(2i, 2i + 1)`` back to ``(i, i + half)``.

    ``array``: ``[num_heads * head_dim, ...]``, a weight or a bias."""
    half = array.shape[0] // num_heads // 2
    stored = array.reshape(num_heads, half, 2, *array.shape[1:])  # as llama.cpp wrote it
    return np.ascontiguousarray(stored.swapaxes(1, 2)).reshape(array.shape)
