"""`miles eval`: held-out success of the model a config names, or of a run's newest weights, on the run's env
and the envs of `eval.envs`, as a table per env and decoding mode.

Sessions are recorded to `eval_sessions.jsonl` and the results to `eval.json` in the output folder, so every
number can be replayed (`miles replay --check`). An env whose sessions mostly failed in the engines gets no
score: the command says so and exits 3.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from miles.config import ConfigError, to_dict
from miles.sessions.recorder import Recorder
from miles.training.config import TrainConfig
from miles.training.engine_setup import bounded_by_context, build_engine_set
from miles.training.evaluate import EvalResult, eval_sets, evaluate
from miles.training.models import build_policy, build_tito, check_devices, check_tools_reach_model
from miles.training.output_dir import OutputDirLock, check_fresh_output_dir


@dataclass(frozen=True)
class EvalReport:
    """What `miles eval` measured: one result per `ENV/MODE` key, with each env's category where it has one
    (BFCL's names), and where the weights came from."""

    weights: str
    results: dict[str, EvalResult]
    categories: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "weights": self.weights,
            "categories": self.categories,
            "results": {k: r.to_dict() for k, r in self.results.items()},
        }

    @property
    def invalid(self) -> list[str]:
        """One line per result that is no score."""
        return [f"{key}: {r.invalid}" for key, r in self.results.items() if r.invalid]


def _load_run_weights(model: Any, run_dir: Path) -> str:
    """Load the newest complete checkpoint of `run_dir` into `model`; its path."""
    from miles.learner.checkpoint import load_checkpoint
    from miles.learner.errors import CheckpointError

    try:
        ckpt = load_checkpoint(run_dir / "checkpoints")
    except CheckpointError as exc:
        raise ConfigError("--run", f"{exc}; give the folder of a `miles train` run") from None
    missing, unexpected = model.load_state_dict(ckpt.model, strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
        raise ConfigError(
            "--run",
            f"{ckpt.path} does not fit model {model.config.model_type!r} "
            f"({len(missing)} missing, {len(unexpected)} unexpected tensors): evaluate it with the "
            "run's own config.yaml",
        )
    return str(ckpt.path)


async def run_eval(cfg: TrainConfig, *, run_dir: Path | None = None, echo: Any = print) -> EvalReport:
    """Evaluate greedy (and sampled, per `eval`) on the held-out split of `env.id` and of `eval.envs`."""
    out = Path(cfg.output_dir)
    check_fresh_output_dir(out)
    lock = OutputDirLock(out)
    try:
        (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        check_devices(cfg)
        tito = build_tito(cfg.model)
        sets = eval_sets(cfg.env.recipe, cfg.env.eval_split, cfg.eval.num_tasks, cfg.eval.envs)
        for part in sets:
            await check_tools_reach_model(tito, part.recipe, part.tasks[0])
        model = build_policy(cfg.model, tito.tokenizer)
        weights = (
            _load_run_weights(model, run_dir)
            if run_dir is not None
            else (cfg.model.init_from or cfg.model.name)
        )
        engines = await build_engine_set(cfg.engine, model, tito.tokenizer, cfg.model.tokenizer)
        if engines.is_http and run_dir is not None:
            await engines.close()
            raise ConfigError(
                "--run",
                "loads the weights into the embedded engine; SGLang servers evaluate the "
                "weights they serve (leave out --run)",
            )
        scheduler = bounded_by_context(cfg.rollout.scheduler, engines.context_length)
        recorder = Recorder(out / "eval_sessions.jsonl")
        results: dict[str, EvalResult] = {}
        categories: dict[str, str] = {}
        try:
            modes = [m for m, on in (("greedy", cfg.eval.greedy), ("sampled", cfg.eval.sampled)) if on]
            for part in sets:
                env = part.recipe.make()
                categories[part.label or cfg.env.id] = str(getattr(env, "category", ""))
                env.close()
                for mode in modes:
                    t0 = time.perf_counter()
                    res = await evaluate(
                        engines.rollout,
                        tokenizer=tito,
                        recipe=part.recipe,
                        tasks=part.tasks,
                        scheduler=scheduler,
                        greedy=mode == "greedy",
                        recorder=recorder,
                        max_new_tokens=cfg.eval.max_new_tokens,
                        run_id=f"eval-{(part.label or cfg.env.id)}-{mode}",
                    )
                    key = f"{part.label or cfg.env.id}/{mode}"
                    results[key] = res
                    echo(
                        f"[eval] {key}: success {res.success_rate:.1%}  mean reward {res.mean_reward:.3f}  "
                        f"({res.num_tasks} held-out tasks, {time.perf_counter() - t0:.0f} s)"
                    )
        finally:
            await recorder.aclose()
            await engines.close()
        report = EvalReport(weights=weights, results=results, categories=categories)
        (out / "eval.json").write_text(json.dumps(report.to_dict(), indent=1))
        return report
    finally:
        lock.release()


def format_eval(report: EvalReport) -> str:
    """The table: held-out success and mean reward per env and mode, each env's category, and the mean over
    the envs per mode when there are several (BFCL's overall multi-turn accuracy is that mean)."""
    width = max(len(k) for k in report.results) + 2
    lines = [
        "",
        f"{'env/mode':<{width}}{'category':<26}{'held-out success':>18}{'mean reward':>14}{'tasks':>8}",
    ]
    for key, r in report.results.items():
        category = report.categories.get(key.rsplit("/", 1)[0], "")
        lines.append(
            f"{key:<{width}}{category:<26}{r.success_rate:>18.1%}{r.mean_reward:>14.3f}{r.num_tasks:>8}"
        )
    by_mode: dict[str, list[float]] = {}
    for key, r in report.results.items():
        by_mode.setdefault(key.rsplit("/", 1)[1], []).append(r.success_rate)
    for mode, rates in by_mode.items():
        if len(rates) > 1:
            lines.append(
                f"{'overall/' + mode:<{width}}{'mean of the envs':<26}{sum(rates) / len(rates):>18.1%}"
            )
    lines.append(f"weights: {report.weights}")
    return "\n".join(lines)
