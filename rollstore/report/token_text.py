"""Token ids as text, for every view that shows a response token by token (`rollstore audit
--rollout` in the terminal, `rollstore report` in HTML): one rule, so both show the same pieces.

Invariants:
- With a tokenizer (the newest checkpoint's `tokenizer.json` in the snapshot), token t is
  `decode([t])`; a token that decodes to nothing (or a negative id) is shown as `[t]` and flagged
  special, as is one that `skip_special_tokens` removes.
- Without one, token i is character i of the response when the text has one character per token
  (character-level policies; the last token may be the EOS, which has no character), else `[t]`.
- `pieces` returns text only; escaping is the caller's job (HTML escapes it, rich prints it as
  plain text, never as markup).
"""

from __future__ import annotations

import os
import warnings

from rollstore.queries.session import Session


class TokenText:
    """Token ids as text: the tokenizer of the newest checkpoint in the buffer when it has one,
    else one character per token when the response text has that length (character-level
    policies, as `rollstore audit --rollout` does), else `[id]`."""

    def __init__(self, tokenizer=None, source: str | None = None):
        self.tokenizer = tokenizer
        self.source = source

    @classmethod
    def for_snapshot(cls, session: Session) -> TokenText:
        from tokenizers import Tokenizer

        rows = session.execute("SELECT path FROM checkpoints ORDER BY version DESC").fetchall()
        for (path,) in rows:
            file = os.path.join(session.root, path, "tokenizer.json")
            if os.path.exists(file):
                try:
                    return cls(Tokenizer.from_file(file), os.path.join(path, "tokenizer.json"))
                except Exception as exc:  # noqa: BLE001  (tokenizers raises plain Exception; it only costs decoding)
                    warnings.warn(f"{file}: not readable ({exc}); tokens are shown without it", stacklevel=2)
        return cls()

    def pieces(self, response: str, token_ids: list[int], tokens_total: int) -> tuple[list[str], list[bool]]:
        """(text of each token, whether it is a special/undecodable token shown by name or id)."""
        if self.tokenizer is not None:
            out, special = [], []
            for t in token_ids:
                text = self.tokenizer.decode([t], skip_special_tokens=False) if t >= 0 else ""
                if not text:
                    out.append(f"[{t}]")
                    special.append(True)
                else:
                    is_special = self.tokenizer.decode([t], skip_special_tokens=True) == ""
                    out.append(text)
                    special.append(is_special)
            return out, special
        if len(response) in (tokens_total, tokens_total - 1):
            return ([response[i] if i < len(response) else f"[{t}]" for i, t in enumerate(token_ids)],
                    [i >= len(response) for i in range(len(token_ids))])
        return [f"[{t}]" for t in token_ids], [True] * len(token_ids)
