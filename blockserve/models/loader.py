"""Load a model to serve from a path, end to end: config, weights and tokenizer, from a Hugging Face
directory or from a GGUF file (read directly, or converted once and cached).

    source      what is loaded
    None        the default model's GGUF (default_model.py), as a .gguf below
    <dir>       config.json + model.safetensors (or a sharded index) + tokenizer files, if any
    <x>.gguf    mapped read-only; its linear layers (and embedding) in the 5-bit, K-quant and IQ4
                formats run from the mapped blocks (gguf_block_linear.py), those in Q4_0 / Q4_1 /
                Q8_0 from packed blocks (quantized_linear.py), stacked MoE experts in any block
                format from the mapped blocks (gguf_block_experts.py), none with a float32 copy.
                A Llama, Mixtral, Mistral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE or Phi-3 (no
                LongRoPE) with a byte-level BPE vocabulary or a SentencePiece one (native_gguf):
                config and tokenizer from the metadata (gguf_config.py, gguf_tokenizer.py,
                gguf_sentencepiece.py, no transformers), every tensor from the file, nothing
                cached. Any other: the config, tokenizer and float32 copies of the tensors in a
                float format are written by transformers to a Hugging Face directory under the
                cache once. Where no kernel
                can run, the block formats are dequantised from the file as it loads

    <cache>/gguf-<stem>-<digest>-f32unblocked/   a converted GGUF (not native_gguf); digest: the first
                                    16 hex digits of the file's SHA-256, so every copy of one file
                                    shares one entry
        config.json  model.safetensors  tokenizer.json  tokenizer_config.json  chat_template.jinja
    <cache>/sources/<key>           a file's digest, remembered per (absolute path, size, mtime)

Tensor parallelism: with a `placement` whose `tp` group is set, this rank builds and loads only its
shard (each checkpoint tensor is narrowed as it is read, models/weights.py); a GGUF's quantized
blocks are narrowed too, by whole rows (column-parallel) or whole 32-wide blocks (row-parallel).

A cache entry is written in a temporary directory and renamed into place, so one that exists
is complete. The cache root is the `cache_dir` argument, else $BLOCKSERVE_CACHE_DIR, else
~/.cache/blockserve (cached_directory.cache_root). Nothing touches the network: every transformers
call is local_files_only; transformers is imported only on the paths that use it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import mmap
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from blockserve.attention.paged_attention import PagedAttention
from blockserve.cached_directory import cache_root, cached_directory
from blockserve.models.default_model import default_model_path
from blockserve.models.gguf_block_linear import KERNEL_FORMATS as BLOCK_FORMATS
from blockserve.models.gguf_block_linear import block_ops, check_blocks, use_block_modules
from blockserve.models.gguf_block_experts import use_block_experts
from blockserve.models.gguf_config import gguf_config, native_config
from blockserve.models.gguf_metadata import LazyArrayReader
from blockserve.models.gguf_tokenizer import GGUFTokenizer, native_vocabulary
from blockserve.models.gpt_oss_gguf import GGML_MXFP4, expert_tensors
from blockserve.models.moe import expert_ops
from blockserve.models.placement import Placement
from blockserve.models.quantized_linear import FORMATS as QUANTIZED_FORMATS
from blockserve.models.quantized_linear import DEFAULT_ACTIVATIONS, measure_max_rows, use_quantized_linears
from blockserve.models.registry import model_class
from blockserve.models.safetensors_reader import read_tensors
from blockserve.models.weight_layout import use_input_major_linears
from blockserve.startup_gc import paused_collection

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_CACHE_LAYOUT = "f32unblocked"  # a cache entry holds float32 copies of the tensors in no block format only
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# llama.cpp tensor names -> Hugging Face module names (per layer under "blk.N.")
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # [H] in the GGUF, [1, H] ours
}
# llama.cpp's stacked experts [E, rows, columns] -> our stacked parameter (gate and up join along dim 1)
_GGUF_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.gate_up_proj",
    "ffn_up_exps": "mlp.experts.gate_up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# per architecture, the layer tensors named otherwise: Phi-3's fused q|k|v and gate|up, Gemma 2's four
# norms, OLMo 2's two post-norms, GLM-4's sandwich norms and fused gate|up
_GGUF_LAYER_BY_ARCH = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "olmo2": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "glm4": {"post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm",
             "ffn_up": "mlp.gate_up_proj"},
    "exaone4": {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                "ffn_gate_inp": "mlp.router"},
}
# GGUF tensors "<kind>.weight" that are bare parameters in the checkpoint (GPT-OSS's sinks [heads])
_GGUF_BARE = ("attn_sinks",)
# the GGUF architectures read here (general.architecture); others are refused, naming these
_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gpt-oss", "phi3", "gemma2",
                       "granite", "olmo2", "glm4", "smollm3", "exaone4")
# architectures whose Q and K rows llama.cpp's converter permutes for its rope kernel (its LlamaModel lineage)
_GGUF_ROPE_PERMUTED = ("llama", "granite", "smollm3")
# architectures transformers' GGUF_CONFIG_MAPPING leaves out whose metadata keys are another's
_GGUF_CONFIG_AS = {"granite": "llama", "olmo2": "llama", "glm4": "llama", "smollm3": "llama", "exaone4": "llama"}
# GGUF's 16-bit tensor types, kept in their dtype in the converted directory
_GGUF_16BIT = {"F16": torch.float16, "BF16": torch.bfloat16}
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight); ours hold w
_GGUF_NORMS_PLUS_ONE = ("gemma2",)
# transformers' model_type of GGUF architectures named otherwise (llama.cpp writes Mixtral as "llama"
# with experts), and the metadata transformers' GGUF_CONFIG_MAPPING leaves out
_GGUF_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "gemma3": "gemma3_text"}
_GGUF_EXTRA_CONFIG = {
    "mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "phi3": {"attention.sliding_window": "sliding_window"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "granite": {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                "logit_scale": "logits_scaling", "attention.scale": "attention_multiplier",
                "rope.dimension_count": None},  # Granite has no head_dim: hidden / heads
    "olmo2": {"rope.dimension_count": None},
    # SmolLM3: no metadata for its NoPE layers; llama.cpp fixes every fourth, transformers' default
    "smollm3": {"rope.dimension_count": None},
    "glm4": {"rope.dimension_count": None, "attention.key_length": "head_dim"},
    "exaone4": {"rope.dimension_count": None, "attention.key_length": "head_dim",
                "attention.sliding_window": "sliding_window"},
    "gpt_oss": {"sliding_window": None, "attention.sliding_window": "sliding_window", "feed_forward_length": None,
                "expert_feed_forward_length": "intermediate_size", "attention.key_length": "head_dim"},
}
# the layers llama.cpp makes sliding-window when a file has no attention.sliding_window_pattern: all but
# every n-th (its set_swa_pattern(n)); EXAONE 4's n is transformers' default
_GGUF_SLIDING_EVERY = {"gpt-oss": 2, "exaone4": 4}


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module  # weights loaded, eval mode
    tokenizer: PreTrainedTokenizerBase | None  # None when the directory ships no tokenizer files
    hf_config: PretrainedConfig
    source: str  # what was loaded, for logs
    # every token id that ends a sequence: generation_config.json's eos_token_id (one or a list), else
    # config.json's; () when neither names one (transformers' generate and vLLM stop on each of them)
    eos_token_ids: tuple[int, ...] = ()


def load_model(source: str | None, attention_backend_cls: type[PagedAttention],
               cache_dir: str | None = None, quantized_matmul: bool = True,
               placement: Placement = Placement(),
               quantized_activations: str = DEFAULT_ACTIVATIONS, quantized_max_rows: int | None = None) -> LoadedModel:
    """Load `source` (a Hugging Face model directory, a .gguf file, or None for the default model).

    quantized_matmul: for a GGUF file, linear layers stored as Q4_0, Q4_1 or Q8_0 run on packed copies
    of those blocks (models/quantized_linear.py), those in the other block formats from the mapped
    file's blocks (models/gguf_block_linear.py), neither with a float32 copy; False: float32 only.
    quantized_activations: those blocks' kernel, "float32" (exact: transformers' logits), "int8"
    (llama.cpp's rounding; every batch size) or "int16" (16-bit rounding).
    quantized_max_rows: float32 and int16: the most rows the blocks serve, the float32 GEMM past
    that; None: measured on this CPU (quantized_linear.measure_max_rows; at most 128 rows on
    AVX-512, 64 on AVX2).
    placement: device, dtype and tensor-parallel group (this rank's shard is loaded).

    FileNotFoundError for a missing path or file; ValueError for an unsupported architecture or
    a corrupt or mismatched checkpoint. Each message says what to do.

    No automatic garbage collection runs during the load (startup_gc.py): its objects are the
    model's, alive as long as it is.
    """
    with paused_collection():
        return _load_model(source, attention_backend_cls, cache_dir, quantized_matmul, placement,
                           quantized_activations, quantized_max_rows)


def _load_model(source: str | None, attention_backend_cls: type[PagedAttention], cache_dir: str | None,
                quantized_matmul: bool, placement: Placement, quantized_activations: str,
                quantized_max_rows: int | None) -> LoadedModel:
    path = default_model_path() if source is None else Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist; pass a Hugging Face model directory "
                                "(config.json + *.safetensors) or a .gguf file")
    if path.is_dir():
        return _load_hf_dir(path, attention_backend_cls, str(path), placement)
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    reader = _gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    end_of_generation = _gguf_end_of_generation_ids(reader, path)
    native = native_gguf(reader, arch)
    if native:  # the config and tokenizer from the metadata; every tensor from the file
        config = gguf_config(reader, arch, _gguf_rope_freq_divisors(reader, arch))
        tokenizer, hf_dir = GGUFTokenizer(reader), None
    else:
        hf_dir = _converted_gguf(path, cache_root(cache_dir))
    reader.fields.clear()  # the rest is in the cache entry, or already read

    def gguf_weights(model: nn.Module, config: PretrainedConfig,
                     cached: Callable[[Callable[[str], bool]], Iterator[tuple[str, torch.Tensor]]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        taken: set[str] = set()
        checked: set[str] = set()  # the block modules see Q4_0 / Q4_1 / Q8_0 tensors before quantized_linear does
        if quantized_matmul and block_ops() is not None:
            taken = use_block_modules(model, _gguf_blocks(reader, arch, config, BLOCK_FORMATS, checked),
                                      quantized_activations)
            if expert_ops() is not None:
                taken |= use_block_experts(model, _gguf_expert_blocks(reader, arch, config), quantized_activations)
        if quantized_matmul:  # before the weights load: no float32 copy of these is ever made
            taken |= use_quantized_linears(model, _gguf_blocks(reader, arch, config, QUANTIZED_FORMATS, checked),
                                           quantized_max_rows, quantized_activations, measure=False)
        streamed = _gguf_tensors(reader, arch, config,
                                 lambda name, tensor: (native or _block_only(tensor)) and name not in taken)
        return itertools.chain(cached(lambda name: name not in taken), streamed)

    widened = Counter(f"{t.tensor_type.name}{' experts' if t.name.split('.')[-2] in _GGUF_EXPERTS else ''}"
                      for t in reader.tensors if t.tensor_type.name != "F32" and not _block_only(t))
    if widened:
        logger.info("%s: tensors widened to float32 (%s): %s", path.name,
                    "read from the file" if native else f"cached in {hf_dir}",
                    ", ".join(f"{count} {kind}" for kind, count in sorted(widened.items())))
    if native:
        model = _built_model(config, attention_backend_cls, placement,
                             lambda model: gguf_weights(model, config, lambda keep: iter(())))
        loaded = LoadedModel(model, tokenizer, config, str(path), _eos_token_ids(None, config))
    else:
        loaded = _load_hf_dir(hf_dir, attention_backend_cls, f"{path} (cached in {hf_dir})", placement, gguf_weights)
    if quantized_matmul and quantized_max_rows is None:
        measure_max_rows(loaded.model, cache_root(cache_dir))
    return replace(loaded, eos_token_ids=tuple(dict.fromkeys((*loaded.eos_token_ids, *end_of_generation))))


# the token ids llama.cpp ends generation on besides eos (its vocabulary's end-of-generation set):
# end of turn, end of message, and the fill-in-the-middle pad / repeat / separator tokens
_GGUF_END_OF_GENERATION = ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")


def _gguf_end_of_generation_ids(reader: gguf.GGUFReader, path: Path) -> tuple[int, ...]:
    """The ids of the file's tokenizer.ggml.{eot,eom,fim_pad,fim_rep,fim_sep}_token_id, which a
    request stops on beside eos as llama.cpp's does. An id outside the vocabulary is dropped with a
    warning naming it (llama.cpp's "bad special token"), never kept."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = None if tokens is None else len(tokens.data)
    ids = []
    for kind in _GGUF_END_OF_GENERATION:
        field = reader.fields.get(f"tokenizer.ggml.{kind}_token_id")
        if field is None:
            continue
        token = int(field.contents())
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            logger.warning("%s: tokenizer.ggml.%s_token_id %d is outside the vocabulary (%s tokens); ignored: "
                           "requests do not stop on it (fix the file's metadata, or pass stop_token_ids)",
                           path.name, kind, token, vocab_size)
            continue
        ids.append(token)
    return tuple(dict.fromkeys(ids))


def check_tensor_parallel(source: str | None, tp_size: int) -> None:
    """ValueError, before any rank starts, if `source` cannot be served over `tp_size` ranks: a
    directory whose family does not shard. (Shapes that do not divide, and a GGUF's blocks that do
    not split into whole 32-wide blocks, are refused as the model is built.)"""
    if tp_size == 1:
        return
    path = default_model_path() if source is None else Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError):
            return  # loading reports it
        model_class(config.architectures).check_tensor_parallel(tp_size)


def gguf_cache_entry(path: Path, root: Path) -> Path:
    """Where the conversion of the GGUF file `path` lives. It is named by the file's content, so
    every copy of one file (each virtual environment's, say) shares one entry, and new content
    gets a new one."""
    return root / f"gguf-{path.stem}-{_content_digest(path, root)}-{_CACHE_LAYOUT}"


def _content_digest(path: Path, root: Path) -> str:
    """The first 16 hex digits of `path`'s SHA-256, read once per path, size and mtime: the digest
    is remembered in root/sources/ (a few bytes a file) where root is writable."""
    stat = path.stat()
    source = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    memo = root / "sources" / hashlib.sha256(source.encode()).hexdigest()[:16]
    if memo.is_file() and _is_digest(remembered := memo.read_text()):
        return remembered
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()[:16]
    try:  # a read-only cache (one shared, already filled) still serves its entries
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{memo.name}-", dir=memo.parent)
        with os.fdopen(fd, "w") as out:
            out.write(digest)
        os.replace(tmp, memo)
    except OSError as error:
        logger.debug("could not remember the digest of %s in %s: %s", path, memo.parent, error)
    return digest


def _is_digest(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def _load_hf_dir(path: Path, attention_backend_cls: type[PagedAttention], description: str,
                 placement: Placement, weights: Callable | None = None) -> LoadedModel:
    """`weights(model, config, read)`: the (name, tensor) pairs to load into the model built, given
    `read(keep)`, the directory's tensors whose names `keep` takes (the others are not read); None:
    the directory's."""
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; a model directory needs config.json, "
                                "*.safetensors weights and tokenizer files (as written by save_pretrained)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"could not read {path / 'config.json'}: {error}") from error
    model = _built_model(config, attention_backend_cls, placement,
                         lambda model: read_model_safetensors(path) if weights is None else
                         weights(model, config, lambda keep: read_model_safetensors(path, keep)))
    tokenizer = None
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, tokenizer, config, description, _eos_token_ids(path, config))


def _built_model(config, attention_backend_cls: type[PagedAttention], placement: Placement,
                 weights: Callable[[nn.Module], Iterator[tuple[str, torch.Tensor]]]) -> nn.Module:
    """The model of `config` built for `placement`, `weights(model)` loaded into it, in eval mode."""
    cls = model_class(list(config.architectures))
    cls.check_tensor_parallel(1 if placement.tp is None else placement.tp.size)
    model = cls(config, attention_backend_cls, placement)
    model.load_weights(weights(model))
    use_input_major_linears(model)
    return model.eval()


def gguf_tokenizer(path: Path) -> GGUFTokenizer | None:
    """The tokenizer of the GGUF file at `path` where the loader reads it from the file's metadata
    (native_gguf), as load_model builds it; None where the file's tokenizer goes through transformers
    (the converted-model cache). ValueError for a file that cannot be read, as load_model's."""
    reader = _gguf_reader(path)
    return GGUFTokenizer(reader) if native_gguf(reader, reader.fields["general.architecture"].contents()) else None


def native_gguf(reader: gguf.GGUFReader, arch: str) -> bool:
    """Whether a GGUF file's config and tokenizer are read here, without transformers
    (models/gguf_config.py, models/gguf_tokenizer.py): a family native_config takes (Llama, Mixtral,
    Mistral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Phi-3 without LongRoPE), with a vocabulary
    GGUFTokenizer builds (byte-level BPE; SentencePiece but Gemma's). Other files are converted once
    through transformers into the cache."""
    return native_config(reader, arch) and native_vocabulary(reader)


def _eos_token_ids(path: Path | None, config: PretrainedConfig) -> tuple[int, ...]:
    """The directory's end-of-sequence ids: generation_config.json's eos_token_id where the file
    names one, else config.json's (either an id or a list of them); `path` None: the config's."""
    eos = getattr(config, "eos_token_id", None)
    generation = None if path is None else path / "generation_config.json"
    if generation is not None and generation.is_file():
        try:
            named = json.loads(generation.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as error:
            raise ValueError(f"could not read {generation}: {error}; fix or remove the file") from error
        eos = eos if named is None else named
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them; got {eos!r}")
    return tuple(dict.fromkeys(ids))


def read_model_safetensors(path: Path, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the model directory `path`'s safetensors (those `keep`
    accepts, where given), one file and one tensor at a time."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors (nor model.safetensors.index.json); "
                                "save the model with save_pretrained to get safetensors weights")
    for name in files:  # one tensor read at a time: a tensor-parallel rank keeps only its shard of each
        try:
            yield from read_tensors(path / name, keep)  # not mapped: only what the model keeps stays resident
        except (ValueError, OSError) as error:
            raise ValueError(f"corrupt weights file {path / name}: {error}; download or save it again") from error


def _converted_gguf(path: Path, root: Path) -> Path:
    """The cache entry for `path`, converting it first unless already cached."""
    return cached_directory(gguf_cache_entry(path, root), lambda out: _convert_gguf(path, out))


def _convert_gguf(path: Path, out: Path) -> None:
    """Write the GGUF file `path` as a Hugging Face directory into `out`: config, tokenizer and, as
    float32, the weights a block kernel does not read (csrc/gguf_blocks.cpp: every format but the
    float ones). Those in a block format, stacked experts included, are read from the file at every
    load instead (dequantised there only where no kernel takes them), so the entry and its first
    writing hold no float32 copy of them."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    reader = _gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    config = _gguf_config(reader, arch)
    tensors = dict(_gguf_tensors(reader, arch, config, lambda name, tensor: not _block_only(tensor)))
    # AutoTokenizer reads the file's config first and refuses architectures transformers' GGUF loader lacks
    tokenizer_class = PreTrainedTokenizerFast if arch in (*_GGUF_CONFIG_AS, "gpt-oss") else AutoTokenizer
    tokenizer = tokenizer_class.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    config.save_pretrained(out)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def _gguf_config(reader: gguf.GGUFReader, arch: str) -> PretrainedConfig:
    """The config from GGUF metadata, renamed by transformers' GGUF_CONFIG_MAPPING as its own GGUF
    loader does for these architectures (without parsing the vocabulary, which is slow), with the
    routing llama.cpp fixes per architecture (GGUF_CONFIG_DEFAULTS_MAPPING: Qwen3-MoE renormalises)."""
    from transformers import AutoConfig
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = _gguf_model_type(reader, arch)
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, f"GGUF architecture {arch!r}")
    model_class([architecture])  # unsupported: fail before the slow part
    mapping = GGUF_CONFIG_MAPPING.get(model_type) or GGUF_CONFIG_MAPPING.get(_GGUF_CONFIG_AS.get(arch, arch))
    if arch not in _GGUF_ARCHITECTURES or mapping is None:
        raise ValueError(f"blockserve serves {architecture} but not from a GGUF file of architecture {arch!r} "
                         f"(GGUF architectures read: {', '.join(_GGUF_ARCHITECTURES)}); load the model's "
                         "Hugging Face directory instead")
    mapping = {**mapping, **_GGUF_EXTRA_CONFIG.get(model_type, {})}
    renames = {f"{arch}.{key}": name for key, name in mapping.items()}
    renames.update({f"tokenizer.{key}": name for key, name in GGUF_CONFIG_MAPPING["tokenizer"].items()})
    values = {name: reader.fields[key].contents() for key, name in renames.items()
              if isinstance(name, str) and key in reader.fields}
    values.setdefault("vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data))
    values["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in reader.tensors)
    values = {**GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}), **values}
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    rotary_dims = reader.fields.get(f"{arch}.rope.dimension_count")
    if arch in ("phi3", "glm4") and rotary_dims is not None and rotary_dims.contents() != head_dim:
        values["partial_rotary_factor"] = rotary_dims.contents() / head_dim  # Phi-4-mini, GLM-4
    names = {tensor.name.split(".", 2)[-1] for tensor in reader.tensors}
    if arch in ("granite", "glm4"):  # biases are tensors, not metadata
        values["attention_bias"] = "attn_q.bias" in names
    if arch == "granite":
        values["mlp_bias"] = "ffn_up.bias" in names
    if arch == "gemma2":  # llama.cpp scales queries by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 27B
        big = values["num_hidden_layers"] == 46
        values["query_pre_attn_scalar"] = values["hidden_size"] // values["num_attention_heads"] if big else head_dim
    if arch == "phi3" and values.get("sliding_window") == 0:  # the converter's "no window" (Phi-4)
        del values["sliding_window"]
    if arch in _GGUF_SLIDING_EVERY and values.get("sliding_window"):
        values["layer_types"] = _gguf_layer_types(reader, arch, values["num_hidden_layers"])
    elif arch == "exaone4":  # no window (EXAONE 4.0-1.2B): every layer global, with RoPE (not the config's default)
        values.update(sliding_window=None, layer_types=["full_attention"] * values["num_hidden_layers"])
    divisors = _gguf_rope_freq_divisors(reader, arch)
    if divisors is not None:  # Llama 3.1+'s and EXAONE 4.0-32B's llama3 scaling, as llama.cpp applies it
        values["rope_freq_divisors"] = divisors
    long_rope = _gguf_long_rope(reader, arch, values["max_position_embeddings"])
    if long_rope is not None:  # Phi-3's LongRoPE: the factors are tensors
        values["rope_parameters"] = {**long_rope, "rope_theta": values.pop("rope_theta")}
        values["original_max_position_embeddings"] = long_rope["original_max_position_embeddings"]
    if arch == "gpt-oss":
        if not values.get("sliding_window"):
            raise ValueError("gpt-oss GGUF without gpt-oss.attention.sliding_window (llama.cpp requires it too); "
                             "convert the model again")
        values["rope_parameters"] = {**_gguf_yarn(reader, arch), "rope_theta": values.pop("rope_theta")}
        if (quantization := _gpt_oss_experts_quantization(reader)) is not None:
            values["quantization_config"] = quantization
    return AutoConfig.for_model(model_type, architectures=[architecture], **values)


def _gguf_layer_types(reader: gguf.GGUFReader, arch: str, num_layers: int) -> list[str]:
    """Each layer's "sliding_attention" / "full_attention" as llama.cpp reads them: the file's
    attention.sliding_window_pattern, one flag a layer or a period n (all but every n-th layer
    slide), else the architecture's period."""
    field = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    pattern = _GGUF_SLIDING_EVERY[arch] if field is None else field.contents()
    if isinstance(pattern, int):
        sliding = [layer % pattern < pattern - 1 for layer in range(num_layers)]
    else:
        sliding = [bool(flag) for flag in pattern]
    if len(sliding) != num_layers:
        raise ValueError(f"{arch} GGUF: attention.sliding_window_pattern has {len(sliding)} entries for "
                         f"{num_layers} layers; the file is malformed: convert the model again")
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def _gguf_rope_freq_divisors(reader: gguf.GGUFReader, arch: str) -> list[float] | None:
    """The file's `rope_freqs` tensor (llama.cpp's per-dimension divisors of the rotary frequencies,
    its converter's form of Llama 3.1's "llama3" scaling) as a list, for rotary.inverse_frequencies;
    None where the file has none or it is all ones (no scaling)."""
    tensors = [tensor for tensor in reader.tensors if tensor.name.rpartition(".")[0] == "rope_freqs"]
    if not tensors:
        return None
    divisors = gguf.quants.dequantize(tensors[0].data, tensors[0].tensor_type).astype(np.float32).ravel()
    if not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise ValueError(f"{arch} GGUF: rope_freqs holds a value that is not a positive number; "
                         "the file is corrupt: convert the model again")
    return None if np.all(divisors == 1) else [float(d) for d in divisors]


def _gguf_long_rope(reader: gguf.GGUFReader, arch: str, max_positions: int) -> dict | None:
    """Phi-3's LongRoPE rope_parameters from its rope_factors_long / rope_factors_short tensors and
    rope.scaling.original_context_length, with the file's rope.scaling.attn_factor where it is not the
    one transformers derives from the two lengths; None for a file without them."""
    factors = {tensor.name.partition(".")[0]: tensor for tensor in reader.tensors
               if tensor.name.startswith("rope_factors_")}
    if not factors:
        return None
    original = reader.fields.get(f"{arch}.rope.scaling.original_context_length")
    if arch != "phi3" or set(factors) != {"rope_factors_long", "rope_factors_short"} or original is None:
        raise ValueError(f"{arch} GGUF: LongRoPE needs rope_factors_long and rope_factors_short tensors and "
                         f"{arch}.rope.scaling.original_context_length (read for phi3 only); got "
                         f"{sorted(factors)}: convert the model again or load its Hugging Face directory")
    lists = {kind: [float(v) for v in gguf.quants.dequantize(factors[f"rope_factors_{kind}"].data,
                                                             factors[f"rope_factors_{kind}"].tensor_type).ravel()]
             for kind in ("long", "short")}
    parameters = {"rope_type": "longrope", "long_factor": lists["long"], "short_factor": lists["short"],
                  "original_max_position_embeddings": int(original.contents())}
    scale = max_positions / parameters["original_max_position_embeddings"]
    derived = math.sqrt(1 + math.log(scale) / math.log(parameters["original_max_position_embeddings"])) \
        if scale > 1 else 1.0
    attn_factor = reader.fields.get(f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None and not math.isclose(attn_factor.contents(), derived, rel_tol=1e-6):
        parameters["attention_factor"] = attn_factor.contents()
    return parameters


def _gguf_yarn(reader: gguf.GGUFReader, arch: str) -> dict:
    """GPT-OSS's rope_parameters: YaRN from rope.scaling.* where the file says so (not truncating its
    correction range, as the released checkpoints' configs), else plain RoPE."""
    kind = reader.fields.get(f"{arch}.rope.scaling.type")
    if kind is None or kind.contents() == "none":
        return {"rope_type": "default"}
    if kind.contents() != "yarn":
        raise ValueError(f"{arch} GGUF: rope.scaling.type {kind.contents()!r} is not read (yarn is)")
    keys = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
            "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}
    parameters = {"rope_type": "yarn", "truncate": False}
    for key, name in keys.items():
        if (field := reader.fields.get(f"{arch}.rope.scaling.{key}")) is not None:
            parameters[name] = field.contents()
    if "factor" not in parameters or "original_max_position_embeddings" not in parameters:
        raise ValueError(f"{arch} GGUF: YaRN needs rope.scaling.factor and rope.scaling.original_context_length")
    return parameters


def _gpt_oss_experts_quantization(reader: gguf.GGUFReader) -> dict | None:
    """{"quant_method": "mxfp4"} where every expert weight is MXFP4 (gpt_oss.py keeps them so), None
    where none is; ValueError for a mix."""
    kinds = {tensor.tensor_type.name == GGML_MXFP4 for tensor in reader.tensors
             if tensor.name.split(".")[-2] in _GGUF_EXPERTS and tensor.name.endswith(".weight")}
    if kinds == {True, False}:
        raise ValueError("gpt-oss GGUF with some expert weights MXFP4 and others not is not read; convert the "
                         "model again with all experts in MXFP4 (llama.cpp's converter) or none")
    return {"quant_method": "mxfp4"} if kinds == {True} else None


def gguf_architectures() -> frozenset[str]:
    """The `architectures` names a GGUF file can be loaded as (llama.cpp's "llama" with experts: Mixtral)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_types = {_GGUF_MODEL_TYPES.get(arch, arch) for arch in _GGUF_ARCHITECTURES} | {"mixtral"}
    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] for t in model_types if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _gguf_model_type(reader: gguf.GGUFReader, arch: str) -> str:
    """transformers' model_type of a GGUF of architecture `arch`."""
    experts = reader.fields.get(f"{arch}.expert_count")
    if arch == "llama" and experts is not None and experts.contents() > 0:
        return "mixtral"
    return _GGUF_MODEL_TYPES.get(arch, arch)


class _CheckedReader(LazyArrayReader):
    """gguf-py's reader (its metadata arrays read on demand, gguf_metadata.py), which first checks
    that each tensor's data lies in the file, after the one before it (`TensorExtentError` naming
    the tensor where it does not)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        extents = []
        for field in fields:  # gguf-py's tensor info: name length, name, dimension count, dims, type, offset
            _, name, _, dims, raw_type, offset = field.parts
            name = bytes(name).decode("utf-8", "replace")
            try:
                values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
            except ValueError:
                raise TensorExtentError(f"GGUF tensor {name}: unknown type {int(raw_type[0])}") from None
            elements = int(np.prod(dims.astype(np.int64)))
            if elements % values:
                raise TensorExtentError(f"GGUF tensor {name}: its shape {dims.tolist()} holds {elements} values, "
                                        f"not a whole number of {gguf.GGMLQuantizationType(int(raw_type[0])).name} "
                                        f"blocks of {values}")
            extents.append((start_offs + int(offset[0]), elements // values * nbytes, name))
        extents.sort()
        for (start, length, name), following in zip(extents, [*extents[1:], None]):
            if following is not None and start + length > following[0]:
                raise TensorExtentError(f"GGUF tensor {name}: its shape needs {length} bytes but the next tensor "
                                        f"({following[2]}) starts {following[0] - start} bytes after it: its block "
                                        "count does not match its shape")
            if start + length > len(self.data):
                raise TensorExtentError(f"GGUF tensor {name}: its {length} bytes at offset {start} run past the end "
                                        f"of the file ({len(self.data)} bytes): the file is truncated")
        super()._build_tensors(start_offs, fields)


class TensorExtentError(ValueError):
    """A GGUF tensor whose data does not fit the file."""


def _gguf_reader(path: Path) -> gguf.GGUFReader:
    """The file mapped read-only (its blocks are used in place)."""
    try:
        reader = _CheckedReader(path)
        reader.fields["general.architecture"].contents()
    except TensorExtentError as error:
        raise ValueError(f"{path}: {error}; download the file again") from None
    except Exception as error:  # the reader raises many kinds on a damaged file
        raise ValueError(f"could not read GGUF file {path} ({error}); it may be truncated or corrupt: "
                         "download it again") from error
    return reader


def _block_only(tensor: gguf.ReaderTensor) -> bool:
    """Whether `tensor` is read from the file's blocks at load rather than cached as float32: every
    block format, stacked experts included (run from their blocks by gguf_block_experts.py, or
    dequantised at load where no kernel takes them)."""
    return tensor.tensor_type.name in BLOCK_FORMATS or tensor.tensor_type.name == GGML_MXFP4


def _gguf_tensors(reader: gguf.GGUFReader, arch: str, config,
                  keep: Callable[[str, gguf.ReaderTensor], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantised tensors under Hugging Face names, those `keep(name, tensor)` takes; stacked
    experts' gate and up joined into one gate_up_proj [E, 2I, H] once both have been read (GPT-OSS's
    into its checkpoint's layout, MXFP4 kept as blocks: gpt_oss_gguf.py)."""
    gate_or_up: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor, rope_heads in _gguf_named(reader, arch, config):
        if not keep(name, tensor):
            continue
        kind = tensor.name.split(".")[-2]
        mxfp4 = tensor.tensor_type.name == GGML_MXFP4
        if arch == "gpt-oss" and kind in _GGUF_EXPERTS and mxfp4:  # raw rows [E, out, 17 bytes a block]
            weights = np.asarray(tensor.data).reshape(*(int(n) for n in reversed(tensor.shape[1:])), -1)
        else:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if rope_heads:
            weights = _unpermute_rope_rows(weights, rope_heads)
        if arch in _GGUF_NORMS_PLUS_ONE and kind.endswith("norm"):
            weights = weights - np.float32(1)
        if arch == "gpt-oss" and kind in _GGUF_EXPERTS:
            halves = gate_or_up.setdefault(name, {})
            halves[kind] = weights
            if kind != "ffn_down_exps" and len(halves) < 2:
                continue
            del gate_or_up[name]
            for hf_name, array in expert_tensors(name, halves, mxfp4):
                yield hf_name, torch.from_numpy(array if mxfp4 else np.array(array, dtype=np.float32))
            continue
        if kind in ("ffn_gate_exps", "ffn_up_exps"):
            halves = gate_or_up.setdefault(name, {})
            halves[kind] = weights
            if len(halves) < 2:
                continue
            del gate_or_up[name]
            weights = np.concatenate([halves["ffn_gate_exps"], halves["ffn_up_exps"]], axis=1)
        elif kind == "ffn_gate_inp_shexp":
            weights = weights.reshape(1, -1)
        weights = torch.from_numpy(np.array(weights, dtype=np.float32))
        # F16 / BF16 matrices back in their 16 bits (exact: the values came from them), so the load keeps
        # them 16-bit where its placement says (models/half_linear.py)
        yield name, weights.to(_GGUF_16BIT[tensor.tensor_type.name]) if (
            tensor.tensor_type.name in _GGUF_16BIT and weights.dim() == 2) else weights


def _gguf_blocks(reader: gguf.GGUFReader, arch: str, config, formats,
                 checked: set[str]) -> Iterator[tuple[str, str, np.ndarray]]:
    """(Hugging Face name, GGUF type, raw blocks [rows, bytes]) of the file's tensors stored in one
    of `formats`, rows in Hugging Face order, checked (check_blocks) unless named in `checked`,
    where each tensor checked is added; views of the mapped file but where rows are unpermuted.
    Stacked experts are not linear layers: _gguf_expert_blocks gives theirs."""
    for name, tensor, rope_heads in _gguf_named(reader, arch, config):
        if tensor.tensor_type.name in formats and tensor.name.split(".")[-2] not in _GGUF_EXPERTS:
            shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists dimensions innermost first
            rows, columns = int(np.prod(shape[:-1])), shape[-1]
            raw = np.asarray(tensor.data)
            if tensor.name not in checked:
                check_blocks(tensor.name, tensor.tensor_type.name, raw, rows, columns)
                checked.add(tensor.name)
            raw = raw.reshape(rows, -1)
            yield name, tensor.tensor_type.name, _unpermute_rope_rows(raw, rope_heads) if rope_heads else raw
            if not name.startswith(_GGUF_TOP["token_embd"]):  # an embedding is read row by row as ids
                _release_pages(reader, tensor)  # appear: dropped, its pages would creep back while serving


def _release_pages(reader: gguf.GGUFReader, tensor: gguf.ReaderTensor) -> None:
    """Drop `tensor`'s pages of the mapped file from this process's memory once its blocks have been
    taken (packed, or kept as views a forward reads whole): the mapping is read-only, so a view read
    later faults them back in from the page cache, and the load's peak holds one tensor's pages, not
    the file's."""
    mapped = getattr(reader.data, "_mmap", None)
    if mapped is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    end = tensor.data_offset + tensor.n_bytes
    mapped.madvise(mmap.MADV_DONTNEED, start, min(end, len(reader.data)) - start)


def _gguf_expert_blocks(reader: gguf.GGUFReader, arch: str, config) -> Iterator[tuple[str, str, np.ndarray]]:
    """("<layer>.mlp.experts.{gate,up,down}", GGUF type, raw blocks [E, rows, row bytes]) of the
    file's stacked experts stored in a block format, checked (check_blocks); views of the mapped file."""
    parts = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}
    for name, tensor, _ in _gguf_named(reader, arch, config):
        kind = tensor.name.split(".")[-2]
        if kind in parts and tensor.tensor_type.name in BLOCK_FORMATS:
            experts, rows, columns = (int(n) for n in reversed(tensor.shape))
            raw = np.asarray(tensor.data)
            check_blocks(tensor.name, tensor.tensor_type.name, raw, experts * rows, columns)
            yield f"{name.rpartition('.')[0]}.{parts[kind]}", tensor.tensor_type.name, raw.reshape(experts, rows, -1)


def _gguf_named(reader: gguf.GGUFReader, arch: str, config) -> Iterator[tuple[str, gguf.ReaderTensor, int | None]]:
    """(Hugging Face name, GGUF tensor, heads whose rows to unpermute or None) for every tensor
    but rope_freqs. llama.cpp permutes the rows of Q and K of the _GGUF_ROPE_PERMUTED architectures for
    its rope kernel; undo it as transformers' GGUF loader does."""
    layer_names = {**_GGUF_LAYER, **_GGUF_LAYER_BY_ARCH.get(arch, {})}
    for tensor in reader.tensors:
        module, _, leaf = tensor.name.rpartition(".")
        parts = module.split(".")
        if module == "rope_freqs" or module.startswith("rope_factors_"):  # rope metadata (_gguf_config)
            continue
        if module in _GGUF_TOP:
            name = f"{_GGUF_TOP[module]}.{leaf}"
        elif len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
            bare = parts[2] in _GGUF_BARE and leaf == "weight"
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}{'' if bare else f'.{leaf}'}"
        elif len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:
            # GPT-OSS's experts have biases: "<...>.gate_up_proj_bias"
            name = f"model.layers.{parts[1]}.{_GGUF_EXPERTS[parts[2]]}{'_bias' if leaf == 'bias' else ''}"
        else:
            raise ValueError(f"GGUF tensor {tensor.name!r} of architecture {arch!r} is not one blockserve reads "
                             f"(GGUF architectures read: {', '.join(_GGUF_ARCHITECTURES)}); load the model's "
                             "Hugging Face directory instead")
        rope_heads = None
        if arch in _GGUF_ROPE_PERMUTED and parts[-1] in ("attn_q", "attn_k"):
            rope_heads = config.num_attention_heads if parts[-1] == "attn_q" else config.num_key_value_heads
        yield name, tensor, rope_heads


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Per head, llama.cpp interleaves the two rotary halves' rows: (2, D/2) -> (D/2, 2). Swap back."""
    head_rows = weights.shape[0] // num_heads
    return weights.reshape(num_heads, head_rows // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
