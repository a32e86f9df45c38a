"""Token-exact trajectories and the batch form the trainers consume."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles.engine import BASE_POLICY
from miles.types import Message, TerminationReason


def message_record(m: Message) -> dict[str, Any]:
    """`Message.to_dict()` plus each tool call's `raw_arguments` / `parse_error`: the lossless JSON form of a
    message (`message_from_record` is its inverse)."""
    out = m.to_dict()
    for entry, call in zip(out.get("tool_calls", []), m.tool_calls, strict=True):
        entry["raw_arguments"] = call.raw_arguments
        entry["parse_error"] = call.parse_error
    return out


def message_from_record(data: dict[str, Any]) -> Message:
    """Inverse of `message_record`; the plain `Message.to_dict()` form loads too."""
    m = Message.from_dict(data)
    for entry, call in zip(data.get("tool_calls") or [], m.tool_calls, strict=True):
        if "raw_arguments" in entry:
            call.raw_arguments = entry["raw_arguments"]
            call.parse_error = entry.get("parse_error")
            if isinstance(entry.get("function", entry).get("arguments"), str):
                call.arguments = None
    return m


def _turn_index(traj: Trajectory) -> torch.Tensor:
    """Per token of `traj`: the index of the model turn (assistant span) it belongs to, -1 elsewhere."""
    out = torch.full((len(traj),), -1, dtype=torch.int64)
    for k, span in enumerate(s for s in traj.spans if s.role == "assistant"):
        out[span.start : span.end] = k
    return out


class TrajectoryInvariantError(ValueError):
    """`token_ids`, `loss_mask` and `rollout_logprobs` disagree, or a span points outside them."""


@dataclass
class TurnSpan:
    """Tokens `[start, end)` came from one turn of `role`; model turns carry the weight version that made them."""

    role: str
    start: int
    end: int
    weight_version: int | None = None


@dataclass
class TrajectoryMeta:
    """Where a trajectory came from; `policy_id` is the policy that generated it (a LoRA adapter's name, or
    "base")."""

    env_id: str = ""
    task_id: str = ""
    seed: int | None = None
    group_id: str = ""
    sample_index: int = 0
    session_id: str = ""
    sampling_params: dict[str, Any] = field(default_factory=dict)
    policy_id: str = BASE_POLICY


@dataclass
class Trajectory:
    """One session as tokens. `loss_mask` is 1 exactly on model-generated tokens; logprobs are 0.0 elsewhere.

    `kept_counts`, when the engine recorded them (top-k/top-p sampling), holds per token how many tokens the
    sampler kept when it drew that token (0: the whole vocabulary, and on every token not generated); empty when
    nothing was recorded. The trainer renormalises its logprob of a token over its own `kept_counts` largest
    logits (`miles.engine.GenerateResult.kept_counts`).
    """

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    spans: list[TurnSpan] = field(default_factory=list)
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    termination: TerminationReason | None = None
    meta: TrajectoryMeta = field(default_factory=TrajectoryMeta)
    messages: list[Message] = field(default_factory=list)
    kept_counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.check()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest weight version among the generated tokens (None when no span carries one): the trainer
        version minus this is the sample's staleness."""
        versions = [s.weight_version for s in self.spans if s.weight_version is not None and s.end > s.start]
        return min(versions) if versions else None

    def check(self) -> None:
        """Raise `TrajectoryInvariantError` unless the per-token lists and spans are consistent."""
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise TrajectoryInvariantError(
                f"lengths differ: token_ids={n} loss_mask={len(self.loss_mask)} "
                f"rollout_logprobs={len(self.rollout_logprobs)}"
            )
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.rollout_logprobs, strict=True)):
            if m not in (0, 1):
                raise TrajectoryInvariantError(f"loss_mask[{i}]={m} is not 0 or 1")
            if m == 0 and lp != 0.0:
                raise TrajectoryInvariantError(f"rollout_logprobs[{i}]={lp} on a masked-out token")
        if self.kept_counts:
            if len(self.kept_counts) != n:
                raise TrajectoryInvariantError(
                    f"kept_counts has {len(self.kept_counts)} entries for {n} tokens"
                )
            for i, (m, k) in enumerate(zip(self.loss_mask, self.kept_counts, strict=True)):
                if k < 0 or (m == 0 and k != 0):
                    raise TrajectoryInvariantError(f"kept_counts[{i}]={k} (loss_mask {m})")
        prev_end = 0
        for s in self.spans:
            if not (prev_end <= s.start <= s.end <= n):
                raise TrajectoryInvariantError(f"span {s} is out of order or outside [0, {n}]")
            prev_end = s.end

    def append(
        self,
        ids: list[int],
        *,
        role: str,
        generated: bool,
        logprobs: list[float] | None = None,
        weight_version: int | None = None,
        kept_counts: list[int] | None = None,
    ) -> TurnSpan:
        """Append one turn's tokens verbatim; generated tokens get mask 1, their logprobs and, when the engine
        reported them, their kept counts (the first counts recorded give every earlier token 0)."""
        if generated and (logprobs is None or len(logprobs) != len(ids)):
            raise TrajectoryInvariantError("generated tokens need one logprob each")
        if kept_counts is not None and (not generated or len(kept_counts) != len(ids)):
            raise TrajectoryInvariantError("kept counts need generated tokens, one count each")
        start = len(self.token_ids)
        if kept_counts is not None or self.kept_counts:
            if not self.kept_counts:
                self.kept_counts = [0] * start
            self.kept_counts.extend(
                [int(k) for k in kept_counts] if kept_counts is not None else [0] * len(ids)
            )
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if generated else 0] * len(ids))
        self.rollout_logprobs.extend(logprobs if generated and logprobs is not None else [0.0] * len(ids))
        span = TurnSpan(role=role, start=start, end=len(self.token_ids), weight_version=weight_version)
        self.spans.append(span)
        return span

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "spans": [asdict(s) for s in self.spans],
            "reward": self.reward,
            "reward_components": self.reward_components,
            "termination": self.termination.value if self.termination else None,
            "meta": asdict(self.meta),
            "messages": [message_record(m) for m in self.messages],
        } | ({"kept_counts": self.kept_counts} if self.kept_counts else {})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        term = data.get("termination")
        return cls(
            token_ids=list(data["token_ids"]),
            loss_mask=list(data["loss_mask"]),
            rollout_logprobs=[float(x) for x in data["rollout_logprobs"]],
            spans=[TurnSpan(**s) for s in data.get("spans", [])],
            reward=float(data.get("reward", 0.0)),
            reward_components=dict(data.get("reward_components", {})),
            termination=TerminationReason(term) if term else None,
            meta=TrajectoryMeta(**data.get("meta", {})),
            messages=[message_from_record(m) for m in data.get("messages", [])],
            kept_counts=[int(k) for k in data.get("kept_counts") or []],
        )

    def to_json(self) -> str:
        """One JSON line, lossless: floats are written with full precision."""
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))


@dataclass
class TrajectoryBatch:
    """Trajectories packed end to end into flat tensors (padding-free), with offsets per sequence.

    `advantages` has one entry per sequence; `group_ids` maps each sequence to its GRPO group;
    `oldest_versions` holds each sequence's oldest generating weight version (-1: unknown); `policy_ids` the
    policy that generated each sequence (an adapter's name or "base"; empty: all "base"). `kept_counts` (None
    when no trajectory recorded any) holds each token's sampler kept count (`Trajectory.kept_counts`; 0: the
    whole vocabulary).
    """

    token_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # float32 [T]
    rollout_logprobs: torch.Tensor  # float32 [T]
    cu_seqlens: torch.Tensor  # int64 [B+1]
    rewards: torch.Tensor  # float32 [B]
    group_ids: torch.Tensor  # int64 [B]
    meta: list[dict[str, Any]] = field(default_factory=list)
    oldest_versions: torch.Tensor | None = None  # int64 [B]
    policy_ids: tuple[str, ...] = ()
    turn_index: torch.Tensor | None = (
        None  # int64 [T]: the model turn a token belongs to (0, 1, ...; -1: not the model's)
    )
    kept_counts: torch.Tensor | None = None  # int64 [T]: top-k/top-p kept counts (0: the whole vocabulary)

    def __post_init__(self) -> None:
        if not self.policy_ids and self.meta:
            self.policy_ids = tuple(str(m.get("policy_id", BASE_POLICY)) for m in self.meta)

    def policy_of(self, i: int) -> str:
        """The policy that generated sequence `i`."""
        return self.policy_ids[i] if self.policy_ids else BASE_POLICY

    def select(self, indices: list[int]) -> TrajectoryBatch:
        """The sub-batch of sequences `indices` (in that order), packed anew; group ids keep their values."""
        spans = [self.sequence(i) for i in indices]
        lengths = torch.tensor([s.stop - s.start for s in spans], dtype=torch.int64)
        cu = torch.zeros(len(indices) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        idx = torch.tensor(indices, dtype=torch.int64)

        def tokens(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[s] for s in spans]) if spans else t[:0]

        return TrajectoryBatch(
            token_ids=tokens(self.token_ids),
            loss_mask=tokens(self.loss_mask),
            rollout_logprobs=tokens(self.rollout_logprobs),
            cu_seqlens=cu,
            rewards=self.rewards[idx],
            group_ids=self.group_ids[idx],
            meta=[self.meta[i] for i in indices] if self.meta else [],
            oldest_versions=None if self.oldest_versions is None else self.oldest_versions[idx],
            policy_ids=tuple(self.policy_of(i) for i in indices),
            turn_index=None if self.turn_index is None else tokens(self.turn_index),
            kept_counts=None if self.kept_counts is None else tokens(self.kept_counts),
        )

    def staleness(self, trainer_version: int) -> torch.Tensor:
        """Per sequence: `trainer_version` minus its oldest generating version (0 where unknown)."""
        if self.oldest_versions is None:
            return torch.zeros(self.num_sequences, dtype=torch.int64)
        known = self.oldest_versions >= 0
        return torch.where(
            known, trainer_version - self.oldest_versions, torch.zeros_like(self.oldest_versions)
        )

    @property
    def num_sequences(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory]) -> TrajectoryBatch:
        """Pack trajectories; group ids are assigned in order of first appearance of `meta.group_id`."""
        groups: dict[str, int] = {}
        lengths = [len(t) for t in trajectories]
        cu = torch.zeros(len(trajectories) + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        return cls(
            token_ids=torch.tensor([i for t in trajectories for i in t.token_ids], dtype=torch.int64),
            loss_mask=torch.tensor([m for t in trajectories for m in t.loss_mask], dtype=torch.float32),
            rollout_logprobs=torch.tensor(
                [x for t in trajectories for x in t.rollout_logprobs], dtype=torch.float32
            ),
            cu_seqlens=cu,
            rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            group_ids=torch.tensor(
                [
                    groups.setdefault(t.meta.group_id or f"_{i}", len(groups))
                    for i, t in enumerate(trajectories)
                ],
                dtype=torch.int64,
            ),
            meta=[asdict(t.meta) for t in trajectories],
            oldest_versions=torch.tensor(
                [-1 if t.oldest_weight_version is None else t.oldest_weight_version for t in trajectories],
                dtype=torch.int64,
            ),
            policy_ids=tuple(t.meta.policy_id for t in trajectories),
            turn_index=torch.cat([_turn_index(t) for t in trajectories])
            if trajectories
            else torch.zeros(0, dtype=torch.int64),
            kept_counts=torch.tensor(
                [k for t in trajectories for k in (t.kept_counts or [0] * len(t))], dtype=torch.int64
            )
            if any(t.kept_counts for t in trajectories)
            else None,
        )

    def sequence(self, i: int) -> slice:
        return slice(int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1]))

    def save(self, path: str | Path) -> None:
        """Write the tensors as safetensors, with the metadata as a JSON header entry."""
        tensors = {
            k: getattr(self, k).contiguous()
            for k in (
                "token_ids",
                "loss_mask",
                "rollout_logprobs",
                "cu_seqlens",
                "rewards",
                "group_ids",
                "oldest_versions",
                "turn_index",
                "kept_counts",
            )
            if getattr(self, k) is not None
        }
        save_file(tensors, str(path), metadata={"meta": json.dumps(self.meta)})

    @classmethod
    def load(cls, path: str | Path) -> TrajectoryBatch:
        from safetensors import safe_open

        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "[]"))
        fields: dict[str, Any] = {**tensors, "meta": meta}
        return cls(**fields)
