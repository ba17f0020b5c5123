"""Generated tokens -> text that is safe to send: UTF-8 completed, stop strings cut off.

While streaming, text that could be the beginning of a stop string is held back until the next
tokens show whether it is one; when a stop string appears, the text before it is the last text
sent and the generation ends there.
"""
from __future__ import annotations

from speculant.gguf import StreamDecoder


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buffer = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """(text that can be sent now, the stop string found or None). After a stop string is
        found, the text returned is everything up to it and nothing more must be sent."""
        if not self.stops:
            return text, None
        buf = self.buffer + text
        found = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (found is None or i < found[0]):
                found = (i, s)
        if found is not None:
            self.buffer = ""
            return buf[: found[0]], found[1]
        hold = 0  # the longest end of buf that begins a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.buffer = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


class TextPipeline:
    """Tokens in, sendable text out. Control tokens (end of generation included) render as nothing."""

    def __init__(self, tokenizer, stops: list[str], eog: frozenset[int]):
        self.decoder = StreamDecoder(tokenizer, skip_special=True)
        self.matcher = StopMatcher(stops)
        self.eog = eog
        self.stop_word: str | None = None

    def push(self, token: int) -> str:
        piece = "" if token in self.eog else self.decoder.push(token)
        out, self.stop_word = self.matcher.push(piece)
        return out

    def finish(self) -> str:
        """What is left when generation ends without a stop string."""
        out, self.stop_word = self.matcher.push(self.decoder.flush())
        return out if self.stop_word else out + self.matcher.flush()
