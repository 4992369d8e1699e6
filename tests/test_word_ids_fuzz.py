"""Differential fuzzing of the word table against all-MiniLM-L6-v2's tokenizer, called as the pool calls it.

``LocalPool.tokenize`` serves a text from ``WordIds.ids(text, cut)`` when the table answers and
from ``tokenizer(texts, truncation=True, max_length=cut)["input_ids"]`` (or uncut) when it says
None, so any text where the table answers with other ids than the tokenizer's is a silent
embedding bug. The texts here are seeded and adversarial: WordPiece's 100-character limit reached
after lowercasing or accent stripping changes a word's length, ideographs inside words, characters
whose lowercase or decomposition is longer, control, format and whitespace characters of every
kind, punctuation and symbols, astral characters, text past the model's limit, and words seen
again in other company (the table caches by chunk and by character).
"""

from __future__ import annotations

import json
import random
import string
import unicodedata
from collections.abc import Callable, Iterator

import pytest

from tests.local_helpers import MINILM

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer  # noqa: E402

from local_models import word_ids  # noqa: E402
from local_models.word_ids import WordIds  # noqa: E402

POOL_LIMIT = 256  # the pool's cut for this model: sentence_bert_config's max_seq_length
CUTS = (None, 2, 3, 17, 128, POOL_LIMIT)


def _category(prefix: str, lo: int, hi: int) -> list[str]:
    return [chr(c) for c in range(lo, hi) if unicodedata.category(chr(c)).startswith(prefix)]


PUNCTUATION = _category("P", 0x80, 0x3100)  # Unicode P*: BERT sets each apart
SYMBOLS = _category("S", 0x80, 0x3100) + list("$+<=>^`|~")  # S*: kept in words, ASCII's set apart
DIGITS = _category("Nd", 0x80, 0x1FC00)  # digits of every script
MARKS = _category("M", 0x300, 0x1FC00)  # combining marks, most stripped with the accents
WHITESPACE = ["\t", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u1680", "\u2003",
              "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", " "]
INVISIBLE = ["\x00", "\x01", "\x7f", "\x80", "\x9f", "\xad", "\u180e", "\u200b", "\u200c", "\u200d",
             "\u2060", "\ufeff", "\ufff9", "\ufffd", "\ue000", "\U000e0041", "\U000f0000"]
# lowercase or decomposition longer or shorter than the character, case pairs, compatibility
# characters BERT keeps (no NFKC), Hangul, singletons that decompose to another character
ODD = ["\u0130", "\u0131", "\xdf", "\u1e9e", "\ufb01", "\ufb00", "\ufb03", "\u0149", "\u01f0", "\u0390",
       "\u1e96", "\u03a3", "\u03c3", "\u03c2", "\u212a", "\u212b", "\u2126", "\u01c4", "\u01c5", "\u1f88",
       "\u1ffc", "\u0345", "\u037e", "\u1fef", "\u0340", "\u0344", "\u0f73", "\u0958", "\u1e9b\u0323", "\xe9",
       "\xc9", "e\u0301", "E\u0301", "\xf1", "\xf8", "\xd8", "\u0142", "\u0111", "\xc5", "A\u030a", "\uff21",
       "\uff41", "\uff10", "\u2460", "\xbd", "\xb2", "\u0587", "\ufb13", "\uac00", "\ud7a3", "\u1100\u1161",
       "\u3131", "\u3042", "\u30a2", "\u0629", "\u05d0", "\u0915\u094d", "\u0e01\u0e33", "\U00010400",
       "\U00010428", "\U0001e900", "\U0001d11e", "\U0001d165", "\U0001d15e"]
IDEOGRAPHS = ["\u4e00", "\u4e2d", "\u6587", "\u3400", "\u9fff", "\uf900", "\ufa6a", "\u2f00", "\u3005",
              "\u3007", "\u30fc", "\U00020000", "\U0002a700", "\U0002f800", "\U00030000"]
EMOJI = ["\U0001f680", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467",
         "\U0001f1fa\U0001f1f8", "\u2764\ufe0f", "\U0001f600", "\u00a9", "\u2122"]
# long words: a repeated unit whose normal form is one, none or another number of characters
UNITS = ["x", "\xe9", "e\u0301", "\xdf", "\u1e9e", "\u0130", "\ufb01", "a\xad", "a\u200b", "\u03a3", "1",
         "\u4e2d", "\u0345a"]


def adversarial(rng: random.Random, vocab: list[str], count: int) -> list[str]:
    """``count`` texts of pieces picked with weights; fragments recur so a word meets other company."""

    def any_char() -> str:
        while True:
            code = rng.randrange(0x110000) if rng.random() < 0.4 else rng.randrange(0x3100)
            if not 0xD800 <= code < 0xE000:  # lone surrogates: the wire refuses them (wire.texts_of)
                return chr(code)

    def long_word() -> str:
        unit = rng.choice(UNITS)
        n = rng.choice([99, 100, 101, rng.randrange(90, 130)])
        return (unit * n) if rng.random() < 0.5 else "".join(rng.choice([unit, "a"]) for _ in range(n))

    strange = [*PUNCTUATION[:200], *SYMBOLS[:100], *MARKS[:100], *DIGITS[:100], *WHITESPACE, *INVISIBLE,
               *ODD, *IDEOGRAPHS, *EMOJI, *string.punctuation]

    def glued() -> str:  # strange characters inside a word, where the table splits or joins
        parts = [rng.choice(vocab)]
        for _ in range(rng.randrange(1, 4)):
            parts += [rng.choice(strange), rng.choice(vocab)]
        return "".join(parts)

    pieces: list[tuple[Callable[[], str], float]] = [
        (lambda: rng.choice(vocab), 30), (lambda: rng.choice(vocab).upper(), 5),
        (lambda: rng.choice(vocab).title(), 4), (long_word, 4), (glued, 12),
        (lambda: rng.choice(PUNCTUATION), 4), (lambda: rng.choice(SYMBOLS), 3),
        (lambda: rng.choice(string.punctuation) * rng.randrange(1, 4), 5),
        (lambda: rng.choice(DIGITS) * rng.randrange(1, 4), 3), (lambda: rng.choice(MARKS), 3),
        (lambda: rng.choice(WHITESPACE), 8), (lambda: rng.choice(INVISIBLE), 3),
        (lambda: rng.choice(ODD), 8), (lambda: rng.choice(IDEOGRAPHS), 4), (lambda: rng.choice(EMOJI), 2),
        (any_char, 6), (lambda: str(rng.randrange(10**12)), 2),
        (lambda: rng.choice(["[MASK]", "[mask]", "[CLS]x", "x[SEP]", "[UNK]", "[PAD"]), 0.3),
    ]
    makers, weights = zip(*pieces, strict=True)
    texts = []
    for _ in range(count):
        n = rng.choice([1, 2, 5, 20, 60, 150]) if rng.random() < 0.95 else rng.randrange(300, 600)
        texts.append("".join(rng.choice(["", "", " "]) + make()
                             for make in rng.choices(makers, weights, k=rng.randrange(1, n + 1))))
    return texts


# each a case named in the brief for this table: length limits after normalisation, ideographs in
# words, lowercase and decomposition that change length, final sigma, cleaned and whitespace
# characters, punctuation classes, astral characters, digits of other scripts, empty text
EDGES = [
    "", " ", "\t\n\r", "\xa0\u2003\u3000", "\u200b", "\x00", "\x00\x1f\x7f\ufffd",
    "a\x00b c\x1fd e\x7ff g\ufffdh",
    "x" * 100, "x" * 101, "X" * 100, "X" * 101, "\xe9" * 100, "\xe9" * 101, "e\u0301" * 100, "e\u0301" * 101,
    "\xdf" * 100, "\u1e9e" * 100, "\u1e9e" * 101, "\u0130" * 100, "\u0130" * 101, "\ufb01" * 100,
    "\ufb01" * 101, "a\xad" * 100, "a\u200b" * 51, "x" * 99 + "\u4e2d", "\u4e2d" + "x" * 100,
    "x" * 100 + "\x00", "\x00" + "x" * 100, "x" * 100 + "\u0301", "x" * 50 + "\u4e2d" + "x" * 51,
    "stra\xdfe STRASSE \u1e9e", "\u0130stanbul \u0131i \u0130I",
    "\u03a3\u0391\u03a3 \u03c3\u03b1\u03c2 \u038c\u03a3\u039f\u03a3 \u03a3",  # final sigma
    "\ufb01nance \ufb03 \ufb00", "na\xefve cafe\u0301 \xc5 A\u030a \u212b",
    "word\u3000word\xa0word\u2003word\u200bword", "a\tb\nc\rd\x0be\x0cf\x1cg\x85h\u2028i\u2029j",
    "$5 ^x `y` ~z |w| <a> =b +c", "\xbfQu\xe9? \xa1S\xed! \xabhi\xbb \u201ex\u201c \u2039y\u203a",
    "a\u2010b\u2011c\u2012d\u2013e\u2014f\u2015g",
    "\u6771\u4eac\u3001\u5927\u962a\u3002\u300c\u4eac\u90fd\u300d", "abc\u4e2d\u6587def",
    "\U0001f680\U0001f44d\U0001f3fd x\U0001f600y",
    "\U0001d518\U0001d52b\U0001d526\U0001d520\U0001d52c\U0001d521\U0001d522 \U00020000x\U0002f800",
    "\u0661\u0662\u0663 \u0966\u0967\u0968 \u0e51\u0e52\u0e53 \U0001d7d9\U0001d7da \u2460\u2461",
    "don't don ' t 't", "e.g. U.S.A. ... ---",
    " ".join(["the quick brown fox"] * 150), "antidisestablishmentarianism " * 40, "\u4e2d" * 600,
]


@pytest.fixture(scope="module")
def tok() -> object:
    from local_models.sources import resolve_source

    return transformers.AutoTokenizer.from_pretrained(str(resolve_source(MINILM)), local_files_only=True)


def reference(tok: object, texts: list[str], cut: int | None) -> list[list[int]]:
    """The pool's own call for the texts the table leaves: the wrapper, cut at ``cut`` when cutting."""
    if cut is None:
        return tok(texts, verbose=False)["input_ids"]  # type: ignore[operator]
    return tok(texts, truncation=True, max_length=cut, verbose=False)["input_ids"]  # type: ignore[operator]


def compare(words: WordIds, tok: object, texts: list[str], cuts: tuple[int | None, ...] = CUTS) -> int:
    """Each text twice (the second time from the caches) at each cut; the texts the table served."""
    served = 0
    for cut in cuts:
        expected = reference(tok, texts, cut)
        for _ in range(2):
            for text, theirs in zip(texts, expected, strict=True):
                ids = words.ids(text, cut)
                if ids is not None:
                    served += 1
                    assert ids == theirs, (ascii(text)[:300], cut)
    return served


def test_edge_cases_equal_the_tokenizers(tok: object) -> None:
    words = WordIds.of(tok.backend_tokenizer)  # type: ignore[attr-defined]
    assert words is not None
    texts = EDGES + [t.lower() for t in EDGES]  # the pool lowercases first where the model says so
    compare(words, tok, texts)
    # none needs the tokenizer: only an added token or a combining mark kept after stripping does
    refused = [t for t in texts if words.ids(t) is None]
    assert refused == [], [ascii(t)[:80] for t in refused]


@pytest.mark.parametrize("seed", [0, 1])
def test_adversarial_text_equals_the_tokenizers(tok: object, seed: int) -> None:
    rng = random.Random(seed)
    vocab = sorted(w for w in tok.get_vocab() if not w.startswith("["))  # type: ignore[attr-defined]
    texts = adversarial(rng, vocab, 700)
    words = WordIds.of(tok.backend_tokenizer)  # type: ignore[attr-defined]
    assert words is not None
    served = compare(words, tok, texts + [t.lower() for t in texts])
    assert served > 0.7 * 2 * len(texts) * len(CUTS) * 2  # the rest hold [MASK] or a kept mark
    # a fresh table meeting the words in the other order (other first contexts, other cache misses)
    fresh = WordIds.of(tok.backend_tokenizer)  # type: ignore[attr-defined]
    assert fresh is not None
    compare(fresh, tok, texts[::-1], (None, POOL_LIMIT))


def test_adversarial_text_equals_the_tokenizers_while_the_caches_start_over(tok: object, monkeypatch) -> None:
    monkeypatch.setattr(word_ids, "MAX_WORDS", 7)
    monkeypatch.setattr(word_ids, "MAX_CHARS", 5)
    words = WordIds.of(tok.backend_tokenizer)  # type: ignore[attr-defined]
    assert words is not None
    vocab = sorted(w for w in tok.get_vocab() if not w.startswith("["))  # type: ignore[attr-defined]
    compare(words, tok, adversarial(random.Random(2), vocab, 300), (None, POOL_LIMIT))
    assert words.kept <= 7


# added tokens with ``normalized: true`` (``tokenizer.add_tokens`` makes them so) are matched by the
# tokenizer in the normalised text: the table once looked for them in the text as sent only
ADDED = ["café", "covid19", "Δx", "<unused>", "a-b", "中文", "[NORM]"]
ADDED_CASES = {
    "cafe": [101, 30522, 102],  # lowercased and stripped to the normal form of "café"
    "CAFE au lait": [101, 30522, 8740, 21110, 2102, 102],
    "xcafe": [101, 1060, 30522, 102],  # found inside a word, as added tokens are
    "cov\x00id19": [101, 30523, 102],  # clean_text drops the NUL, then the token is whole
    "<un\x7fused>": [101, 30525, 102],
    "a\xad-b \xe9\xe9\xe9\xe9\xe9\xe9\xe9": [101, 30526, 25212, 4402, 4402, 2063, 102],  # soft hyphen dropped
}


@pytest.fixture(scope="module")
def with_added() -> Tokenizer:
    from tokenizers import AddedToken

    from local_models.sources import resolve_source

    backend = Tokenizer.from_file(str(resolve_source(MINILM) / "tokenizer.json"))
    backend.no_truncation()
    backend.no_padding()
    backend.add_tokens([*ADDED[:-1], AddedToken("Raw", normalized=False)])
    backend.add_special_tokens([AddedToken(ADDED[-1], normalized=True)])
    return backend


def test_normalized_added_tokens_send_the_text_to_the_tokenizer(with_added: Tokenizer) -> None:
    words = WordIds.of(with_added)
    assert words is not None
    for text, theirs in ADDED_CASES.items():
        assert with_added.encode(text).ids == theirs, ascii(text)  # the tokenizer finds the token
        assert words.ids(text) is None, ascii(text)  # and the table leaves the text to it
    # a normal form found only across the table's own spaces (an ideograph or mark set apart)
    assert words.ids("x中\u200b文y") is None and words.ids("[n\x00orm]") is None
    assert words.ids("plain words, [no] tokens") == with_added.encode("plain words, [no] tokens").ids


def test_adversarial_text_with_normalized_added_tokens(with_added: Tokenizer) -> None:
    rng = random.Random(5)
    vocab = sorted(w for w in with_added.get_vocab() if not w.startswith("["))

    def disguised() -> Iterator[str]:  # each added token as the normaliser could reach it
        for token in [*ADDED, "Raw"]:
            yield token
            yield token.upper()
            yield unicodedata.normalize("NFD", token)
            yield "".join(c + rng.choice(["", "\x00", "\xad", "\u200b", "\u0301"]) for c in token)

    plain = adversarial(rng, vocab, 300)
    texts = plain + [t[:i] + d + t[i:] for t, d in zip(plain, list(disguised()) * 10, strict=False)
                     for i in [rng.randrange(len(t) + 1)]]
    words = WordIds.of(with_added)
    assert words is not None
    spec = json.loads(with_added.to_str())
    assert sum(t["normalized"] for t in spec["added_tokens"]) == len(ADDED)
    served = 0
    for text, theirs in zip(texts, (e.ids for e in with_added.encode_batch_fast(texts)), strict=True):
        ids = words.ids(text)
        if ids is not None:
            served += 1
            assert ids == theirs, ascii(text)[:300]
    assert served > 0.8 * len(plain)  # most disguised tokens are found, and the text left to the tokenizer


def test_lone_surrogates_never_get_ids_from_the_table(tok: object) -> None:
    """JSON's ``"\\ud800"`` decodes to a lone surrogate: the wire refuses such text, and were one
    to reach the table it raises (as the tokenizer does) rather than answer with ids."""
    from local_models.wire import texts_of
    from multiplexer.core.errors import RpcError

    with pytest.raises(RpcError):
        texts_of({"input": ["fine", "a\ud800b"]}, "embed")
    words = WordIds.of(tok.backend_tokenizer)  # type: ignore[attr-defined]
    assert words is not None
    for text in ("\ud800", "a\udfffb", "x" * 50 + "\ud83d", "\u00e9\ud800"):
        with pytest.raises(UnicodeError):
            words.ids(text)
