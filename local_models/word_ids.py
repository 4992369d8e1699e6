"""Token ids of text for BERT-style tokenizers, from a table of whole words.

Each small embedding call is tokenised on the event loop, and the tokenizer
spends most of its time on what a served text never needs: character offsets
and alignments kept through every normalising step. With the bench texts
(about 48 tokens each) that was 100-160 us per text, 40% of the event loop's
time under load. For a BERT pipeline (``BertNormalizer`` with ``clean_text``,
``BertPreTokenizer``, ``WordPiece``, a ``[CLS] $A [SEP]``-shaped template),
ASCII text normalises and splits by a few fixed rules: control characters go,
whitespace splits, each ASCII punctuation mark is a word of its own, letters
are lowercased where the normaliser lowercases. A word of the vocabulary is
its own piece (WordPiece takes the longest match first); any other word is
split once, as WordPiece splits, and kept.

Text past ASCII (a curly quote or a dash is enough, and most real text has
one) cost the tokenizer 170-210 us. BERT's normaliser works one character at
a time (control and format characters go, whitespace becomes a space, CJK
ideographs get spaces around them, accents are stripped by decomposing, and
letters are lowercased, each character on its own), and its pre-tokenizer
splits at whitespace and sets each punctuation mark apart, so a text's words
are its characters' normal forms joined and split at spaces. ``_Normal`` asks
the tokenizer's own normaliser and pre-tokenizer about each character the
first time it is seen, so the Unicode tables are the tokenizer's, not
Python's. What this cannot follow goes to the tokenizer: a combining mark left
after accent stripping (the decomposition's reordering spans characters), text
holding an added token such as ``[MASK]`` (or, for one added with ``normalized``,
text that holds it once normalised), another pipeline. The tests compare both on
every ASCII character, on random text from the whole of Unicode and on adversarial
text (tests/test_word_ids_fuzz.py).
"""

from __future__ import annotations

import json
import re
import string
import unicodedata
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

MAX_WORDS = 1 << 16  # words kept from outside the vocabulary; the table starts over past that
MAX_CHARS = 1 << 16  # characters past ASCII kept with their normal forms; the same
_REFUSED = "\x00"  # a character's normal form where only the tokenizer can say (clean_text drops NUL)
_PAST_ASCII = re.compile(r"[^\x00-\x7f]")
# clean_text: NUL and control characters other than tab, newline and carriage return are dropped
# (U+000B and U+000C are controls before they are whitespace), those three become spaces
_CLEAN = str.maketrans({**{c: None for c in [*range(9), 11, 12, *range(14, 32), 127]},
                        9: " ", 10: " ", 13: " "})
_PUNCT = re.escape(string.punctuation)  # exactly the ASCII punctuation BertPreTokenizer isolates
_WORDS = re.compile(rf"[^ {_PUNCT}]+|[{_PUNCT}]")
_MARKS = frozenset(string.punctuation)
_ID = array("i").itemsize  # bytes per id in the table's values


def _packed(ids: Iterable[int]) -> bytes:
    return array("i", ids).tobytes()


class _Pieces(dict[str, bytes]):
    """Word or mark -> its pieces, looked up by the chunk of text between spaces: most chunks are
    one word, so most texts take one lookup per chunk, where splitting every text at its
    punctuation first cost a third of the table's time. It starts with the vocabulary's words
    and marks (WordPiece takes the longest match first); a word seen for the first time is
    split once, greedily, longest match first, as WordPiece splits (1-5 us a word, where
    asking the tokenizer's model costs 12-20), and kept; a chunk of several words and marks
    is split at its punctuation each time.

    A word's pieces are kept as the bytes of their ids (machine ints), not a list: a lookup then
    reads one object past the table's slot and key, where a list of int objects cost two more
    reads, each a likely cache miss with 20,000 words in the table (the bench texts: 0.6-0.8x the
    time back to back, 0.9x on a loaded gateway's event loop)."""

    def __init__(self, vocab: dict[str, int], unknown: int, prefix: str, longest: int) -> None:
        # entries holding a mark among other characters (``##s``, ``[CLS]``) are pieces, never a chunk
        super().__init__({w: _packed((i,)) for w, i in vocab.items()
                          if len(w) <= longest and _WORDS.fullmatch(w)})
        self.known = len(self)
        self.vocab, self.longest = vocab, longest
        self.unknown = _packed((unknown,))
        # the pieces that continue a word, without their prefix: no string built per lookup
        self.continuing = {w[len(prefix):]: i for w, i in vocab.items() if w.startswith(prefix)}

    def __missing__(self, chunk: str) -> bytes:
        # A known word with one mark after it ("word,", "end.") or before it: every key here is
        # one word or one mark, so the chunk splits into exactly those two, in 0.34 us where the
        # regex's split took 0.79 (a bench text holds four or five such chunks).
        if len(chunk) > 1:
            if chunk[-1] in _MARKS and chunk[:-1] in self:
                return self[chunk[:-1]] + self[chunk[-1]]
            if chunk[0] in _MARKS and chunk[1:] in self:
                return self[chunk[0]] + self[chunk[1:]]
        words = _WORDS.findall(chunk)
        if len(words) > 1:  # words and marks: each kept on its own, the chunk not (too many kinds)
            return b"".join([self[word] for word in words])
        pieces = self.split(chunk)  # one word, or one mark
        if len(self) >= self.known + MAX_WORDS:
            for extra in list(self)[self.known:]:  # insertion order: the vocabulary comes first
                del self[extra]
        self[chunk] = pieces
        return pieces

    def split(self, word: str) -> bytes:
        if len(word) > self.longest:
            return self.unknown
        pieces: list[int] = []
        start, n = 0, len(word)
        while start < n:
            table = self.vocab if start == 0 else self.continuing
            end = n
            while end > start:
                found = table.get(word[start:end])
                if found is not None:
                    pieces.append(found)
                    break
                end -= 1
            else:  # no piece of the vocabulary starts here: the whole word is unknown
                return self.unknown
            start = end
        return _packed(pieces)


class _Normal(dict[int, str]):
    """Code point -> its normal form with each punctuation mark set apart by spaces, as
    ``str.translate`` takes it: the normaliser's own answer for the character, asked once."""

    def __init__(self, normalizer: Any, pre_tokenizer: Any, strips_accents: bool) -> None:
        super().__init__()
        self.normalizer, self.pre_tokenizer, self.strips_accents = normalizer, pre_tokenizer, strips_accents

    def __missing__(self, code: int) -> str:
        parts = []
        for c in self.normalizer.normalize_str(chr(code)):
            if self.strips_accents and unicodedata.combining(c):  # would reorder with its neighbours'
                parts = [_REFUSED]
                break
            pieces = len(self.pre_tokenizer.pre_tokenize_str(f"a{c}a"))
            if pieces == 1 and c.isspace():  # a space to ``str.split`` but not to the pre-tokenizer
                parts = [_REFUSED]
                break
            parts.append(c if pieces == 1 else " " if pieces == 2 else f" {c} ")
        if len(self) >= MAX_CHARS:
            self.clear()
        self[code] = normal = "".join(parts)
        return normal

    def sub(self, match: re.Match[str]) -> str:
        return self[ord(match[0])]


class WordIds:
    """``ids(text)``: the tokenizer's ids for ``text``, or None where only the tokenizer can say."""

    def __init__(self, pieces: _Pieces, prefix: list[int], suffix: list[int], lowercase: bool,
                 added: list[str], normal: _Normal | None = None, normalized: Sequence[str] = ()) -> None:
        """``added``: every added token's content, looked for in the text as sent, where the
        tokenizer matches those with ``normalized: false``. ``normalized``: the normal forms of the
        ``normalized: true`` ones, which the tokenizer matches in the normalised text: "café" added
        is found in "CAFE", and in "ca\\x00fe" once clean_text drops the NUL."""
        self._pieces = pieces
        self._prefix, self._suffix = _packed(prefix), _packed(suffix)
        self._specials = len(prefix) + len(suffix)
        self._lowercase = lowercase
        self._added = re.compile("|".join(map(re.escape, added)), re.IGNORECASE) if added else None
        # the table's text is the normalised text with spaces of its own around marks and
        # ideographs, so any run of spaces may stand between a form's characters (one more match
        # only sends a text to the tokenizer); a form that is all whitespace is kept as it is
        forms = sorted({" *".join(map(re.escape, "".join(f.split()) or f)) for f in normalized} - {""})
        self._normalized = re.compile("|".join(forms), re.IGNORECASE) if forms else None
        self._normal = normal

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> WordIds | None:
        """For a transformers tokenizer. The table cuts a long text's end, as truncation on the
        right does: a tokenizer set to truncate on the left (``truncation_side``) gets none."""
        if getattr(tokenizer, "truncation_side", "right") != "right":
            return None
        return cls.of(getattr(tokenizer, "backend_tokenizer", None))

    @classmethod
    def of(cls, backend: Any) -> WordIds | None:
        """For a ``tokenizers.Tokenizer`` whose pipeline is BERT's; None for any other."""
        try:
            spec = json.loads(backend.to_str())
        except Exception:  # not a tokenizers.Tokenizer, or one that cannot say what it is
            return None
        norm, pre, model, post = (spec.get(k) or {} for k in
                                  ("normalizer", "pre_tokenizer", "model", "post_processor"))
        if not (norm.get("type") == "BertNormalizer" and norm.get("clean_text")
                and pre.get("type") == "BertPreTokenizer" and model.get("type") == "WordPiece"):
            return None
        ends = _ends(post)
        vocab = model.get("vocab")
        if ends is None or not isinstance(vocab, dict) or model.get("unk_token") not in vocab:
            return None
        pieces = _Pieces(vocab, vocab[model["unk_token"]], model.get("continuing_subword_prefix", "##"),
                         int(model.get("max_input_chars_per_word", 100)))
        tokens = [t for t in spec.get("added_tokens") or [] if t.get("content")]
        added = [t["content"] for t in tokens]
        strips = norm.get("strip_accents")
        normalize = getattr(backend.normalizer, "normalize_str", None)
        normal = None
        if callable(normalize) and callable(getattr(backend.pre_tokenizer, "pre_tokenize_str", None)):
            normal = _Normal(backend.normalizer, backend.pre_tokenizer,
                             bool(norm.get("lowercase") if strips is None else strips))
        normalized = [t["content"] for t in tokens if t.get("normalized", True)]
        if normalized and not callable(normalize):  # their normal forms are the normaliser's to say
            return None
        forms = [normalize(c) for c in normalized] if normalize is not None else []
        return cls(pieces, *ends, lowercase=bool(norm.get("lowercase")), added=added, normal=normal,
                   normalized=forms)

    def ids(self, text: str, max_length: int | None = None) -> list[int] | None:
        """``max_length``: cut as the tokenizer's truncation does (the text's own tokens from the
        end, the special ones kept)."""
        if self._added is not None and self._added.search(text):
            return None
        mostly_ascii = True
        if not text.isascii():
            if self._normal is None:
                return None
            # ``translate`` looks every character up; where few are past ASCII, only those are
            # replaced and the rest is treated as ASCII text below (half the time for one quote)
            mostly_ascii = (len(text.encode("utf-8", "surrogatepass")) - len(text)) * 8 < len(text)
            text = _PAST_ASCII.sub(self._normal.sub, text) if mostly_ascii else text.translate(self._normal)
            if _REFUSED in text:
                return None
        if mostly_ascii:
            if not text.isprintable():  # ASCII that is printable holds no control character
                text = text.translate(_CLEAN)
            if self._lowercase:  # the normal forms past ASCII are lowercase already: ASCII's only
                text = text.lower() if text.isascii() else text.encode().lower().decode()
        if self._normalized is not None and self._normalized.search(text):
            return None
        # after cleaning, the only whitespace left is the space
        words = b"".join(map(self._pieces.__getitem__, text.split()))
        if max_length is not None:
            room = max_length - self._specials
            if room < 0:
                return None
            words = words[:room * _ID]
        ids = array("i", self._prefix)
        ids.frombytes(words)
        ids.frombytes(self._suffix)
        return ids.tolist()

    @property
    def kept(self) -> int:
        """Words from outside the vocabulary held now."""
        return len(self._pieces) - self._pieces.known


def _ends(post: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """The special ids before and after a single sequence: ``[CLS] $A [SEP]`` and kin."""
    if post.get("type") == "BertProcessing":
        return [post["cls"][1]], [post["sep"][1]]
    if post.get("type") != "TemplateProcessing":
        return None
    specials = post.get("special_tokens") or {}
    before: list[int] = []
    after: list[int] = []
    seen_sequence = False
    for piece in post.get("single") or []:
        if "Sequence" in piece:
            if seen_sequence:
                return None
            seen_sequence = True
        elif "SpecialToken" in piece:
            token = specials.get(piece["SpecialToken"]["id"])
            if token is None:
                return None
            (after if seen_sequence else before).extend(token["ids"])
        else:
            return None
    return (before, after) if seen_sequence else None
