"""Streaming a generation's text: the part of the decoded tokens that can no longer change.

Decoding token by token splits multi-byte characters and words, and a stop string may
still be forming at the end, so each step hands out only the text that is final: not a
trailing replacement character (a character cut in half), not a tail that could begin a
stop string. The generation's final text (cut at its stop) completes what was handed out.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.hold = max(map(len, stops), default=1) - 1  # a stop may be this much under way
        self.sent = ""

    def step(self, tokens: list[int]) -> str:
        """New final text after a decoding step ('' when nothing new is safe yet)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        text = text.rstrip("\ufffd")
        safe = text[:max(len(text) - self.hold, 0)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (cut at its stop string)."""
        rest = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return rest
