"""Incremental detokenization: token ids in, text that is safe to send out.

Two things make streaming text harder than `decode(all_ids)` at the end:
- GPT-2's byte-level BPE may end a token inside a multi-byte UTF-8 character. An incremental UTF-8
  decoder keeps those bytes until the character is complete, so no text ever ends in a broken
  character (U+FFFD); bytes that can never become valid do decode to U+FFFD, as they would at the end.
- Stop sequences are matched on text, and one may end inside a token or span several tokens. While
  streaming we hold back the longest tail of the text that is the beginning of some stop sequence
  (never more than len(longest stop) - 1 characters), so text that turns out to be a stop sequence is
  never sent. On a match the text is cut where the stop sequence begins: the stop text and whatever
  followed it in the same token are dropped (with `include_stop`, vLLM's include_stop_str_in_output,
  it is cut where the stop sequence ends).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple, NoReturn, cast


# One per generated token: a named tuple builds in a fraction of a frozen dataclass's time.
class TokenText(NamedTuple):
    text: str  # the characters this token completed (may be "" when it ends inside a character)
    released: str  # text that may be sent to the client now (after UTF-8 and stop-sequence hold-back)
    stop_sequence: str | None  # the stop sequence this token completed, if any


# A TokenText from its fields as one tuple, by `tuple.__new__` alone (the named tuple's own `__new__` is a
# Python function): built per generated token.
_token_text_of = partial(tuple.__new__, TokenText)


def _no_text(token: int) -> str | None:
    return None


class IncrementalDetokenizer:
    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        stop_sequences: Sequence[str] = (),
        include_stop: bool = False,
        token_text: Callable[[int], str | None] | None = None,
    ):
        """`token_text`: a token's text when its bytes are whole characters, else None (a table lookup,
        `wafer_gpt2.model.tokenizer.whole_token_texts`): such a token skips the UTF-8 decoder while it holds no bytes."""
        self._token_bytes = token_bytes
        self._token_text = token_text or _no_text
        self._include_stop = include_stop
        # Made at the first token that is not whole characters: most texts never need it, and a
        # request whose text is made elsewhere (`RequestState.text_in_front`) adds no token here at all.
        self._utf8: codecs.IncrementalDecoder | None = None
        self._utf8_holds = False  # the decoder holds the first bytes of an unfinished character
        self._stops: list[str] = list(filter(None, stop_sequences))  # the empty one stops nothing
        self._longest_stop = max(map(len, self._stops), default=0)
        self._text = ""  # every complete character so far (cut at a matched stop sequence)
        self._released = 0  # how many characters of _text the caller has been given
        self.stop_sequence: str | None = None

    @property
    def text(self) -> str:
        """The generated text so far, stop sequence excluded (includes text still held back)."""
        return self._text

    def add(self, token: int, check_stops: bool = True) -> TokenText:
        """`check_stops=False` (vLLM's min_tokens not reached yet): no stop sequence ends the text here."""
        if self.stop_sequence is not None:
            raise RuntimeError("detokenizer already stopped at a stop sequence")
        piece = self._piece(token)
        previous_length = len(self._text)
        self._text += piece
        if not check_stops or not self._stops:  # nothing can stop here, nothing is held back
            if self._released == previous_length:  # nothing was held back before either
                self._released = len(self._text)
                return _token_text_of((piece, piece, None))
            return TokenText(text=piece, released=self._release(len(self._text)), stop_sequence=None)

        # Never match inside text already sent (it was sent because it could not begin a stop then).
        match = self._find_stop(search_from=max(0, previous_length - self._longest_stop + 1, self._released))
        if match is not None:
            start, stop = match
            self._text = self._text[: start + len(stop) if self._include_stop else start]
            self.stop_sequence = stop
            return TokenText(text=piece, released=self._release(len(self._text)), stop_sequence=stop)
        return TokenText(
            text=piece, released=self._release(len(self._text) - self._held_for_stops()), stop_sequence=None
        )

    def _piece(self, token: int) -> str:
        """The text `token` adds: its own where it is whole characters, else what the UTF-8 decoder
        makes of its bytes with those of an unfinished character on either side."""
        piece = None if self._utf8_holds else self._token_text(token)
        if piece is None:
            utf8 = self._utf8 or self._new_utf8()
            piece = utf8.decode(self._token_bytes(token))
            self._utf8_holds = bool(utf8.getstate()[0])
        return piece

    def _new_utf8(self) -> codecs.IncrementalDecoder:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return self._utf8

    def add_unstopped(self, token: int) -> str:
        """`add` for a detokenizer without stop sequences, where a token's text is also what it releases
        (nothing is held back): that text, without the record `add` builds (it runs per streamed token)."""
        if self._stops:
            raise RuntimeError("a detokenizer with stop sequences adds its tokens by `add`")
        piece = self._piece(token)
        self._text += piece
        self._released = len(self._text)
        return piece

    def add_all(self, tokens: Sequence[int]) -> list[str]:
        """Each token's text as `add` gives it, token after token, for a detokenizer without stop
        sequences (nothing is held back: each token's text is also what it releases), in one pass: the
        whole-character tokens looked up together, the UTF-8 decoder joining only the bytes of
        unfinished characters."""
        if self._stops:
            raise RuntimeError("a detokenizer with stop sequences adds its tokens one at a time (`add`)")
        if self.stop_sequence is not None:
            raise RuntimeError("detokenizer already stopped at a stop sequence")
        texts: list[str | None] = list(map(self._token_text, tokens))
        if self._utf8_holds or None in texts:
            utf8, holds = self._utf8 or self._new_utf8(), self._utf8_holds
            i = 0 if holds else texts.index(None)
            while i < len(texts):
                if holds or texts[i] is None:
                    texts[i] = utf8.decode(self._token_bytes(tokens[i]))
                    holds = bool(utf8.getstate()[0])
                    i += 1
                else:  # whole tokens up to the next one that is not: as they are
                    try:
                        i = texts.index(None, i)
                    except ValueError:
                        break
            self._utf8_holds = holds
        done = cast(list[str], texts)  # every token has its text now
        self._text += "".join(done)
        self._released = len(self._text)
        return done

    def flush(self) -> str:
        """At the end of a generation that did not stop on a stop sequence: release what was held back.

        Bytes of an unfinished character are dropped (a generation cut inside a character ends before it)."""
        return self._release(len(self._text))

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_for_stops(self) -> int:
        """Length of the longest unreleased tail of the text that begins some stop sequence."""
        unreleased = len(self._text) - self._released
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, unreleased), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        chunk = self._text[self._released : upto]
        self._released = upto
        return chunk


def _refuse(token: int) -> NoReturn:
    raise RuntimeError(
        f"token {token}: a request whose text is made elsewhere is given no token to detokenize"
    )


class NoText(IncrementalDetokenizer):
    """The detokenizer of a request whose text is made elsewhere (`RequestState.text_in_front`): it is
    never given a token, so one instance (`NO_TEXT`) serves them all, and a token given it is an error
    (it would mix requests' texts), not text."""

    def __init__(self) -> None:
        super().__init__(_refuse)

    def add(self, token: int, check_stops: bool = True) -> TokenText:
        _refuse(token)

    def add_unstopped(self, token: int) -> str:
        _refuse(token)

    def add_all(self, tokens: Sequence[int]) -> list[str]:
        for token in tokens:
            _refuse(token)
        return []


NO_TEXT = NoText()
