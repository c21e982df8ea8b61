"""`riptide-train` / `python -m trainer_bridge.train`: a GRPO job from Hydra configs.

    riptide-train task=reverse rollout.oversample=2 trainer.lr=1e-3

Hydra composes `configs/` onto the typed schema in trainer_bridge.config; a wrong field or value
stops the run before anything starts, with what to change. Everything the run starts (servers,
Mooncake, the rollout loop) stops on exit, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import difflib
import enum
import json
import logging
import os
import signal
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from trainer_bridge.config import ConfigError, JobConfig

ConfigStore.instance().store(name="schema", node=JobConfig)


def schema_fields(cls=JobConfig, prefix: str = "") -> dict[str, tuple[str, object]]:
    """Every settable field with its help text and its default (whose type a value must have)."""
    out = {}
    for fl in fields(cls):
        path = f"{prefix}{fl.name}"
        default = fl.default_factory() if callable(fl.default_factory) else fl.default
        if is_dataclass(default):
            out.update(schema_fields(type(default), path + "."))
        else:
            out[path] = (fl.metadata.get("help", ""), default)
    return out


_BOOLS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def value_problem(key: str, value: str, default) -> str | None:
    """Whether an override's value reads as the field's type (as Hydra would read it)."""
    if value.startswith(("${", "null")) or value in ("", "''", '""'):
        return None
    kind = type(default)
    if isinstance(default, enum.Enum):
        names = [m.name for m in kind]
        return None if value in names else f"{key}={value!r}: use {' | '.join(names)}"
    try:
        if kind is bool:
            if value.lower() not in _BOOLS:
                raise ValueError
        elif kind is int:
            int(value)
        elif kind is float:
            float(value)
        else:
            return None
    except ValueError:
        return f"{key}={value!r}: expected {'true or false' if kind is bool else 'an integer' if kind is int else 'a number'}"
    return None


GROUPS = ("model", "task", "rollout", "weight_sync", "server", "cluster", "trainer", "logger", "experiment", "hydra")


def under_a_mapping(key: str, known: dict) -> bool:
    parts = key.split(".")
    return any(isinstance(known.get(".".join(parts[:i]), (None, None))[1], dict) for i in range(1, len(parts)))


def check_overrides(argv: list[str]) -> str | None:
    """Clear messages for overrides naming a field the schema does not have, or giving a value of the
    wrong type (before Hydra runs, whose own errors name its internals); one line per problem."""
    known = schema_fields()
    problems, listing = [], ""
    for arg in argv:
        if "=" not in arg or arg.startswith(("-", "hydra", "+hydra", "~")):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+")
        if key in GROUPS:
            continue
        if under_a_mapping(key, known):          # task.rg_config.max_terms=2: a key of a dict field
            continue
        if key in known:
            problem = value_problem(key, value, known[key][1])
            if problem:
                problems.append(problem)
            continue
        close = difflib.get_close_matches(key, list(known), n=3)
        group = key.split(".")[0]
        siblings = [k for k in known if k.startswith(group + ".")]
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        problems.append(f"unknown config field {key!r}.{hint}")
        listing = listing or ("\n".join(f"  {k}: {known[k][0]}" for k in siblings) if siblings else
                              "  groups: " + ", ".join(GROUPS[:-1]))
        if siblings:
            listing = f"Fields of {group}:\n{listing}"
    if not problems:
        return None
    return "\n".join(f"  - {p}" for p in problems) + (f"\n{listing}" if listing else "")


def to_job(cfg: DictConfig) -> JobConfig:
    """The typed job, checked: ConfigError names every problem (a required `???` field left empty too)."""
    from omegaconf.errors import OmegaConfBaseException
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError([f"{key} is required (it is ??? in its config); set it on the command line" for key in missing])
    try:
        job = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError([str(e).splitlines()[0]]) from None
    return job.validate()


CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


def compose_job(overrides: list[str]) -> JobConfig:
    """The job `riptide-train *overrides` would run, composed from configs/ with Hydra's compose API
    and checked (for scripts, benches and tests)."""
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return to_job(compose(config_name="config", overrides=overrides))


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from trainer_bridge.job.run import SIGNAL, Stopped, run, stop_on_signal
    logging.getLogger().setLevel(logging.WARNING)      # Hydra sets INFO: one line per HTTP request
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        job = to_job(cfg)
    except ValueError as e:
        problems = e.problems if isinstance(e, ConfigError) else [str(e)]
        print("riptide-train: bad config:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
        sys.exit(2)
    if job.logger.native_logs == "file":
        from trainer_bridge.job.monitor import native_logs_to
        native_logs_to(Path(job.run_dir) / "logs" / "native.log")
    import transformers
    transformers.utils.logging.disable_progress_bar()       # "Writing model shards" on every checkpoint
    follower = int(os.environ.get("RANK", "0")) > 0      # a trainer rank under torchrun: rank 0 decides
    for sig in (signal.SIGINT, signal.SIGTERM):          # SIGINT too: a launcher may have left it ignored
        signal.signal(sig, signal.SIG_IGN if follower else stop_on_signal)
    try:
        result = run(job)
    except ConfigError as e:            # found once the job looked at what it resumes from; nothing started
        print("riptide-train: bad config:\n" + "\n".join(f"  - {p}" for p in e.problems), file=sys.stderr)
        sys.exit(2)
    except Stopped as e:
        where = f"checkpoint {e.checkpoint}; continue with trainer.resume=latest run_dir={job.run_dir}" \
            if e.checkpoint else "no checkpoint yet"
        print(f"riptide-train: {e} ({where})", file=sys.stderr)
        sys.exit(128 + (e.signum or signal.SIGINT))
    except KeyboardInterrupt:
        print("riptide-train: stopped by a signal before a step finished; everything it started is stopped",
              file=sys.stderr)
        sys.exit(128 + (SIGNAL["number"] or signal.SIGINT))
    if result is None:          # a trainer rank other than 0 (under torchrun): rank 0 reports
        return
    print(f"wandb run: {result['wandb_dir'] or '(disabled)'}   plot: {result['plot']}")
    print(json.dumps(result))


def cli() -> None:
    message = check_overrides(sys.argv[1:])
    if message:
        print(f"riptide-train: bad config:\n{message}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
