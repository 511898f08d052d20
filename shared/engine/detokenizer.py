"""Incremental detokenization with stop strings: token ids in, committed text deltas out."""

from __future__ import annotations

from pdserve.models.tokenizer import Tokenizer

# Prompt tokens kept as left context, so the first output token decodes with its leading space.
PROMPT_CONTEXT_TOKENS = 5
# A tail still ending in U+FFFD after this many held tokens in a row is committed as is: it is invalid
# bytes from the model, not a character split across tokens (at most 4 bytes, one byte or more a token).
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, O(1) decode work per token.

    The ids window is `ids[prefix_offset:]`: text of `ids[prefix_offset:read_offset]` was already
    returned, and decoding from `prefix_offset` (not from `read_offset`) gives tokenizers that strip
    or merge at the window start (SentencePiece's leading space) the same context as a full decode.
    Ids that decode to nothing (ids outside the vocab; special ids when skipping them) never enter
    the window, so runs of them cost nothing.

    Stop strings: the earliest-ending match wins, ties to the earliest start, so the result does not
    depend on how tokens are batched. The longest tail that is a proper prefix of some stop string is
    held back until it either completes a match or cannot; `flush()` releases it at the end.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.output_text = ""
        self.stopped_by: str | None = None
        self._held_text = ""
        self._ids = [i for i in prompt_ids if self._is_visible(i)][-PROMPT_CONTEXT_TOKENS:]
        self.prefix_offset = 0
        self.read_offset = len(self._ids)

    @property
    def is_stopped(self) -> bool:
        return self.stopped_by is not None

    def add_tokens(self, new_ids: list[int]) -> str:
        if self.is_stopped:
            return ""
        new_text = ""
        for token_id in new_ids:
            if self._is_visible(token_id):
                self._ids.append(token_id)
                new_text += self._decode_tail(force=False)
        return self._commit(new_text)

    def flush(self) -> str:
        """Releases everything still held at the end of generation; a partial character becomes U+FFFD."""
        if self.is_stopped:
            return ""
        delta = self._commit(self._decode_tail(force=True))
        if self.is_stopped:
            return delta
        released, self._held_text = self._held_text, ""
        self.output_text += released
        return delta + released

    def _is_visible(self, token_id: int) -> bool:
        if self.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return False
        return self.tokenizer.id_to_token(token_id) is not None

    def _decode_tail(self, force: bool) -> str:
        if self.read_offset == len(self._ids):
            return ""
        decode = self.tokenizer.decode
        window = self._ids[self.prefix_offset :]
        read_text = decode(window[: self.read_offset - self.prefix_offset], self.skip_special_tokens)
        full_text = decode(window, self.skip_special_tokens)
        is_partial_char = full_text.endswith("\ufffd")
        if not force and is_partial_char and len(self._ids) - self.read_offset < MAX_HELD_TOKENS:
            return ""
        # The window only ever loses its left part, so ids before prefix_offset can go.
        del self._ids[: self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self._ids)
        return full_text[len(read_text) :]

    def _commit(self, new_text: str) -> str:
        text = self._held_text + new_text
        if not self.stop:
            self.output_text += text
            self._held_text = ""
            return text
        match = self._find_stop(text)
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            self.stopped_by = stop_str
            self._held_text = ""
            self.output_text += text[:end]
            return text[:end]
        hold = self._stop_prefix_len(text)
        committed, self._held_text = text[: len(text) - hold], text[len(text) - hold :]
        self.output_text += committed
        return committed

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop_str in self.stop:
            start = text.find(stop_str)
            if start < 0:
                continue
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        longest = 0
        for stop_str in self.stop:
            for n in range(min(len(stop_str) - 1, len(text)), longest, -1):
                if text.endswith(stop_str[:n]):
                    longest = n
                    break
        return longest
