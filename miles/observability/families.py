"""Every metric family miles exports, declared once: name, kind, help, labels and buckets.

Naming follows Prometheus' conventions: a `miles_` prefix, base units in the name (`_seconds`, `_tokens`,
`_bytes`, `_ratio`), and `_total` on counters. The process collector's standard `process_*` families are
exported beside these.

**The cardinality rule.** Every label has a small, bounded set of values within a run:

- `run` (one per `miles train`), `env` (the env id), `model` (the policy's name), `adapter` (the LoRA
  adapter, `base` without one), `engine` (an engine id), and per-family ones: a `TerminationReason`, a
  finish reason, a `ToolErrorType`, a tool name *from the env's schema* (a name the model made up is
  counted as `unknown`), a reward component (the env's `@reward` hooks), a step phase, a sync method, an
  attempt's error class, a router placement or state, a CUDA device index.
- Never a label: the weight version (a gauge, `miles_weight_version` and `miles_engine_weight_version`),
  session/group/task ids, prompts, step numbers, or anything else that grows with the run. One label value
  per version would create a new set of series at every sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]

#: Labels of everything a session, a step or a trainer reports.
RUN_LABELS = ("run", "env", "model", "adapter")
#: Labels of what one engine reports (the embedded engine's own families and the router's view of it).
ENGINE_LABELS = ("run", "model", "engine")
#: Labels of the weight-sync families (a sync moves one policy, whatever the env).
POLICY_LABELS = ("run", "model", "adapter")

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
TURN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 64)
REWARD_BUCKETS = (-1.0, -0.5, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)


@dataclass(frozen=True)
class Family:
    """One exported metric family. `source` names what feeds it: `session` (a finished `SessionRecord`),
    `engine` (an embedded engine, read at scrape time), `router` (the scheduler's router stats), `step`
    (the train loop's step row), `train` (the trainer's metrics), `sync` (a `SyncReport`), `gpu` (the CUDA
    caching allocator, read at scrape time), `async` (the async loop's hooks; unfed by the synchronous
    loop)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    source: str
    buckets: tuple[float, ...] = ()

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names Prometheus stores for this family."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _h(name: str, help_: str, labels: tuple[str, ...], source: str, buckets: tuple[float, ...]) -> Family:
    return Family(name, "histogram", help_, labels, source, tuple(float(b) for b in buckets))


S, E, P = RUN_LABELS, ENGINE_LABELS, POLICY_LABELS

FAMILIES: tuple[Family, ...] = (
    # ---- sessions (from each finished SessionRecord) ---------------------------------------------------
    _h(
        "miles_session_duration_seconds",
        "Wall time of a session, reset to end.",
        S,
        "session",
        LATENCY_BUCKETS,
    ),
    _h("miles_session_turns", "Model turns per session.", S, "session", TURN_BUCKETS),
    _h(
        "miles_session_generated_tokens",
        "Tokens the model generated in a session.",
        S,
        "session",
        TOKEN_BUCKETS,
    ),
    _h(
        "miles_session_reward",
        "Session reward (the env's weighted reward). Buckets reach below 0, so the client "
        "exports no _sum (it could decrease); the mean is miles_rollout_reward_mean.",
        S,
        "session",
        REWARD_BUCKETS,
    ),
    _h(
        "miles_session_reward_component",
        "Each reward component of a session.",
        (*S, "component"),
        "session",
        REWARD_BUCKETS,
    ),
    Family(
        "miles_sessions_total",
        "counter",
        "Sessions ended, by termination reason.",
        (*S, "termination"),
        "session",
    ),
    _h(
        "miles_turn_generate_seconds",
        "Latency of a turn's successful generate call.",
        (*S, "engine"),
        "session",
        LATENCY_BUCKETS,
    ),
    _h(
        "miles_turn_queue_seconds",
        "Time a turn waited for an engine slot (all its attempts).",
        (*S, "engine"),
        "session",
        LATENCY_BUCKETS,
    ),
    _h(
        "miles_turn_env_seconds",
        "Time of a turn's env step (tool calls included).",
        S,
        "session",
        LATENCY_BUCKETS,
    ),
    _h(
        "miles_turn_output_tokens",
        "Tokens generated in one turn (response length).",
        (*S, "engine"),
        "session",
        TOKEN_BUCKETS,
    ),
    Family(
        "miles_turn_prompt_tokens_total",
        "counter",
        "Prompt tokens sent with turns.",
        (*S, "engine"),
        "session",
    ),
    Family(
        "miles_turn_cached_tokens_total",
        "counter",
        "Prompt tokens an engine served from its cache.",
        (*S, "engine"),
        "session",
    ),
    Family(
        "miles_turns_total",
        "counter",
        "Model turns, by the engine's finish reason.",
        (*S, "engine", "finish_reason"),
        "session",
    ),
    Family(
        "miles_turn_retries_total",
        "counter",
        "Generate attempts that failed and were retried or ended the turn, by reason: timeout (the turn's "
        "deadline passed) or error (the engine failed, aborted the request, or none was healthy).",
        (*S, "engine", "reason"),
        "session",
    ),
    Family(
        "miles_tool_calls_total", "counter", "Tool calls the model made, by tool.", (*S, "tool"), "session"
    ),
    Family(
        "miles_tool_errors_total",
        "counter",
        "Tool calls that failed, by error kind.",
        (*S, "kind"),
        "session",
    ),
    _h(
        "miles_tool_duration_seconds",
        "Run time of one tool call (where the env reports it).",
        (*S, "tool"),
        "session",
        LATENCY_BUCKETS,
    ),
    # ---- engines (the embedded engine's counters, read at scrape time) ----------------------------------
    Family("miles_engine_prefill_tokens_total", "counter", "Prompt tokens computed by prefill.", E, "engine"),
    Family(
        "miles_engine_cached_tokens_total",
        "counter",
        "Prompt tokens served from session caches.",
        E,
        "engine",
    ),
    Family("miles_engine_decode_tokens_total", "counter", "Tokens produced by decode steps.", E, "engine"),
    Family("miles_engine_decode_steps_total", "counter", "Batched decode steps.", E, "engine"),
    Family(
        "miles_engine_pauses_total",
        "counter",
        "Times decoding was paused (`pause_generation`), as around a weight update under `policy: pause`.",
        E,
        "engine",
    ),
    Family("miles_engine_running_requests", "gauge", "Requests decoding now (the batch).", E, "engine"),
    Family(
        "miles_engine_waiting_requests",
        "gauge",
        "Requests queued or in prefill (the queue depth).",
        E,
        "engine",
    ),
    Family("miles_engine_weight_version", "gauge", "Weight version the engine serves.", E, "engine"),
    _h("miles_engine_batch_size", "Rows in each batched decode step.", E, "engine", BATCH_BUCKETS),
    _h(
        "miles_engine_time_to_first_token_seconds",
        "From a request's arrival to its first sampled token (the end of its prefill).",
        E,
        "engine",
        LATENCY_BUCKETS,
    ),
    # ---- the scheduler's router (per-engine stats snapshots) --------------------------------------------
    Family(
        "miles_router_turns_total",
        "counter",
        "Turns routed, by placement: new session, stayed on its cache engine, switched away.",
        (*E, "placement"),
        "router",
    ),
    Family(
        "miles_router_suspect_marks_total",
        "counter",
        "Times the router judged an engine suspect.",
        E,
        "router",
    ),
    Family(
        "miles_router_engine_state",
        "gauge",
        "1 for the router's current judgement of an engine.",
        (*E, "state"),
        "router",
    ),
    # ---- the train step ------------------------------------------------------------------------------
    Family("miles_steps_total", "counter", "RL steps done.", S, "step"),
    _h(
        "miles_step_phase_seconds",
        "Time of each phase of an RL step (rollout, train, sync, and the whole step).",
        (*S, "phase"),
        "step",
        LATENCY_BUCKETS,
    ),
    Family(
        "miles_trainer_idle_ratio",
        "gauge",
        "Share of the last step the trainer waited for rollouts (synchronous loop: rollout time / step time).",
        S,
        "step",
    ),
    Family(
        "miles_rollout_idle_ratio",
        "gauge",
        "Share of the last step the engines had no rollout work (synchronous loop: (train + sync) / step).",
        S,
        "step",
    ),
    Family(
        "miles_train_tokens_per_second",
        "gauge",
        "Tokens trained per second of the last train phase.",
        S,
        "step",
    ),
    Family(
        "miles_rollout_tokens_per_second",
        "gauge",
        "Tokens generated per second of the last rollout phase.",
        S,
        "step",
    ),
    Family("miles_train_tokens_total", "counter", "Tokens in trained batches.", S, "step"),
    Family(
        "miles_mfu_ratio",
        "gauge",
        "Model FLOPs utilization of the last train phase: 6 * parameters * tokens / seconds / device peak "
        "(only where the peak is known).",
        S,
        "step",
    ),
    Family(
        "miles_rollout_reward_mean", "gauge", "Mean session reward of the last step's rollouts.", S, "step"
    ),
    Family(
        "miles_rollout_success_ratio",
        "gauge",
        "Share of the last step's sessions the env judged a success.",
        S,
        "step",
    ),
    Family(
        "miles_rollout_zero_std_group_ratio",
        "gauge",
        "Share of the last step's groups whose rewards were all equal (no GRPO signal).",
        S,
        "step",
    ),
    # ---- the trainer's metrics -----------------------------------------------------------------------
    Family(
        "miles_train_rollout_kl",
        "gauge",
        "Token-level KL(rollout || trainer) on the trained tokens (k3 estimator), mean and max.",
        (*S, "stat"),
        "train",
    ),
    Family(
        "miles_train_rollout_logprob_abs_diff",
        "gauge",
        "Mean |logp_trainer - logp_rollout| on the trained tokens.",
        S,
        "train",
    ),
    Family(
        "miles_train_importance_ratio_tail",
        "gauge",
        "The tail of the rollout/trainer importance ratio on the trained tokens: the shares outside [0.9, 1.1] "
        "and [0.5, 2], and the largest |log ratio|.",
        (*S, "stat"),
        "train",
    ),
    Family(
        "miles_policy_approx_kl",
        "gauge",
        "Approximate KL between the updated and the old policy.",
        S,
        "train",
    ),
    Family(
        "miles_policy_entropy", "gauge", "Mean token entropy of the policy on the trained tokens.", S, "train"
    ),
    Family(
        "miles_policy_clip_ratio", "gauge", "Share of trained tokens whose ratio was clipped.", S, "train"
    ),
    Family(
        "miles_grad_norm",
        "gauge",
        "Gradient norm before clipping (mean over the step's optimizer steps).",
        S,
        "train",
    ),
    Family("miles_train_loss", "gauge", "Policy loss of the last step.", S, "train"),
    Family("miles_learning_rate", "gauge", "Learning rate of the last step.", S, "train"),
    Family(
        "miles_reference_kl", "gauge", "KL to the frozen reference policy (when one is kept).", S, "train"
    ),
    # ---- weight sync ---------------------------------------------------------------------------------
    _h(
        "miles_weight_sync_seconds",
        "Time of a weight sync to every engine.",
        (*P, "method"),
        "sync",
        LATENCY_BUCKETS,
    ),
    _h(
        "miles_weight_sync_drain_seconds",
        "Part of a sync spent draining in-flight requests.",
        (*P, "method"),
        "sync",
        LATENCY_BUCKETS,
    ),
    Family("miles_weight_sync_bytes_total", "counter", "Bytes of weights pushed.", (*P, "method"), "sync"),
    Family("miles_weight_version", "gauge", "The policy's latest synced weight version.", P, "sync"),
    # ---- GPU memory (the CUDA caching allocator, per device) -------------------------------------------
    Family("miles_gpu_memory_allocated_bytes", "gauge", "Bytes held by tensors.", ("run", "device"), "gpu"),
    Family(
        "miles_gpu_memory_reserved_bytes",
        "gauge",
        "Bytes the caching allocator holds from CUDA.",
        ("run", "device"),
        "gpu",
    ),
    Family(
        "miles_gpu_memory_peak_allocated_bytes",
        "gauge",
        "Peak of allocated bytes since the last reset.",
        ("run", "device"),
        "gpu",
    ),
    Family(
        "miles_gpu_memory_fragmentation_bytes",
        "gauge",
        "Reserved but unallocated bytes (reserved - allocated).",
        ("run", "device"),
        "gpu",
    ),
    Family(
        "miles_gpu_memory_largest_free_block_bytes",
        "gauge",
        "The largest free block inside reserved segments: the biggest tensor that fits without cudaMalloc.",
        ("run", "device"),
        "gpu",
    ),
    Family(
        "miles_gpu_memory_fragmentation_ratio",
        "gauge",
        "1 - largest free block / free reserved bytes: 0 when the free memory is one block, near 1 when "
        "it is scattered.",
        ("run", "device"),
        "gpu",
    ),
    Family(
        "miles_gpu_alloc_retries_total",
        "counter",
        "cudaMalloc calls that failed and were retried after freeing cached blocks.",
        ("run", "device"),
        "gpu",
    ),
    # ---- async RL hooks (fed by the async loop; the synchronous loop leaves them empty) -----------------
    _h(
        "miles_sample_staleness",
        "Trainer version minus the oldest weight version of a trained sample.",
        S,
        "async",
        STALENESS_BUCKETS,
    ),
    Family(
        "miles_stale_groups_dropped_total",
        "counter",
        "Groups dropped for exceeding the staleness bound.",
        S,
        "async",
    ),
    Family(
        "miles_late_groups_total",
        "counter",
        "Groups a step took beyond its share because they would have been over the staleness bound at the "
        "next version (the long tail, trained late instead of dropped).",
        S,
        "async",
    ),
    Family(
        "miles_rollout_buffer_groups", "gauge", "Finished groups waiting in the rollout buffer.", S, "async"
    ),
)

BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    """The declared family `name` (KeyError names the unknown one)."""
    return BY_NAME[name]
