"""The mismatch check: accumulated ids against the canonical re-render, differences classified."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from enum import Enum

from miles.trajectory import TurnSpan


class MismatchKind(str, Enum):
    """What a difference touches: special tokens, text the model generated, or text it did not."""

    SPECIAL_TOKENS = "special_tokens"
    ASSISTANT_TEXT = "assistant_text"
    NON_ASSISTANT_TEXT = "non_assistant_text"


@dataclass
class Mismatch:
    """Accumulated ids `[acc_start, acc_end)` differ from canonical ids `[canon_start, canon_end)`."""

    kind: MismatchKind
    acc_start: int
    acc_end: int
    canon_start: int
    canon_end: int
    accumulated_text: str
    canonical_text: str
    explanation: str | None = None

    @property
    def num_tokens(self) -> int:
        return max(self.acc_end - self.acc_start, self.canon_end - self.canon_start)


@dataclass
class TITOReport:
    """The result of one check. `exact` means token-for-token equality with the canonical render."""

    family: str
    num_tokens: int
    num_canonical_tokens: int
    compared_tokens: int
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.mismatches

    @property
    def unexplained(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.explanation is None]

    @property
    def ok(self) -> bool:
        """No difference that the family handler does not explain."""
        return not self.unexplained

    def counts(self) -> dict[str, int]:
        """Mismatching tokens per kind (explained ones included), plus `explained`."""
        out = {k.value: 0 for k in MismatchKind}
        out["explained"] = 0
        for m in self.mismatches:
            out[m.kind.value] += m.num_tokens
            if m.explanation is not None:
                out["explained"] += m.num_tokens
        return out

    def metrics(self, prefix: str = "tito/") -> dict[str, float]:
        """Per-session metrics: exactness, mismatch regions, and mismatching tokens per kind."""
        out = {
            f"{prefix}exact": float(self.exact),
            f"{prefix}ok": float(self.ok),
            f"{prefix}mismatches": float(len(self.mismatches)),
            f"{prefix}unexplained_mismatches": float(len(self.unexplained)),
        }
        out.update({f"{prefix}mismatch_tokens_{k}": float(v) for k, v in self.counts().items()})
        return out

    def summary(self) -> str:
        if self.exact:
            return f"TITO check ({self.family}): exact over {self.compared_tokens} tokens"
        lines = [
            f"TITO check ({self.family}): {len(self.mismatches)} mismatch(es), "
            f"{len(self.unexplained)} unexplained, over {self.compared_tokens} tokens"
        ]
        for m in self.mismatches[:8]:
            lines.append(
                f"  {m.kind.value} acc[{m.acc_start}:{m.acc_end}]={m.accumulated_text!r} "
                f"canon[{m.canon_start}:{m.canon_end}]={m.canonical_text!r}"
                + (f" ({m.explanation})" if m.explanation else "")
            )
        return "\n".join(lines)


#: The explanation of a difference that lies wholly in tokens the model generated: they are trained as generated,
#: so a re-render that spells them otherwise (a malformed tool call, a non-canonical tokenization) changes nothing.
GENERATED = "the model's own tokens, trained as generated"


#: An addition right where TITO closed a turn the model did not end (cut by the token limit): the re-render
#: completes what the model had no room to write.
CUT = "the model's turn was cut before it ended; the re-render completes it"


def _generated(spans: Sequence[TurnSpan], start: int, end: int) -> bool:
    """Whether every token of `[start, end)` lies in a generated (role "assistant") span; for an empty range
    (the re-render has tokens the model did not write there), whether the token after it does: the re-render
    writes the model's turn otherwise (a call wrapped in the template's syntax, say)."""
    if end == start:
        end = start + 1
    covered = start
    for s in sorted((s for s in spans if s.role == "assistant"), key=lambda s: s.start):
        if s.start <= covered < s.end:
            covered = s.end
    return covered >= end


def _span_roles(spans: Sequence[TurnSpan], start: int, end: int) -> set[str]:
    lo, hi = (start, end) if end > start else (max(start - 1, 0), start + 1)
    return {s.role for s in spans if s.start < hi and lo < s.end}


def compare_ids(
    accumulated: Sequence[int],
    canonical: Sequence[int],
    *,
    spans: Sequence[TurnSpan],
    special_ids: set[int],
    decode: Callable[[Sequence[int]], str],
    family: str,
    explain: Callable[[str, str], str | None],
    num_tokens: int | None = None,
    anchors: Sequence[tuple[int, int]] = (),
) -> TITOReport:
    """Diff two id sequences and classify each differing region.

    `anchors` are `(accumulated, canonical)` positions known to correspond: where the template's own render of
    the conversation so far ends (after the prompt, after each observation with its generation prompt). Each
    stretch between two anchors (one model turn, its close and the observation after it) is diffed on its own,
    so a difference is judged within the turn it belongs to: one diff over the whole sequence can pair a turn's
    tokens with a repeated observation of another turn once the re-render spells a model turn otherwise (a
    nested or cut tool call). Anchors out of order are ignored.

    A region is `special_tokens` when either side holds a special token, else `assistant_text` when it touches
    a generated (role "assistant") span, else `non_assistant_text`. The family handler explains known template
    differences; a region wholly inside generated tokens is explained as `GENERATED`, an addition where TITO
    closed a cut turn as `CUT`.
    """
    acc, canon = list(accumulated), list(canonical)
    report = TITOReport(
        family=family,
        num_tokens=num_tokens if num_tokens is not None else len(acc),
        num_canonical_tokens=len(canon),
        compared_tokens=len(acc),
    )
    if acc == canon:
        return report
    regions = []
    a_cur = c_cur = 0
    for a, c in [*anchors, (len(acc), len(canon))]:
        if a_cur <= a <= len(acc) and c_cur <= c <= len(canon):
            regions.append((a_cur, a, c_cur, c))
            a_cur, c_cur = a, c
    for lo, hi, clo, chi in regions:
        head = 0
        limit = min(hi - lo, chi - clo)
        while head < limit and acc[lo + head] == canon[clo + head]:
            head += 1
        tail = 0
        while tail < limit - head and acc[hi - 1 - tail] == canon[chi - 1 - tail]:
            tail += 1
        lo, clo, hi, chi = lo + head, clo + head, hi - tail, chi - tail
        matcher = SequenceMatcher(None, acc[lo:hi], canon[clo:chi], autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag != "equal":
                report.mismatches.append(
                    _classify(
                        acc, canon, lo + i1, lo + i2, clo + j1, clo + j2, spans, special_ids, decode, explain
                    )
                )
    return report


def _classify(
    acc: list[int],
    canon: list[int],
    a0: int,
    a1: int,
    c0: int,
    c1: int,
    spans: Sequence[TurnSpan],
    special_ids: set[int],
    decode: Callable[[Sequence[int]], str],
    explain: Callable[[str, str], str | None],
) -> Mismatch:
    """The `Mismatch` for accumulated `[a0, a1)` against canonical `[c0, c1)`: its kind and explanation."""
    a_ids, c_ids = acc[a0:a1], canon[c0:c1]
    a_text, c_text = decode(a_ids), decode(c_ids)
    explanation = explain(a_text, c_text)
    if explanation is None and _generated(spans, a0, a1):
        explanation = GENERATED
    elif explanation is None and a1 == a0 and any(s.role == "close" and s.start == a0 for s in spans):
        explanation = CUT
    if any(i in special_ids for i in a_ids) or any(i in special_ids for i in c_ids):
        kind = MismatchKind.SPECIAL_TOKENS
    elif "assistant" in _span_roles(spans, a0, a1):
        kind = MismatchKind.ASSISTANT_TEXT
    else:
        kind = MismatchKind.NON_ASSISTANT_TEXT
    return Mismatch(
        kind=kind,
        acc_start=a0,
        acc_end=a1,
        canon_start=c0,
        canon_end=c1,
        accumulated_text=a_text,
        canonical_text=c_text,
        explanation=explanation,
    )
