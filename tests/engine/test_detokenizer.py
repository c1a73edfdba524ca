"""Incremental detokenization against the real SmolLM2 tokenizer: the deltas add up to
`tokenizer.decode`, characters split over tokens come out whole, special tokens are skipped,
and stop strings cut the text without ever streaming a partial match."""

import random

import pytest

from blockserve.engine.detokenizer import IncrementalDetokenizer
from blockserve.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café crème, naïve façade, Ångström, señor, Zürich, déjà vu.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji: 😀 👍🏽 👨‍👩‍👧 🇫🇷 🧑🏿‍🚀 ❤️‍🔥 done",
    "Mixed: a😀b世c\u0301d 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ — “quotes” …",
    "  leading spaces, tabs\tand\nnew lines\n\n",
]


@pytest.fixture(scope="module")
def tok(smollm2_gguf_tokenizer):
    return smollm2_gguf_tokenizer


@pytest.fixture(scope="module")
def prompt(tok):
    chat = [{"role": "user", "content": "Say something in many scripts 😀"}]
    return tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), add_special_tokens=False)


def stream(tok, prompt, ids, chunks=None, **params):
    """Push `ids` (one at a time, or in the given chunk sizes) then finish.
    Returns (deltas, detokenizer)."""
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(**params))
    deltas, i = [], 0
    for size in chunks or [1] * len(ids):
        deltas.append(d.push(ids[i : i + size]))
        i += size
        if d.finished:
            return deltas, d
    deltas.append(d.finish())
    return deltas, d


def random_chunks(rng, n):
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 4))
    return sizes


def cut_at_stop(text, stops):
    """Reference: the text before the first stop string to complete (ties: the longest)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)], stop
    return text, None


# -- text equals decode --------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_characters_split_over_tokens_come_out_whole_and_once(tok, prompt, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(set(text)) // 4  # the tokenizer does split these
    deltas, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == text == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in delta for delta in deltas)


def test_a_split_emoji_appears_with_its_last_token(tok, prompt):
    ids = tok.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2
    deltas, _ = stream(tok, prompt, ids)
    assert deltas == ["", " 😀", ""]


def test_random_token_sequences_decode_like_the_tokenizer(tok, prompt):
    rng = random.Random(0)
    vocab_size = len(tok)
    for _ in range(400):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        chunks = random_chunks(rng, len(ids)) if rng.random() < 0.5 else None
        deltas, d = stream(tok, prompt, ids, chunks)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), ids
        assert d.finished and d.stop_string is None


def test_random_sequences_of_multibyte_pieces_decode_like_the_tokenizer(tok, prompt):
    """Shuffled tokens of emoji and CJK: lone continuation bytes and unfinished characters
    (which do decode to U+FFFD) in every position, the last one included."""
    pieces = sorted({i for text in TEXTS[2:5] for i in tok.encode(text, add_special_tokens=False)})
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.choice(pieces) for _ in range(rng.randint(1, 12))]
        deltas, _ = stream(tok, prompt, ids)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), ids


def test_special_tokens_are_skipped(tok, prompt):
    hello = tok.encode("Hello there", add_special_tokens=False)
    ids = [1, *hello[:1], 2, 0, *hello[1:], tok.convert_tokens_to_ids("<|im_end|>")]
    deltas, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == "Hello there"


def test_the_prompt_is_context_not_output(tok):
    for prompt_text in ["Tell me", "Ends with an emoji 😀", "", "世"]:
        prompt = tok.encode(prompt_text, add_special_tokens=False)
        ids = tok.encode(" a reply 世界", add_special_tokens=False)
        assert "".join(stream(tok, prompt, ids)[0]) == " a reply 世界"


# -- stop strings --------------------------------------------------------------------------------


def test_a_stop_string_cuts_the_text_before_it_and_ends_the_request(tok, prompt):
    ids = tok.encode("The answer is 42. STOP and then more text", add_special_tokens=False)
    deltas, d = stream(tok, prompt, ids, stop=("STOP",))
    assert "".join(deltas) == "The answer is 42. "
    assert d.finished and d.stop_string == "STOP"
    with pytest.raises(RuntimeError, match="push\\(\\) after the request's text finished"):
        d.push([ids[0]])
    assert d.finish() == ""


def test_partial_matches_are_held_back_and_released_when_they_fail(tok):
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=("abcd",)))
    push = lambda text: d.push(tok.encode(text, add_special_tokens=False))  # noqa: E731
    assert push("xx") == ""  # the last len("abcd") - 1 = 3 characters are always held
    assert push("yab") == "xx"
    assert push("c") == "y"  # "abc" held: it may become "abcd"
    assert push("e") == "a"
    assert d.finish() == "bce"
    assert d.stop_string is None


def test_streamed_text_never_contains_a_partial_stop_string(tok, prompt):
    text = "We count: one, two, three, END-OF-TEXT and beyond"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "END-OF-TEXT"
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(stop=(stop,)))
    expected = "We count: one, two, three, "
    emitted = ""
    for i in ids:
        emitted += d.push([i])
        assert expected.startswith(emitted), f"streamed {emitted!r}"
        if d.finished:
            break
    assert emitted == expected and d.stop_string == stop


def test_the_first_stop_string_to_complete_wins_and_ties_go_to_the_longest(tok, prompt):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    assert "".join(stream(tok, prompt, ids, stop=("delta", "gamma", "beta gam"))[0]) == "alpha "
    deltas, d = stream(tok, prompt, ids, stop=("eta", " beta"))
    assert "".join(deltas) == "alpha" and d.stop_string == " beta"
    deltas, d = stream(tok, prompt, ids, stop=("gamma delta", "mma"))  # "mma" completes first
    assert "".join(deltas) == "alpha beta ga" and d.stop_string == "mma"


def test_stop_strings_with_multibyte_characters(tok, prompt):
    ids = tok.encode("Emoji 😀 then 世界 and more", add_special_tokens=False)
    assert "".join(stream(tok, prompt, ids, stop=("世界",))[0]) == "Emoji 😀 then "
    assert "".join(stream(tok, prompt, ids, stop=("😀",))[0]) == "Emoji "


def test_random_stop_strings_cut_like_the_reference(tok, prompt):
    rng = random.Random(2)
    for _ in range(200):
        text = rng.choice(TEXTS)
        ids = tok.encode(text, add_special_tokens=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 6)] if rng.random() < 0.8 else "zzz-not-there")
        deltas, d = stream(tok, prompt, ids, random_chunks(rng, len(ids)), stop=stops)
        expected, stop = cut_at_stop(tok.decode(ids, skip_special_tokens=True), stops)
        assert ("".join(deltas), d.stop_string) == (expected, stop), (text, stops)


def test_stop_strings_wait_for_min_tokens(tok, prompt):
    ids = tok.encode("x, x, x, x", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["x", ",", "Ġx", ",", "Ġx", ",", "Ġx"]
    assert "".join(stream(tok, prompt, ids, stop=(",",), min_tokens=1)[0]) == "x"  # can end on token 2
    assert "".join(stream(tok, prompt, ids, stop=(",",), min_tokens=3)[0]) == "x, x"  # first "," ok: token 4
    assert "".join(stream(tok, prompt, ids, stop=(", x",), min_tokens=3)[0]) == "x"  # completes on token 3
    assert "".join(stream(tok, prompt, ids, stop=(",",), min_tokens=7)[0]) == "x, x, x, x"


def test_finish_flushes_held_text_and_unfinished_characters(tok, prompt):
    ids = tok.encode("abc 😀", add_special_tokens=False)[:-1]  # the emoji's last token never comes
    deltas, d = stream(tok, prompt, ids, stop=("zzzz",))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "abc \ufffd"
    assert deltas[-1].endswith("\ufffd") and d.finished


# -- other tokenizers ------------------------------------------------------------------------------


def byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (byte fallback, metaspace): its decoder turns each byte of
    invalid UTF-8 into its own U+FFFD, so its output for a window does not always extend."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for word in ["▁a", "b", "▁hello", "▁", "x"]:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend), vocab


def test_a_decoder_that_rewrites_its_output_does_not_break_the_stream():
    tok, vocab = byte_fallback_tokenizer()
    ids = [vocab["<0xE8>"], vocab["<0x80>"], vocab["<0x8B>"], vocab["<0x45>"], vocab["<0xF0>"], vocab["x"]]
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    text = "".join(d.push([i]) for i in ids) + d.finish()
    assert tok.decode(ids) == "\ufffd" * 5 + "x"  # the three bytes of 耋 decoded alone give 耋
    assert text == "耋E\ufffdx"  # every token's text, once: the stream restarted at "x" from "<0xF0>"
    hello_world = [vocab["▁hello"], vocab["▁"], *(vocab[f"<0x{b:02X}>"] for b in "世界".encode()), vocab["▁a"]]
    d = IncrementalDetokenizer(tok, [vocab["▁a"]] * 5, SamplingParams())
    assert "".join(d.push([i]) for i in hello_world) + d.finish() == " hello 世界 a"  # the prompt keeps the first space


def test_a_slow_tokenizer_is_refused_clearly():
    with pytest.raises(TypeError, match="needs a fast \\(Rust-backed\\) Hugging Face tokenizer, got object"):
        IncrementalDetokenizer(object(), [], SamplingParams())
