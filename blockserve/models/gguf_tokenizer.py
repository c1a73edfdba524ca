"""A GGUF file's tokenizer built from its vocabulary with the `tokenizers` library directly, without
transformers, as transformers' GGUF loader builds it. Byte-level BPE (`tokenizer.ggml.model` "gpt2":
Llama 3, Qwen2, Qwen3, SmolLM2 ...):

    model          BPE over the file's tokens (spelled in the byte alphabet where a token is not)
                   and merges; no dropout, no unknown token, no affixes
    pre-tokenizer  the split of tokenizer.ggml.pre where transformers knows one (Llama 3, Qwen2),
                   then byte-level; otherwise byte-level with GPT-2's split
    defaults       "<|endoftext|>" (transformers' GPT-2 default special token)

SentencePiece ("llama": Llama 2, Mistral, Phi-3): models/gguf_sentencepiece.py (BPE with byte
fallback, Metaspace), its defaults "<s>", "</s>", "<unk>". Both then:

    added tokens   the defaults (new ids past the vocabulary where the file lacks them), the file's
                   control tokens (byte-level: those spelled in the byte alphabet only) and its
                   bos/eos/unk/pad tokens as special, its user-defined tokens as plain added tokens,
                   matched whole
    ends           BOS / EOS added per tokenizer.ggml.add_bos_token / add_eos_token (default: none,
                   SentencePiece: BOS)

`GGUFTokenizer` offers what the engine, the server and the structured-output compiler call:
encode, decode, get_vocab, the special tokens, `backend_tokenizer`, and the chat template
(tokenizer.chat_template) through apply_chat_template / get_chat_template, rendered by
models/chat_template.py as transformers renders it. Other vocabularies (Gemma's SentencePiece, "t5",
...) are left to transformers (models/loader.py).
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from blockserve.models import chat_template
from blockserve.models.gguf_metadata import array_values, special_token_id
from blockserve.models.gguf_sentencepiece import DEFAULTS as SENTENCEPIECE_DEFAULTS
from blockserve.models.gguf_sentencepiece import SENTENCEPIECE_ARCHITECTURES, sentencepiece_backend

# tokenizer.ggml.pre -> the split its merges were learned on: the ones transformers' GGUF loader applies
# (any other value: GPT-2's byte-level split, as there)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                           "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
          "tekken": _TEKKEN,
          **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
          "qwen35": _QWEN35,
          **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O)}
_CONTROL, _USER_DEFINED = 3, 4  # gguf.TokenType
_GPT2_DEFAULT = "<|endoftext|>"


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, shifted = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + shifted)
            shifted += 1
    return spelling


# a character outside byte_alphabet(): a token holding one is spelled in that alphabet from its UTF-8 bytes
_OUTSIDE_BYTE_ALPHABET = re.compile("[^" + re.escape("".join(sorted(byte_alphabet().values()))) + "]")


def in_byte_alphabet(token: str) -> bool:
    """Whether every character of `token` is one of byte_alphabet()'s."""
    return _OUTSIDE_BYTE_ALPHABET.search(token) is None


def native_vocabulary(reader: gguf.GGUFReader) -> bool:
    """Whether GGUFTokenizer builds the file's tokenizer: byte-level BPE, or SentencePiece of an
    architecture gguf_sentencepiece.py builds, with its vocabulary present."""
    model = reader.fields.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in reader.fields:
        return False
    return model.contents() == "gpt2" or (
        model.contents() == "llama" and reader.fields["general.architecture"].contents() in SENTENCEPIECE_ARCHITECTURES)


def byte_level_backend(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    """The `tokenizers` model of a byte-level BPE GGUF vocabulary (see the module docstring)."""
    if in_byte_alphabet("".join(tokens)):  # the usual file: every token spelled in the alphabet already
        vocab = dict(zip(tokens, range(len(tokens))))
    else:
        spelling = byte_alphabet()
        vocab = {token if in_byte_alphabet(token) else "".join(spelling[b] for b in token.encode("utf-8")): index
                 for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(merge.split(" ")) for merge in merges],
                                   dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    split = SPLITS.get(pre)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def of_kind(tokens: list[str], kinds: list[int], kind: int) -> list[str]:
    """The tokens whose tokenizer.ggml.token_type is `kind`, in order."""
    return list(itertools.compress(tokens, map(kind.__eq__, kinds)))


class GGUFTokenizer:
    """A GGUF file's tokenizer from its metadata (see the module docstring); ValueError for a
    vocabulary it does not build (native_vocabulary)."""

    def __init__(self, reader: gguf.GGUFReader):
        if not native_vocabulary(reader):
            raise ValueError("GGUF tokenizer.ggml.model is neither byte-level BPE (gpt2) nor a SentencePiece "
                             f"vocabulary of {', '.join(SENTENCEPIECE_ARCHITECTURES)}: load it through transformers")
        fields = reader.fields

        def value(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        tokens: list[str] = array_values(reader, "tokenizer.ggml.tokens")
        kinds: list[int] = array_values(reader, "tokenizer.ggml.token_type") or []
        merges: list[str] | None = array_values(reader, "tokenizer.ggml.merges")
        byte_level = value("tokenizer.ggml.model") == "gpt2"
        if byte_level:
            backend = byte_level_backend(tokens, merges or [], value("tokenizer.ggml.pre"))
            # a control token outside the byte alphabet is a mislabel (transformers skips it too)
            control = [token for token in of_kind(tokens, kinds, _CONTROL) if in_byte_alphabet(token)]
            defaults = (_GPT2_DEFAULT,)
        else:
            backend = sentencepiece_backend(value("general.architecture"), tokens,
                                            array_values(reader, "tokenizer.ggml.scores"), merges)
            control = of_kind(tokens, kinds, _CONTROL)
            defaults = SENTENCEPIECE_DEFAULTS
        self.backend_tokenizer = backend
        names = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
        self._special = {f"{name}_token": tokens[i] if (i := special_token_id(reader, key)) is not None else None
                         for name, key in names.items()}
        # as transformers adds them: its tokenizer class's default special tokens (new ids past the
        # vocabulary where the file lacks them), the control tokens, the user-defined tokens (plain), then
        # the file's bos/eos/unk/pad (special even where the file calls them normal)
        backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in defaults])
        if control:
            backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in control])
        user = [token for token in of_kind(tokens, kinds, _USER_DEFINED) if backend.token_to_id(token) is not None]
        if user:
            backend.add_tokens([AddedToken(token, normalized=False, special=False) for token in user])
        named = [token for token in self._special.values() if token is not None]
        backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in named])
        # transformers adds BOS to a SentencePiece vocabulary whose file does not say (llama.cpp does too)
        self.add_bos_token = bool(value("tokenizer.ggml.add_bos_token", not byte_level)) and self.bos_token is not None
        self.add_eos_token = bool(value("tokenizer.ggml.add_eos_token", False)) and self.eos_token is not None
        # transformers' update_post_processor: "[bos:0] $A:0 [eos:0]", the pair "... [bos:1] $B:1 [eos:1]"
        bos, eos = f"{self.bos_token}:0 " if self.add_bos_token else "", f" {self.eos_token}:0" if self.add_eos_token else ""
        template = f"{bos}$A:0{eos}"
        pair = template + (f" {self.bos_token}:1" if self.add_bos_token else "") + " $B:1" + \
            (f" {self.eos_token}:1" if self.add_eos_token else "")
        ends = [(self.bos_token, self.bos_token_id)] if self.add_bos_token else []
        ends += [(self.eos_token, self.eos_token_id)] if self.add_eos_token else []
        backend.post_processor = processors.TemplateProcessing(single=template, pair=pair, special_tokens=ends)
        self.chat_template: str | None = value("tokenizer.chat_template")
        self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens the file sets (bos, eos, unk, pad), as the chat template sees them."""
        return {name: token for name, token in self._special.items() if token is not None}

    def _id(self, name: str) -> int | None:
        token = self._special[name]
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token = property(lambda self: self._special["bos_token"])
    eos_token = property(lambda self: self._special["eos_token"])
    unk_token = property(lambda self: self._special["unk_token"])
    pad_token = property(lambda self: self._special["pad_token"])
    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    unk_token_id = property(lambda self: self._id("unk_token"))
    pad_token_id = property(lambda self: self._id("pad_token"))

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._special_ids)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """{"input_ids": encode(text)} (transformers' call, for one text)."""
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(i) for i in token_ids]

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """`chat_template` if given, else the file's; ValueError where the file has none."""
        if chat_template is not None:
            return chat_template
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template (tokenizer.chat_template is not in the file)")
        return self.chat_template

    def apply_chat_template(self, conversation: list, tools: list | None = None, add_generation_prompt: bool = False,
                            tokenize: bool = True, chat_template: str | None = None, return_dict: bool = False,
                            **variables: Any) -> list[int] | str:
        """The conversation through the chat template (models/chat_template.py), as token ids (no BOS/EOS
        added: the template writes them) or, with tokenize=False, as text. `variables` are the template's;
        the rendering options transformers has beyond these (continue_final_message, documents, return_dict,
        ...; return_dict=True) are refused with a ValueError rather than ignored."""
        if return_dict:  # the options chat_template.render does not render it refuses itself (NOT_RENDERED)
            raise ValueError("apply_chat_template on a GGUF tokenizer does not take return_dict=True")
        if not conversation:
            raise ValueError("cannot apply the chat template to an empty conversation")
        text = chat_template_render(self, conversation, tools, add_generation_prompt, chat_template, variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def chat_template_render(tokenizer: GGUFTokenizer, conversation: list, tools: list | None,
                         add_generation_prompt: bool, template: str | None, variables: dict) -> str:
    return chat_template.render(tokenizer.get_chat_template(template, tools), conversation, tools=tools,
                                add_generation_prompt=add_generation_prompt,
                                **{**tokenizer.special_tokens_map, **variables})
