"""A GGUF file's SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Mixtral,
Phi-3 ...) as a `tokenizers` model, built as transformers' GGUF loader builds it (its LlamaTokenizer
over the file's tokens), without transformers:

    model          BPE over the file's tokens with byte fallback (<0x00>..<0xFF>), unknown pieces
                   fused, no unknown token; its merges are the file's tokenizer.ggml.merges, else
                   every split of a token into two tokens, best score first (`spm_merges`)
    pre-tokenizer  Metaspace: spaces become "▁", one "▁" before the text's first piece; Phi-3: none,
                   a normaliser instead that writes "▁" before the text and for every space
    decoder        "▁" back to spaces, byte tokens joined into their UTF-8 characters, the leading
                   space dropped
    defaults       "<s>", "</s>", "<unk>", the special tokens transformers' class adds (as new ids
                   past the vocabulary where the file lacks them)

tokenizer.ggml.add_space_prefix is not read: transformers' loader ignores it (a "▁" always leads),
and ids equal to transformers' are this module's contract. Gemma's vocabulary (its spaces spelled
as spaces, merges ordered by position, an unknown token) is left to transformers
(`SENTENCEPIECE_ARCHITECTURES` lacks it).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"
# GGUF architectures whose SentencePiece vocabulary is built here; "phi3" prepends by normaliser
SENTENCEPIECE_ARCHITECTURES = ("llama", "mistral", "phi3")
DEFAULTS = ("<s>", "</s>", "<unk>")


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens of
    the vocabulary, ordered by the whole token's score (best first), then by the left and right
    pieces' lengths (longest first); ties keep the vocabulary's order, the splits of one token the
    order of their pieces' ids (transformers' generate_merges with scores)."""
    ids = {token: index for index, token in enumerate(tokens)}
    token_scores = dict(zip(tokens, scores))
    merges = []
    for token, score in token_scores.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                  if token[:cut] in ids and token[cut:] in ids]
        splits.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        merges.extend((left, right, score) for left, right in splits)
    merges.sort(key=lambda merge: (-merge[2], -len(merge[0]), -len(merge[1])))
    return [(left, right) for left, right, _ in merges]


def sentencepiece_backend(arch: str, tokens: list[str], scores: list[float] | None,
                          merges: list[str] | None) -> Tokenizer:
    """The `tokenizers` model of a SentencePiece GGUF vocabulary of architecture `arch` (one of
    SENTENCEPIECE_ARCHITECTURES); ValueError naming the field where the file has neither merges nor
    scores."""
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    elif scores is not None:
        pairs = spm_merges(tokens, scores)
    else:
        raise ValueError("GGUF SentencePiece vocabulary without tokenizer.ggml.scores (nor tokenizer.ggml.merges): "
                         "its merges cannot be known; convert the model again")
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    if arch == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    return backend
