"""Tokenising one small call's text: the word table against the tokenizer, ASCII and past it.

Each embedding call is tokenised on the event loop as it arrives, so this is
per-call CPU that batching cannot share out. For each kind of text (the
local bench's 3-120 word texts as they are; with accented vowels; with one
curly quote; Cyrillic and CJK words), it times ``tokenizers``'
``encode_batch_fast`` on one text at a time (what the pool would call), and
``WordIds.ids`` on a first pass over new texts (words and characters seen for
the first time) and on a second pass (all of them known), checks that both give
the same ids, and reports how many texts the table served. Timings are the best
of several passes, ratios within the run.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from tokenizers import Tokenizer

from benchmarks._procs import save, table
from benchmarks.bench_local import MINILM, make_texts
from local_models.sources import resolve_source
from local_models.word_ids import WordIds


def kinds(n: int, seed: int) -> dict[str, list[str]]:
    base = make_texts(n, seed)
    rng = random.Random(seed)

    def words(alphabet: str, lo: int, hi: int) -> list[str]:
        return [" ".join("".join(rng.choice(alphabet) for _ in range(rng.randrange(lo, hi)))
                         for _ in range(len(t.split()))) + "." for t in base]

    cyrillic = "абвгдежзийклмнопрстуфхцчшщъыьэюя"
    cjk = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 400))
    return {
        "ascii": base,
        "accented": [t.replace("e", "\u00e9").replace("a", "\u00e0") for t in base],
        "one curly quote": [t.replace(",", "\u2019", 1) if "," in t else t + "\u2019" for t in base],
        "cyrillic": words(cyrillic, 3, 9),
        "cjk": words(cjk, 1, 4),
    }


def per_text(fn: Callable[[str], object], texts: list[str], passes: int) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for text in texts:
            fn(text)
        best = min(best, time.perf_counter() - start)
    return best / len(texts) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    backend = Tokenizer.from_file(str(resolve_source(MINILM) / "tokenizer.json"))
    backend.no_truncation()
    backend.no_padding()
    rows, data = [], {}
    for name, texts in kinds(args.texts, seed=1).items():
        words = WordIds.of(backend)
        assert words is not None
        start = time.perf_counter()
        first = [words.ids(t) for t in texts]  # everything new to the table
        cold = (time.perf_counter() - start) / len(texts) * 1e6
        reference = [e.ids for e in backend.encode_batch_fast(texts)]
        served = [i for i, ids in enumerate(first) if ids is not None]
        assert all(first[i] == reference[i] for i in served), name
        tokenizer = per_text(lambda t: backend.encode_batch_fast([t]), texts, args.passes)
        warm = per_text(words.ids, texts, args.passes)
        data[name] = {"tokenizer_us": tokenizer, "table_first_us": cold, "table_us": warm,
                      "served": len(served) / len(texts)}
        rows.append([name, f"{tokenizer:.1f}", f"{cold:.1f}", f"{warm:.1f}", f"{tokenizer / warm:.1f}x",
                     f"{len(served) / len(texts):.0%}"])
    print(table(["text", "tokenizer us/text", "table, first pass us/text", "table us/text",
                 "table vs tokenizer", "served by the table"], rows))
    save("bench_tokenize", data)


if __name__ == "__main__":
    main()
