"""`TrainConfig`: everything one `miles train` run needs, as typed dataclasses loaded from YAML."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from miles.config import ConfigError, load_config
from miles.engine import SamplingParams
from miles.envs import EnvRecipe
from miles.learner.config import (
    AlgorithmConfig,
    MegatronOptions,
    Schedule,
    TorchOptions,
    TrainerConfig,
    changed_knobs,
)
from miles.learner.lora.config import LoraSpec, check_adapters
from miles.observability import ObservabilityConfig
from miles.sessions.config import SchedulerConfig, SessionConfig
from miles.sessions.openai.config import AgentConfig
from miles.training.cluster.config import ClusterConfig
from miles.training.health import HealthConfig
from miles.weight_sync import SyncConfig  # the `sync:` section lives beside the sync it configures


@dataclass
class EnvConfig:
    """The environment, its constructor arguments, and which task splits train and evaluate.

    `num_train_tasks` is the size of the training pool the data cursor shuffles (keep it fixed across a
    resumed run: it defines the task order). `import` (YAML key; `imports` in Python) lists the user modules
    (dotted names or paths to .py files) that register the env; they are imported before the id is looked up,
    in every process of the run (the CLI's `--import` adds to it). `tasks` replaces the env's own tasks with
    the rows of a `.jsonl` or `.parquet` file (`prompt` required; `id`, `answer`, `data` and any other field
    optional; a `split` column of "train" / "held_out" overrides the hashed split), checked row by row.
    """

    id: str = "Calculator-v0"
    kwargs: dict[str, Any] = field(default_factory=dict)
    imports: list[str] = field(default_factory=list, metadata={"key": "import"})
    tasks: str | None = None
    train_split: str = "train"
    eval_split: str = "held_out"
    num_train_tasks: int = 100_000

    def __post_init__(self) -> None:
        if self.num_train_tasks < 1:
            raise ConfigError("num_train_tasks", "must be >= 1")
        if self.tasks is not None and "tasks" in self.kwargs:
            raise ConfigError("tasks", "is given twice: as env.tasks and as env.kwargs.tasks; keep one")

    @property
    def recipe(self) -> EnvRecipe:
        """How every process of the run builds this env (and how replays rebuild it); a task file by its
        absolute path, so a replay from another folder finds it."""
        kwargs = dict(self.kwargs)
        if self.tasks is not None:
            kwargs["tasks"] = str(Path(self.tasks).expanduser().resolve())
        return EnvRecipe(id=self.id, kwargs=kwargs, imports=tuple(self.imports))


@dataclass
class ModelConfig:
    """The policy: `name` is "tiny" (with `size`), "smollm2-135m", or an HF checkpoint folder.

    `init_from` loads weights from a folder (an SFT warm start) on top of the named architecture.
    `chat_template` overrides the tokenizer's: "compact" (the tiny kit's short tool prompt) or a .jinja path.
    """

    name: str = "tiny"
    size: str = "3m"
    tokenizer: str = "tiny"
    chat_template: str | None = None
    init_from: str | None = None
    seed: int = 0


@dataclass
class EngineConfig:
    """Where rollouts run: the embedded engine (default), SGLang servers by URL, or the real sglang-router.

    - `embedded`: `num_engines` in-process engines on `device`, each batching up to `max_batch_size` requests,
      with a KV cache that grows on demand, or is sized once to `kv_cache_fraction` of the device's memory (the
      context length is then what fits, and sessions end `context_full` beyond it);
    - `sglang`: the servers at `urls` (SGLang or `miles rollout`), spread by the scheduler's router;
    - `router`: the real sglang-router in front of the servers at `urls` (the workers; weight sync reaches each
      one directly). `miles train` starts the router, or uses the one at `router_url` (e.g. the router that
      `miles rollout --dp N` started).
    """

    kind: Literal["embedded", "sglang", "router"] = "embedded"
    urls: list[str] = field(default_factory=list)
    router_url: str | None = None
    num_engines: int = 1
    max_batch_size: int = 64
    device: str = "cpu"
    kv_cache_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_fraction is not None:
            if self.kind != "embedded":
                raise ConfigError(
                    "kv_cache_fraction",
                    "sizes the embedded engine's KV cache; SGLang servers take "
                    "theirs from `miles rollout --mem-fraction`",
                )
            if not 0 < self.kv_cache_fraction <= 1:
                raise ConfigError("kv_cache_fraction", f"must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kind != "embedded" and not self.urls:
            raise ConfigError(
                "urls", f"engine kind {self.kind!r} needs the servers' URLs (`miles rollout` prints them)"
            )
        if self.kind == "embedded" and self.urls:
            raise ConfigError(
                "urls", "URLs are for engine kinds sglang and router; remove them or set engine.kind"
            )
        if self.router_url is not None and self.kind != "router":
            raise ConfigError("router_url", "only engine kind 'router' uses a router URL")
        if self.num_engines < 1:
            raise ConfigError("num_engines", "must be >= 1")


@dataclass
class RolloutConfig:
    """How many tasks (GRPO groups) each step rolls out, and how the scheduler runs them.

    `drop_zero_std_groups` trains only on groups whose rewards differ (their advantages are all zero
    otherwise); the loss normalisation then counts only the kept tokens.
    `on_timeout`: sessions that ended `timeout` (a slow engine or env, not the policy) are left out of training
    ("drop", the default) or trained on with reward 0 ("zero"); either way they are recorded and counted in the
    step's `timeout_sessions` metric.
    `agent`: with `agent.command` set, the user's own agent runs every session (train and eval) against the
    OpenAI-compatible endpoint instead of the env loop (`miles.sessions.openai.agent`).
    """

    tasks_per_step: int = 4
    drop_zero_std_groups: bool = False
    on_timeout: Literal["drop", "zero"] = "drop"
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(group_size=8))
    agent: AgentConfig = field(default_factory=AgentConfig)  # with agent.command: the user's agent, see below

    def __post_init__(self) -> None:
        if self.tasks_per_step < 1:
            raise ConfigError("tasks_per_step", "must be >= 1")


@dataclass
class SFTConfig:
    """Supervised warm start on the environment's oracle demonstrations (masked through TITO).

    With `target_success`, SFT stops early once greedy success on `check_tasks` distinct *training* prompts
    reaches it (checked every `check_every` steps after `min_steps`): a deliberately imperfect start for RL.
    """

    enabled: bool = False
    num_demos: int = 256
    epochs: int = 1
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 0
    max_seconds: float | None = None
    target_success: float | None = None
    check_every: int = 20
    check_tasks: int = 64
    min_steps: int = 0
    save_to: str | None = None


@dataclass
class EvalConfig:
    """Held-out evaluation every `every` steps (0: only before and after training), of `num_tasks` distinct
    tasks of `env.eval_split`. `envs` adds more registered env ids, each evaluated on its own held-out tasks
    beside the run's env (e.g. BFCL's other multi-turn categories); their results are named `ENV_ID/MODE`."""

    every: int = 0
    num_tasks: int = 100
    greedy: bool = True
    sampled: bool = False
    max_new_tokens: int | None = None
    envs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_tasks < 1:
            raise ConfigError("num_tasks", f"must be >= 1, got {self.num_tasks}")
        if not (self.greedy or self.sampled):
            raise ConfigError("greedy", "evaluation needs greedy or sampled decoding (or both)")


@dataclass
class CheckpointConfig:
    """Checkpoint every `every` steps (0: only at the end); keep the newest `keep`."""

    every: int = 0
    keep: int = 2


@dataclass
class ParallelConfig:
    """How many ranks train: ``tp * pp * dp``, launched under torchrun by `miles train` when above 1.

    ``dp`` (data parallelism) works on both backends (FSDP2 on torch); ``tp`` (tensor) and ``pp`` (pipeline)
    need ``backend: megatron``.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "dp"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")


def check_output_dir(path: str) -> None:
    """`ConfigError` on `output_dir` for a value that cannot hold a run: empty, the working directory or the
    filesystem root itself, a system folder (/proc, /sys, /dev), or an existing file."""
    if not path.strip():
        raise ConfigError("output_dir", "is empty; name the run's folder, e.g. runs/my-run")
    resolved = Path(path).expanduser().resolve()
    if resolved in (Path.cwd(), Path("/")):
        raise ConfigError(
            "output_dir", f"{path!r} is {resolved}; a run needs a folder of its own, e.g. runs/my-run"
        )
    if any(resolved == Path(p) or Path(p) in resolved.parents for p in ("/proc", "/sys", "/dev")):
        raise ConfigError("output_dir", f"{path!r} is under a system folder; give a folder on disk")
    if resolved.exists() and not resolved.is_dir():
        raise ConfigError("output_dir", f"{path!r} exists and is not a folder")


def _check_backend_sections(cfg: TrainConfig) -> None:
    """Settings that the chosen backend would silently ignore are errors that name the key and the fix."""
    if cfg.backend == "torch":
        for key in ("tp", "pp"):
            if getattr(cfg.parallel, key) > 1:
                raise ConfigError(
                    f"parallel.{key}",
                    "the torch backend parallelizes data only (FSDP2, "
                    "parallel.dp); set it to 1, or set backend: megatron",
                )
    other, section = ("megatron", cfg.megatron) if cfg.backend == "torch" else ("torch", cfg.torch)
    changed = changed_knobs(section)
    if changed:
        raise ConfigError(
            f"{other}.{changed[0]}",
            f"a {other}-backend setting, but backend is {cfg.backend}: remove it, or set backend: {other}",
        )


#: `algorithm.loss.tis_cap` of an asynchronous run with `max_staleness > 0` whose loss takes the ratio against
#: the proximal policy and sets neither it nor `icepop`: without an importance weight against the rollout
#: policy, stale samples train the current policy as if they were its own (the calculator example at `max_staleness: 2`
#: collapsed in 15 steps that way).
ASYNC_TIS_CAP = 2.0
#: `algorithm.loss.dual_clip_c` of an asynchronous run that takes the ratio against the rollout policy by default.
ASYNC_DUAL_CLIP_C = 3.0


@dataclass
class AsyncConfig:
    """Fully asynchronous RL (the `async:` section): a rollout manager process streams finished groups while
    the trainer trains on the groups already done.

    - `enabled`: off (the default) runs the synchronous loop: roll out a step, train, sync, repeat.
    - `max_staleness`: a sample's staleness is the trainer's weight version minus the oldest version among its
      generated tokens. The manager admits a group only while the ones admitted fit the bound, and groups over
      it when they reach the trainer are dropped (`stale: drop`) or run again (`stale: regenerate`).
      `max_staleness: 0` is the synchronous loop with the rollout in its own process.
    - `inflight`: how a weight update meets turns in flight: `pause` (the default) swaps the weights between
      decode steps (a turn can then span versions; each token's version is recorded, and the loss's ratio
      against the rollout policy takes each token's own logprob); `continue` lets them finish on the old
      weights, and no turn starts until the new ones are in (the engines drain at every update: on the
      long-tail benchmark about 1.4x fewer samples/s).
    - `rollout_threads`: torch threads of the rollout process (its engines; default 1). The trainer's own count
      is its process's (`OMP_NUM_THREADS`, else torch's default).
    - With `max_staleness > 0` and none of `algorithm.loss.ratio_to`, `tis_cap`, `icepop` set, the loss takes
      the PPO ratio against the rollout policy (`ratio_to: rollout`, dual clip `ASYNC_DUAL_CLIP_C`); with
      `ratio_to: proximal` and neither `tis_cap` nor `icepop`, it weighs each token by
      ``min(exp(logp_proximal - logp_rollout), ASYNC_TIS_CAP)``.
    - `manager_timeout_s`: how long the trainer waits for the next group before it gives up.
    """

    enabled: bool = False
    max_staleness: int = 4
    stale: Literal["drop", "regenerate"] = "drop"
    inflight: Literal["continue", "pause"] = "pause"
    rollout_threads: int | None = None
    manager_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError("max_staleness", f"must be >= 0, got {self.max_staleness}")
        if self.rollout_threads is not None and self.rollout_threads < 1:
            raise ConfigError("rollout_threads", f"must be >= 1 (or null), got {self.rollout_threads}")
        if not self.manager_timeout_s > 0:
            raise ConfigError("manager_timeout_s", f"must be > 0, got {self.manager_timeout_s}")


@dataclass
class AdapterConfig:
    """One LoRA adapter trained on the shared, frozen base model (an entry of the `adapters:` list).

    Each adapter has its own env (`env`, default: the run's; `reward_weights` reweights its reward components),
    its share of each step (`tasks_per_step` groups of `group_size` samples, default: the run's
    `rollout.tasks_per_step` and group size), its own sampling (`sampling`: overrides of the run's, e.g.
    `{temperature: 0.7}`), its LoRA shape (`lora`), and its own optimizer and schedule (`lr`, `lr_schedule`,
    `warmup_steps`, `total_steps`, `min_lr_ratio`: overrides of `trainer:`). `seed` seeds its LoRA
    initialisation (default: the run's seed). Errors name the adapter: `adapters[NAME].lora.rank`.
    """

    name: str
    env: EnvConfig | None = None
    reward_weights: dict[str, float] = field(default_factory=dict)
    tasks_per_step: int | None = None
    group_size: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    lora: LoraSpec = field(default_factory=LoraSpec)
    lr: float | None = None
    lr_schedule: Schedule | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    min_lr_ratio: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for key in ("tasks_per_step", "group_size"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(key, f"must be >= 1, got {value}")
        try:
            SamplingParams().updated(self.sampling)
        except (TypeError, ValueError) as exc:
            raise ConfigError("sampling", str(exc)) from None


@dataclass
class TrainConfig:
    """One agent-RL experiment. With `adapters`, the base model is frozen and each adapter is trained as a LoRA
    adapter on it (see `AdapterConfig`); without, the whole model is fine-tuned."""

    seed: int = 0
    output_dir: str = "runs/default"
    steps: int = 10
    max_seconds: float | None = None
    backend: Literal["torch", "megatron"] = "torch"
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    torch: TorchOptions = field(default_factory=TorchOptions)
    megatron: MegatronOptions = field(default_factory=MegatronOptions)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # where the roles run: here, or on Ray
    health: HealthConfig = field(default_factory=HealthConfig)  # when a run that is not learning stops
    adapters: list[AdapterConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError("steps", "must be >= 0")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ConfigError("max_seconds", f"must be > 0 (or null for no budget), got {self.max_seconds}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError("seed", f"must be in [0, 2**63), got {self.seed}")
        check_output_dir(self.output_dir)
        check_adapters(self)
        if self.asynchronous.enabled and self.rollout.agent.enabled:
            raise ConfigError(
                "async.enabled",
                "the asynchronous loop runs the env's sessions itself; it does not "
                "drive an external agent (rollout.agent) yet",
            )
        if self.rollout.scheduler.oversample_groups and (self.rollout.agent.enabled or self.adapters):
            raise ConfigError(
                "rollout.scheduler.oversample_groups",
                "over-sampling drops the slowest groups of "
                "the scheduler's steps; external agents and adapters run every group they start: "
                "set it to 0",
            )
        if self.asynchronous.enabled and self.rollout.scheduler.oversample_groups:
            raise ConfigError(
                "async.enabled",
                "the asynchronous loop keeps every group it starts; set "
                "rollout.scheduler.oversample_groups: 0",
            )
        try:
            self.rollout.scheduler.validate()
        except ValueError as exc:
            raise ConfigError("rollout.scheduler", str(exc)) from exc
        _check_backend_sections(self)
        loss = self.algorithm.loss
        if (
            self.asynchronous.enabled
            and self.asynchronous.max_staleness > 0
            and not loss.needs_rollout_logprobs
        ):
            if loss.ratio_to is None:
                loss = dataclasses.replace(
                    loss, ratio_to="rollout", dual_clip_c=loss.dual_clip_c or ASYNC_DUAL_CLIP_C
                )
            else:
                loss = dataclasses.replace(loss, tis_cap=ASYNC_TIS_CAP)
            self.algorithm = dataclasses.replace(self.algorithm, loss=loss)

    @property
    def sampling(self) -> SamplingParams:
        return self.rollout.scheduler.session.sampling

    @property
    def session(self) -> SessionConfig:
        return self.rollout.scheduler.session


def load_train_config(path: str | None, overrides: list[str] | None = None) -> TrainConfig:
    """Load and validate a `TrainConfig` from YAML plus dotted overrides."""
    return load_config(TrainConfig, path, overrides)
