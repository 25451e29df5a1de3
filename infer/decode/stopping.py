"""Where a generation stops: every committed token examined in order, as plain decoding examines it.

Plain decoding commits one token per step and asks after each: is it an end-of-sequence token, does the text now
hold a stop string, is the token budget spent (in that order). A verification commits several tokens at once, so
``StopRules.scan`` examines them one at a time, in order, with the same questions, and the generation ends at the
first token where plain decoding would have ended, with its reason: the position and the reason never depend on how
many tokens a step committed. What a scan learns of the text is kept between calls (``TextTail``), so each committed
token costs about one decode of a few tokens and a search of a few characters, whatever the output's length.

A stop string matches, as transformers' ``StopStringCriteria`` matches it, when it ends in the text a committed token
added: it may begin earlier, also in the prompt's text (a prompt ending in ``"\\n"`` with stop string ``"\\n\\n"``
stops at a first token ``"\\n"``), but a stop string wholly inside the prompt matches nothing. The output (the tokens
up to and including the one that completed the match) is kept, as transformers keeps it. The text is the engine's
``decode`` of the tokens (``LoadedModel.decode`` skips special tokens), grown token by token; a decoder whose clean-up
rewrites characters already given out (``" n't"`` -> ``"n't"``) is read as the token-by-token text shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
"""What a decoder shows for bytes that do not (yet) form a character: text ending in it waits for the next token."""
PREFIX_TOKENS = 5
"""Tokens before the new ones that each decode re-reads, so a decoder's joins (a word's leading space, a character
split over several tokens) come out as in the whole text."""
SPAN_TOKENS = 16
"""Tokens a decode may read past its prefix before the prefix moves up to the last ones: one decode per token, and one
more every ``SPAN_TOKENS``."""
MAX_PENDING = 16
"""Tokens that may wait for their text (an unfinished character, special tokens the decoder skips) before the scan
moves on without it: a bound on each decode's length."""


class TextTail:
    """The text of a token stream, grown one token at a time: ``push`` gives the characters a token added.

    Incremental detokenization: the window holds a few tokens whose text is known (the prefix) and the tokens after
    them; the text a token adds is what ``decode(window)`` shows past the characters given out already. Text that ends
    in an unfinished character waits for the next token. Only ``decode`` (ids -> str) is asked of the tokenizer, and
    each call reads at most ``PREFIX_TOKENS + SPAN_TOKENS + MAX_PENDING`` tokens.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int]):
        self.decode = decode
        self.window = list(context)
        """The prefix, then the tokens pushed since (their text given out, or pending)."""
        self.seen = 0
        """Characters of ``decode(window)`` given out (or the prefix's)."""
        self.pending = 0
        """Tokens pushed since the last that gave out text."""
        self._rebase()

    def push(self, token: int) -> str:
        """The characters ``token`` adds to the text ("" while a character is unfinished, or for a skipped token)."""
        self.window.append(int(token))
        text = self.decode(self.window)
        if len(text) <= self.seen or text.endswith(REPLACEMENT):
            self.pending += 1
            if self.pending > MAX_PENDING:  # no text for many tokens: move on without it
                self._rebase()
            return ""
        new, self.seen, self.pending = text[self.seen:], len(text), 0
        if len(self.window) >= PREFIX_TOKENS + SPAN_TOKENS:
            self._rebase()
        return new

    def _rebase(self) -> None:
        """The last ``PREFIX_TOKENS`` tokens become the prefix (their text counted as given out)."""
        self.window = self.window[len(self.window) - PREFIX_TOKENS:] if len(self.window) > PREFIX_TOKENS \
            else self.window
        self.seen = len(self.decode(self.window)) if self.window else 0
        self.pending = 0


class StopScan:
    """One generation's stop-string search: ``push`` each committed token in order; True when a stop string ends in
    the text that token added (see the module docstring for what matches)."""

    def __init__(self, stop_strings: Sequence[str], decode: Callable[[list[int]], str], prompt: Sequence[int]):
        self.stop_strings = tuple(stop_strings)
        self.keep = max(len(s) for s in self.stop_strings) - 1
        """Characters of the text before a token that a match ending in the token's text can reach back into."""
        self.text = TextTail(decode, prompt)
        self.tail = last(decode(list(prompt)) if prompt else "", self.keep)
        """The last ``keep`` characters of the text so far (the prompt's, then the generated tokens')."""

    def push(self, token: int) -> bool:
        """Whether a stop string ends in the characters ``token`` adds to the text."""
        new = self.text.push(token)
        if not new:
            return False
        text, before = self.tail + new, len(self.tail)
        hit = any(text.find(s, max(0, before - len(s) + 1)) >= 0 for s in self.stop_strings)
        self.tail = last(text, self.keep)
        return hit


def last(text: str, n: int) -> str:
    """The last ``n`` characters of ``text`` (all of it when shorter; none for n = 0)."""
    return text[max(0, len(text) - n):]


class StopRules:
    """The stop conditions of one generation, asked after every committed token in order, as plain decoding asks:
    an end-of-sequence token ('eos'), a stop string ('stop_string'), the token budget ('length')."""

    def __init__(self, eos: frozenset[int], max_new_tokens: int, strings: StopScan | None = None):
        self.eos, self.max_new_tokens, self.strings = eos, max_new_tokens, strings

    def scan(self, tokens: Sequence[int], start: int) -> tuple[int, str] | None:
        """Examine ``tokens[start:]`` (the generated tokens; those before ``start`` examined already), one at a time:
        (how many tokens the output keeps, why it ends) at the first stop, or None."""
        for j in range(start, len(tokens)):
            reason = self.check(tokens[j], j + 1)
            if reason is not None:
                return j + 1, reason
        return None

    def check(self, token: int, count: int) -> str | None:
        """Why plain decoding stops after committing ``token`` as its ``count``-th generated token, or None."""
        if token in self.eos:
            return "eos"
        if self.strings is not None and self.strings.push(token):
            return "stop_string"
        if count >= self.max_new_tokens:
            return "length"
        return None
