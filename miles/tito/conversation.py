"""`Conversation`: one session's ids, grown append-only from the first prompt, engine outputs and deltas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles.engine import FinishReason
from miles.tito.errors import ConversationStateError, InvalidTokenError, TITOMismatchError
from miles.tito.report import TITOReport, compare_ids
from miles.tito.tokenizer import MessageLike
from miles.trajectory import Trajectory
from miles.types import Message

if TYPE_CHECKING:
    from miles.tito.tokenizer import TITOTokenizer

PROMPT, ASSISTANT, CLOSE, OBSERVATION = "prompt", "assistant", "close", "observation"


def _as_message(m: MessageLike) -> Message:
    return m if isinstance(m, Message) else Message.from_dict(m)


class Conversation:
    """The token record of one session. Earlier ids are never re-tokenized.

    Spans: "prompt" (first render), "assistant" (engine output, loss mask 1), "close" (a stop token that the
    engine did not emit, inserted with loss mask 0), "observation" (tool results / user messages and the next
    generation prompt, loss mask 0).
    """

    def __init__(self, tito: TITOTokenizer, messages: Sequence[MessageLike], tools: list[dict] | None = None):
        self.tito = tito
        self.tools = list(tools) if tools else None
        self.messages: list[Message] = [_as_message(m) for m in messages]
        self._traj = Trajectory()
        self._traj.append(
            tito.render_ids(self.messages, self.tools, add_generation_prompt=True),
            role=PROMPT,
            generated=False,
        )
        self._turn_start = len(self._traj.token_ids)  # where the current, not yet recorded, model turn begins
        # (ids, messages): ends of the prompt and of each observation, where the ids are the template's render
        # of that many messages plus the generation prompt
        self._marks: list[tuple[int, int]] = [(self._turn_start, len(self.messages))]
        self._generating = False  # engine output appended since the last observation
        self._closed = False  # the current model turn ends with a stop token
        self._recorded_final = False  # finish() recorded the last assistant message
        self.finish_reasons: list[FinishReason] = []
        self.finished = False

    def __len__(self) -> int:
        return len(self._traj.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        """Every id so far; before a generation it ends with the generation prompt. Send this to the engine."""
        return list(self._traj.token_ids)

    @property
    def last_turn_closed(self) -> bool:
        """Whether the current model turn has ended with a stop token."""
        return self._generating and self._closed

    @property
    def trajectory(self) -> Trajectory:
        """The trajectory so far (ids, mask, logprobs, spans with weight versions, recorded messages)."""
        self._traj.messages = list(self.messages)
        return self._traj

    def _require_open(self) -> None:
        if self.finished:
            raise ConversationStateError("the conversation is finished")

    def append_generation(
        self,
        output_ids: Sequence[int],
        logprobs: Sequence[float] | None,
        *,
        weight_version: int,
        finish_reason: FinishReason,
        token_versions: Sequence[int] | None = None,
        kept_counts: Sequence[int] | None = None,
    ) -> str:
        """Append engine output verbatim (loss mask 1, its logprobs) and return its text without the stop token.

        A generation that did not end in a stop token may be continued by another `append_generation`.
        `token_versions` (one per output id, when the engine reports them) splits the output into one span per
        weight version, so a turn that spanned a weight update records which tokens each version made; without
        it the whole output is `weight_version`'s. `kept_counts` (one per output id, when the engine reports
        them: `GenerateResult.kept_counts`) go into the trajectory for sampling-mask replay.
        """
        self._require_open()
        if self.last_turn_closed:
            raise ConversationStateError(
                "the model turn already ended with a stop token; append an observation or finish first"
            )
        ids = [int(i) for i in output_ids]
        bad = [i for i in ids if not 0 <= i < self.tito.vocab_size]
        if bad:
            raise InvalidTokenError(
                f"output ids outside the vocabulary [0, {self.tito.vocab_size}): {bad[:5]}"
            )
        lps = [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        if len(lps) != len(ids):
            raise InvalidTokenError(f"{len(ids)} output ids but {len(lps)} logprobs")
        versions = [weight_version] * len(ids) if token_versions is None else [int(v) for v in token_versions]
        if len(versions) != len(ids):
            raise InvalidTokenError(f"{len(ids)} output ids but {len(versions)} token versions")
        kept = None if kept_counts is None else [int(k) for k in kept_counts]
        if kept is not None and len(kept) != len(ids):
            raise InvalidTokenError(f"{len(ids)} output ids but {len(kept)} kept counts")
        start = 0
        for end in range(1, len(ids) + 1):  # one span per run of equal versions
            if end == len(ids) or versions[end] != versions[start]:
                self._traj.append(
                    ids[start:end],
                    role=ASSISTANT,
                    generated=True,
                    logprobs=lps[start:end],
                    weight_version=versions[start],
                    kept_counts=None if kept is None else kept[start:end],
                )
                start = end
        if not ids:
            self._traj.append([], role=ASSISTANT, generated=True, logprobs=[], weight_version=weight_version)
        self._generating = True
        self._closed = bool(ids) and self.tito.is_stop(ids[-1])
        self.finish_reasons.append(FinishReason(finish_reason))
        text_ids = ids[:-1] if ids and self.tito.is_stop(ids[-1]) else ids
        return self.tito.decode(text_ids)

    def _close_turn(self) -> list[int]:
        if self.last_turn_closed:
            return []
        self._traj.append([self.tito.close_token_id], role=CLOSE, generated=False)
        self._closed = True
        return [self.tito.close_token_id]

    def append_observation(self, assistant: MessageLike, observation: Sequence[MessageLike]) -> list[int]:
        """Record the parsed assistant message and append `observation` plus the next generation prompt.

        Returns the appended ids (loss mask 0): the closing stop token when the engine did not emit one, then
        the template's delta for `observation`.
        """
        self._require_open()
        if not self._generating:
            raise ConversationStateError("append_observation needs a generation first")
        obs = [_as_message(m) for m in observation]
        delta_ids = self.tito.observation_delta(obs)
        closed = self._close_turn()
        self._traj.append(delta_ids, role=OBSERVATION, generated=False)
        self.messages.append(_as_message(assistant))
        self.messages.extend(obs)
        self._generating = False
        self._turn_start = len(self._traj.token_ids)
        self._marks.append((self._turn_start, len(self.messages)))
        return closed + delta_ids

    def finish(self, assistant: MessageLike | None = None) -> None:
        """Close the conversation; record the last assistant message if given and close its turn.

        Without a generation since the last observation there is no turn to record (`assistant` must be None).
        """
        self._require_open()
        if assistant is not None and not self._generating:
            raise ConversationStateError("finish(assistant) needs a generation since the last observation")
        if self._generating:
            self._close_turn()
        if assistant is not None:
            self.messages.append(_as_message(assistant))
            self._recorded_final = True
        self.finished = True

    def canonical_ids(self) -> tuple[list[int], int]:
        """The canonical render to compare with, and how many accumulated ids it covers.

        A model turn that is not recorded as a message is left out of the comparison.
        """
        tito, n = self.tito, len(self._traj.token_ids)
        if self._recorded_final:
            return tito.cut_after_last_stop(tito.render_ids(self.messages, self.tools)), n
        covered = self._turn_start if self._generating else n
        return tito.render_ids(self.messages, self.tools, add_generation_prompt=True), covered

    def turn_anchors(self, canonical: Sequence[int], covered: int) -> list[tuple[int, int]]:
        """`(accumulated, canonical)` positions that correspond: the end of the prompt and of each observation
        up to `covered`, paired with the length of the template's render of the messages recorded by then (plus
        the generation prompt), where that render is a token prefix of `canonical`. A template that re-renders
        earlier turns once more follow (Qwen3 dropping older thinking) gives no anchor there."""
        out = []
        for pos, count in self._marks:
            if pos >= covered:  # the render of everything covered is `canonical` itself
                break
            prefix = self.tito.render_ids(self.messages[:count], self.tools, add_generation_prompt=True)
            if list(canonical[: len(prefix)]) == prefix:
                out.append((pos, len(prefix)))
        return out

    def check(self, strict: bool = False) -> TITOReport:
        """Re-render the recorded messages canonically and classify every difference from the accumulated ids,
        turn by turn (`turn_anchors`, rendered only when the ids are not exact).

        `strict=True` raises `TITOMismatchError` when a difference is not explained by the family handler.
        """
        canonical, covered = self.canonical_ids()
        acc = self._traj.token_ids[:covered]
        report = compare_ids(
            acc,
            canonical,
            spans=self._traj.spans,
            special_ids=self.tito.special_ids,
            decode=self.tito.decode,
            family=self.tito.family,
            explain=self.tito.handler.explain,
            num_tokens=len(self._traj.token_ids),
            anchors=[] if acc == canonical else self.turn_anchors(canonical, covered),
        )
        if strict and not report.ok:
            raise TITOMismatchError(report)
        return report
