"""Token ids of plain ASCII text for BERT-style tokenizers, from a table of whole words.

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
split once, as WordPiece splits, and kept. Anything else
(a character past ASCII, text holding an added token such as ``[MASK]``,
another pipeline) goes to the tokenizer, and the tests compare both on every
ASCII character.
"""

from __future__ import annotations

import json
import re
import string
from itertools import chain, islice
from typing import Any

MAX_WORDS = 1 << 16  # words kept from outside the vocabulary; the table starts over past that
# clean_text: NUL and control characters other than tab, newline and carriage return are dropped
# (U+000B and U+000C are controls before they are whitespace), those three become spaces
_CLEAN = str.maketrans({**{c: None for c in [*range(9), 11, 12, *range(14, 32), 127]},
                        9: " ", 10: " ", 13: " "})
_PUNCT = re.escape(string.punctuation)  # exactly the ASCII punctuation BertPreTokenizer isolates
_WORDS = re.compile(rf"[^ {_PUNCT}]+|[{_PUNCT}]")


class _Pieces(dict[str, list[int]]):
    """Word or mark -> its pieces, looked up by the chunk of text between spaces: most chunks are
    one word, so most texts take one lookup per chunk, where splitting every text at its
    punctuation first cost a third of the table's time. It starts with the vocabulary's words
    and marks (WordPiece takes the longest match first); a word seen for the first time is
    split once, greedily, longest match first, as WordPiece splits (1-5 us a word, where
    asking the tokenizer's model costs 12-20), and kept; a chunk of several words and marks
    is split at its punctuation each time."""

    def __init__(self, vocab: dict[str, int], unknown: int, prefix: str, longest: int) -> None:
        # entries holding a mark among other characters (``##s``, ``[CLS]``) are pieces, never a chunk
        super().__init__({w: [i] for w, i in vocab.items() if len(w) <= longest and _WORDS.fullmatch(w)})
        self.known = len(self)
        self.vocab, self.unknown, self.prefix, self.longest = vocab, unknown, prefix, longest

    def __missing__(self, chunk: str) -> list[int]:
        words = _WORDS.findall(chunk)
        if len(words) > 1:  # words and marks: each kept on its own, the chunk not (too many kinds)
            return [i for word in words for i in self[word]]
        pieces = self.split(chunk)  # one word, or one mark
        if len(self) >= self.known + MAX_WORDS:
            for extra in list(self)[self.known:]:  # insertion order: the vocabulary comes first
                del self[extra]
        self[chunk] = pieces
        return pieces

    def split(self, word: str) -> list[int]:
        if len(word) > self.longest:
            return [self.unknown]
        vocab, prefix = self.vocab, self.prefix
        pieces: list[int] = []
        start, n = 0, len(word)
        while start < n:
            end = n
            while end > start:
                found = vocab.get(word[start:end] if start == 0 else prefix + word[start:end])
                if found is not None:
                    pieces.append(found)
                    break
                end -= 1
            else:  # no piece of the vocabulary starts here: the whole word is unknown
                return [self.unknown]
            start = end
        return pieces


class WordIds:
    """``ids(text)``: the tokenizer's ids for ``text``, or None where only the tokenizer can say."""

    def __init__(self, pieces: _Pieces, prefix: list[int], suffix: list[int], lowercase: bool,
                 added: list[str]) -> None:
        self._pieces = pieces
        self._prefix, self._suffix = prefix, suffix
        self._lowercase = lowercase
        self._added = re.compile("|".join(map(re.escape, added)), re.IGNORECASE) if added else None

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
        added = [t["content"] for t in spec.get("added_tokens") or [] if t.get("content")]
        return cls(pieces, *ends, lowercase=bool(norm.get("lowercase")), added=added)

    def ids(self, text: str, max_length: int | None = None) -> list[int] | None:
        """``max_length``: cut as the tokenizer's truncation does (the text's own tokens from the
        end, the special ones kept)."""
        if not text.isascii() or (self._added is not None and self._added.search(text)):
            return None
        if not text.isprintable():  # ASCII that is printable holds no control character
            text = text.translate(_CLEAN)
        if self._lowercase:
            text = text.lower()
        # after cleaning, the only whitespace left is the space
        words = chain.from_iterable(map(self._pieces.__getitem__, text.split()))
        if max_length is None:
            return [*self._prefix, *words, *self._suffix]
        room = max_length - len(self._prefix) - len(self._suffix)
        if room < 0:
            return None
        return [*self._prefix, *islice(words, room), *self._suffix]

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
