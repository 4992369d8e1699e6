"""The word table's ids equal the tokenizer's own, on every ASCII character and its vocabulary's words."""

from __future__ import annotations

import json
import random
import string

import pytest

from tests.local_helpers import MINILM

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from local_models import word_ids  # noqa: E402
from local_models.word_ids import WordIds  # noqa: E402

ADDED = ("[MASK]", "[CLS]", "[SEP]", "[UNK]", "[PAD]")


@pytest.fixture(scope="module")
def backend() -> Tokenizer:
    from local_models.sources import resolve_source

    tok = Tokenizer.from_file(str(resolve_source(MINILM) / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def variant(backend: Tokenizer, **normalizer: object) -> Tokenizer:
    spec = json.loads(backend.to_str())
    spec["normalizer"].update(normalizer)
    return Tokenizer.from_str(json.dumps(spec))


def texts(backend: Tokenizer, n: int, seed: int) -> list[str]:
    """ASCII text of every kind: vocabulary words in any case, each of the 128 characters, digits,
    punctuation runs, added tokens, words longer than WordPiece takes whole."""
    rng = random.Random(seed)
    vocab = [w for w in backend.get_vocab() if w.isascii()]
    chars = [chr(c) for c in range(128)]
    pieces = [
        lambda: rng.choice(vocab),
        lambda: rng.choice(vocab).upper(),
        lambda: rng.choice(chars),
        lambda: "".join(rng.choice(chars) for _ in range(rng.randrange(1, 6))),
        lambda: rng.choice(string.punctuation) * rng.randrange(1, 4),
        lambda: str(rng.randrange(10**9)),
        lambda: rng.choice(string.whitespace),
        lambda: rng.choice(["[MASK]", "[cls]", "[SEP]x", "[UNK]"]),
        lambda: "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(95, 130))),
    ]
    weights = [40, 8, 10, 6, 6, 5, 15, 1, 1]
    out = ["", " ", "\x00", "\x0b\x0c", "a\tb\nc\rd", "don't stop-me now...", "x" * 100, "x" * 101]
    for _ in range(n):
        parts = rng.choices(pieces, weights, k=rng.randrange(1, 40))
        out.append(rng.choice(["", " "]).join(p() for p in parts))
    return out


@pytest.mark.parametrize("lowercase", [True, False])
def test_ids_equal_the_tokenizers_on_ascii_text(backend: Tokenizer, lowercase: bool) -> None:
    tok = variant(backend, lowercase=lowercase)
    words = WordIds.of(tok)
    assert words is not None
    served = 0
    for text in texts(tok, 3000, seed=7 + lowercase):
        ids = words.ids(text)
        # only text naming an added token goes to the tokenizer
        assert (ids is None) == any(t in text.upper() for t in ADDED), repr(text)
        if ids is not None:
            served += 1
            assert ids == tok.encode(text).ids, repr(text)
    assert served > 2000


def test_a_word_with_a_mark_beside_it_reads_as_the_tokenizer_reads_it(backend: Tokenizer) -> None:
    """"word," and "(word": split into the word and the mark from the table once the word is in
    it, the same ids as the regex's split of a word seen for the first time (and as the tokenizer's)."""
    words = WordIds.of(backend)
    assert words is not None
    rng = random.Random(3)
    vocab = [w for w in backend.get_vocab() if w.isascii() and w.isalpha()]
    new = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randrange(3, 14)))
           for _ in range(200)]
    marked = [f"{w}{m}" if rng.random() < 0.5 else f"{m}{w}" for w in rng.sample(vocab, 300) + new
              for m in rng.sample(string.punctuation, 3)]
    marked += [",,", ".,", "a.", ".a", "x" * 101 + ",", "," + "x" * 101, "..." + "word", "word" + "!!"]
    text = " ".join(marked)
    first = words.ids(text)  # the new words go into the table here
    assert first == backend.encode(text).ids
    assert words.ids(text) == first
    for chunk in marked:
        assert words.ids(chunk) == backend.encode(chunk).ids, chunk


# characters that real text carries past ASCII, and the ones the normaliser treats apart
COMMON = list("\u2019\u2018“”—\u2013…«»¿¡€£°±\u00d7÷"
              "éèêëàâäçñöüßÉÀÖÜÅØæœıİŞğšžčřłńśźΣσςΑαΒβΩωДдЖжЯяЁё中文日本語한국어")
SPECIAL = ["\u00a0", "\u200b", "\u200d", "\ufeff", "\ufffd", "\u0301", "\u0308", "\u0327", "\u2028",
           "\u3000", "\u180e", "\u0085", "\u00ad", "\U0001f680", "\U0001f1fa", "\ufb01", "\u2126",
           "\u212b", "\u1e9e", "\u0345", "\u0f71", "\U0001d165", "\u0e33", "\uac00", "\u1100"]


def unicode_texts(backend: Tokenizer, n: int, seed: int) -> list[str]:
    """Text past ASCII: vocabulary words, common accented and typographic characters, the
    normaliser's special cases (spaces, joiners, combining marks, ideographs), any code point."""
    rng = random.Random(seed)
    vocab = list(backend.get_vocab())

    def anywhere() -> str:
        while True:
            code = rng.randrange(0x80, 0x110000) if rng.random() < 0.5 else rng.randrange(0x80, 0x3000)
            if not 0xD800 <= code < 0xE000:
                return chr(code)

    pieces = [
        lambda: rng.choice(vocab),
        lambda: rng.choice(vocab).upper(),
        lambda: rng.choice(COMMON),
        lambda: "".join(rng.choice(COMMON) for _ in range(rng.randrange(2, 8))),
        lambda: rng.choice(SPECIAL),
        lambda: anywhere(),
        lambda: rng.choice(vocab) + rng.choice(SPECIAL + COMMON) + rng.choice(vocab),
        lambda: rng.choice(string.punctuation + " \t\n"),
    ]
    weights = [30, 5, 20, 8, 8, 10, 8, 11]
    out = ["é", "Σ", "ΣΑΣ", "İstanbul", "straße", "中文字", "a\u0301b", "\u0301", "x\u200dy", "🚀🚀"]
    for _ in range(n):
        parts = rng.choices(pieces, weights, k=rng.randrange(1, 30))
        out.append(rng.choice(["", " "]).join(p() for p in parts))
    return out


@pytest.mark.parametrize(("lowercase", "strip_accents"),
                         [(True, None), (False, None), (True, False), (False, True)])
def test_ids_equal_the_tokenizers_past_ascii(backend: Tokenizer, lowercase: bool,
                                             strip_accents: bool | None) -> None:
    tok = variant(backend, lowercase=lowercase, strip_accents=strip_accents)
    words = WordIds.of(tok)
    assert words is not None
    cut = Tokenizer.from_str(tok.to_str())
    cut.enable_truncation(max_length=12)
    served = 0
    texts = unicode_texts(tok, 3000, seed=17 + 2 * lowercase + (strip_accents is True))
    for text in texts:
        ids = words.ids(text)
        if ids is not None:
            served += 1
            assert ids == tok.encode(text).ids, repr(text)
            assert words.ids(text, 12) == cut.encode(text).ids, repr(text)
    assert served > 0.9 * len(texts)  # the rest hold an added token, or a mark left after stripping


def test_every_character_of_the_basic_plane_reads_as_the_tokenizer_reads_it(backend: Tokenizer) -> None:
    """Each of the 63,488 characters of the Basic Multilingual Plane (surrogates aside) inside a
    word, alone, and beside a mark: the table's ids are the tokenizer's, or it says None."""
    words = WordIds.of(backend)
    assert words is not None
    texts = [f"x{c}y {c} ({c}" for c in map(chr, range(0x80, 0x10000)) if not 0xD800 <= ord(c) < 0xE000]
    reference = [e.ids for e in backend.encode_batch_fast(texts)]
    mine = [words.ids(t) for t in texts]
    refused = [t for t, ids in zip(texts, mine, strict=True) if ids is None]
    wrong = [t for t, ids, theirs in zip(texts, mine, reference, strict=True) if ids not in (None, theirs)]
    assert not wrong, [ascii(t) for t in wrong[:5]]
    assert len(refused) < 0.01 * len(texts), [ascii(t) for t in refused[:5]]


def test_text_only_the_tokenizer_can_read_goes_to_it(backend: Tokenizer) -> None:
    words = WordIds.of(backend)
    assert words is not None
    for text in ("[MASK] café", "café [mask]", "a\U0001d165 with a mark left after stripping"):
        assert words.ids(text) is None
    assert words.ids("café naïve") == backend.encode("café naïve").ids


def test_ids_stay_equal_when_the_cache_starts_over(backend: Tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(word_ids, "MAX_WORDS", 5)
    words = WordIds.of(backend)
    assert words is not None
    for text in texts(backend, 200, seed=3):
        ids = words.ids(text)
        assert ids is None or ids == backend.encode(text).ids
    assert words.kept <= 5


def test_only_bert_pipelines_take_the_word_cache(backend: Tokenizer) -> None:
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(["a small corpus of words for a tokenizer"] * 10,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    assert WordIds.of(bpe) is None
    assert WordIds.of(None) is None
    assert WordIds.of(variant(backend, clean_text=False)) is None
    spec = json.loads(backend.to_str())
    spec["post_processor"] = {"type": "BertProcessing", "sep": ["[SEP]", 102], "cls": ["[CLS]", 101]}
    legacy = Tokenizer.from_str(json.dumps(spec))
    words = WordIds.of(legacy)
    assert words is not None and words.ids("Hello, world!") == legacy.encode("Hello, world!").ids


@pytest.mark.parametrize("max_length", [2, 3, 10, 48])
def test_truncated_ids_equal_the_tokenizers_truncation(backend: Tokenizer, max_length: int) -> None:
    tok = Tokenizer.from_str(backend.to_str())
    tok.enable_truncation(max_length=max_length)
    words = WordIds.of(backend)
    assert words is not None
    for text in texts(backend, 400, seed=11):
        ids = words.ids(text, max_length)
        if ids is not None:
            assert ids == tok.encode(text).ids, repr(text)
    assert words.ids("too short for its own specials", 1) is None  # the tokenizer says what that is


def test_a_character_python_splits_at_but_the_pre_tokenizer_keeps_is_refused(backend: Tokenizer) -> None:
    """U+001C is whitespace to ``str.split`` and not to BERT's pre-tokenizer; BERT's normaliser
    drops it, but a normaliser that kept it must send the text to the tokenizer."""
    from tokenizers import normalizers

    from local_models.word_ids import _REFUSED, _Normal

    keep = normalizers.Sequence([])  # changes nothing
    normal = _Normal(keep, backend.pre_tokenizer, strips_accents=False)
    assert normal[0x1C] == _REFUSED
    assert normal[ord("é")] == "é" and normal[ord("—")] == " — " and normal[0xA0] == " "
    assert _Normal(backend.normalizer, backend.pre_tokenizer, strips_accents=True)[0x1C] == ""


def test_a_tokenizer_that_truncates_on_the_left_gets_no_table() -> None:
    from local_models.sources import resolve_source

    tok = transformers.AutoTokenizer.from_pretrained(str(resolve_source(MINILM)))
    table = WordIds.for_tokenizer(tok)
    assert table is not None
    text = " ".join(f"word{i}" for i in range(40))
    assert table.ids(text, 16) == tok(text, truncation=True, max_length=16)["input_ids"]
    tok.truncation_side = "left"  # the table would keep the text's start where the tokenizer keeps its end
    assert table.ids(text, 16) != tok(text, truncation=True, max_length=16)["input_ids"]
    assert WordIds.for_tokenizer(tok) is None
