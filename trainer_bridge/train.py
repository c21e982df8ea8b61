"""`riptide-train` / `python -m trainer_bridge.train`: a GRPO job from Hydra configs.

    riptide-train task=reverse rollout.oversample=2 trainer.lr=1e-3

Hydra composes `configs/` onto the typed schema in trainer_bridge.config; a wrong field or value
stops the run before anything starts, with what to change. Everything the run starts (servers,
Mooncake, the rollout loop) stops on exit, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import difflib
import json
import logging
import signal
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from trainer_bridge.config import JobConfig

ConfigStore.instance().store(name="schema", node=JobConfig)


def schema_paths(cls=JobConfig, prefix: str = "") -> dict[str, str]:
    """Every settable field ('trainer.lr') with its help text."""
    out = {}
    for fl in fields(cls):
        path = f"{prefix}{fl.name}"
        default = fl.default_factory() if callable(fl.default_factory) else fl.default
        if is_dataclass(default):
            out.update(schema_paths(type(default), path + "."))
        else:
            out[path] = fl.metadata.get("help", "")
    return out


GROUPS = ("model", "task", "rollout", "weight_sync", "server", "cluster", "trainer", "logger", "hydra")


def check_overrides(argv: list[str]) -> str | None:
    """A clear message for an override naming a field the schema does not have (before Hydra runs)."""
    known = schema_paths()
    for arg in argv:
        if "=" not in arg or arg.startswith(("-", "hydra", "+hydra", "~")):
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        if key in GROUPS or key in known:
            continue
        close = difflib.get_close_matches(key, list(known), n=3)
        group = key.split(".")[0]
        siblings = [k for k in known if k.startswith(group + ".")]
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        listing = "\n".join(f"  {k}: {known[k]}" for k in siblings) if siblings else \
            "  groups: " + ", ".join(GROUPS[:-1])
        return f"unknown config field {key!r}.{hint}\nFields{' of ' + group if siblings else ''}:\n{listing}"
    return None


def to_job(cfg: DictConfig) -> JobConfig:
    job = OmegaConf.to_object(cfg)
    return job.validate()


CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from trainer_bridge.run import run, stop_on_signal
    logging.getLogger().setLevel(logging.WARNING)      # Hydra sets INFO: one line per HTTP request
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        job = to_job(cfg)
    except ValueError as e:
        print(f"riptide-train: bad config: {e}", file=sys.stderr)
        sys.exit(2)
    for sig in (signal.SIGINT, signal.SIGTERM):          # SIGINT too: a launcher may have left it ignored
        signal.signal(sig, stop_on_signal)
    result = run(job)
    print(f"wandb run: {result['wandb_dir'] or '(disabled)'}   plot: {result['plot']}")
    print(json.dumps(result))


def cli() -> None:
    message = check_overrides(sys.argv[1:])
    if message:
        print(f"riptide-train: {message}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
