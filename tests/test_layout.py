"""The code's shape, checked: packages whose modules import each other one way, library functions a
reader can hold in view, layers that do not reach up. Imports inside functions count the same as
those at the top: a cycle hidden in a function is still a cycle."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("platforms", "weight_sync", "inference_server", "rollout", "trainer_bridge",
            "riptide_testing")         # the last is test and bench tooling, held to the same shape
BELOW = {"platforms": (), "weight_sync": ("platforms",), "inference_server": ("platforms", "weight_sync"),
         "rollout": ("platforms",)}           # what each may import of the others (trainer_bridge: all)
MAX_LINES = 60


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def imports(path: Path, known: dict) -> set[str]:
    """Project modules `path` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_a_package():
    known = modules()
    graph = {m: {t for t in imports(f, known) if t != m and t.split(".")[0] == m.split(".")[0]}
             for m, f in known.items()}
    assert cycles(graph) == []


def room(module: str, known: dict) -> str:
    """A module's place for the folder-level check: its folder when that is a sub-folder of a package
    (trainer_bridge.job.run -> trainer_bridge.job), else the module itself (trainer_bridge.config)."""
    parts = module.split(".")
    folder = parts if known[module].name == "__init__.py" else parts[:-1]
    return ".".join(folder) if len(folder) >= 2 else module


def test_no_folder_imports_a_folder_that_imports_it_back():
    """Sub-folders (trainer_bridge/job, training, fleets, ...) import each other one way: a rank's
    entry that runs the job lives with the job, not beside the trainer the job imports."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for m, f in known.items():
        a = room(m, known)
        graph.setdefault(a, set()).update(room(t, known) for t in imports(f, known) if room(t, known) != a)
    for deps in list(graph.values()):
        for d in deps:
            graph.setdefault(d, set())
    assert cycles(graph) == []


def private_uses(module: str, path: Path, known: dict) -> list[str]:
    """`from m import _name` and `m._name` in `module`, where m is another project module."""
    tree, alias, out = ast.parse(path.read_text()), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in known:
                    alias[a.asname or a.name] = full
                elif node.module in known and a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{module}:{node.lineno}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, v = [], node.value
            while isinstance(v, ast.Attribute):
                chain.append(v.attr)
                v = v.value
            target = ".".join([alias[v.id]] + chain[::-1]) if isinstance(v, ast.Name) and v.id in alias else None
            if target in known and target != module:
                out.append(f"{module}:{node.lineno}: {target}.{node.attr}")
    return out


def test_no_module_uses_another_modules_private_names():
    known = modules()
    assert [u for m, f in known.items() for u in private_uses(m, f, known)] == []


def test_lower_layers_do_not_import_upper_ones():
    """The rollout process, the servers and weight sync never load the trainer's package (nor
    each other's, beyond what BELOW allows)."""
    known = modules()
    wrong = []
    for m, f in known.items():
        pkg = m.split(".")[0]
        if pkg not in BELOW:
            continue
        for t in imports(f, known):
            other = t.split(".")[0]
            if other != pkg and other not in BELOW[pkg]:
                wrong.append(f"{m} imports {t}")
    assert wrong == []


def test_the_library_does_not_import_its_tooling():
    """riptide_testing is not installed with the library: no library module may import it."""
    known = modules()
    wrong = [f"{m} imports {t}" for m, f in known.items() if not m.startswith("riptide_testing")
             for t in imports(f, known) if t.startswith("riptide_testing")]
    assert wrong == []


def test_no_library_function_over_60_lines():
    long = []
    for m, f in modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{m}.{node.name}: {n} lines")
    assert long == []


def _leaves(tree, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in (tree or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("rg_config",):
            out.update(_leaves(v, key + "."))
        else:
            out[key] = v
    return out


def test_config_files_set_only_what_differs_from_the_dataclasses():
    """One source of defaults: the dataclasses (what the attach API gets). A file under configs/ sets
    a field only to another value than its default, so riptide-train at its defaults and a
    BackendConfig built in Python run the same job, and a default is changed in one place."""
    import dataclasses
    import enum

    import yaml

    from trainer_bridge.config import JobConfig
    job = JobConfig()

    def default(path: str):
        obj = job
        for part in path.split("."):
            if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
                return KeyError
            obj = getattr(obj, part)
        return obj.value if isinstance(obj, enum.Enum) else obj
    restated = []
    for f in sorted((ROOT / "configs").rglob("*.yaml")):
        text = f.read_text()
        tree = yaml.safe_load(text) or {}
        tree.pop("defaults", None)
        tree.pop("hydra", None)
        group = f.parent.name
        prefix = "" if "@package _global_" in text or group == "configs" else f"{group if group != 'logger' else 'logger'}."
        for key, value in _leaves(tree, prefix).items():
            d = default(key)
            if d is not KeyError and d == value and key != "task.name":     # a task's file names its task
                restated.append(f"{f.relative_to(ROOT)}: {key}: {value!r} is the default")
    assert not restated, "\n".join(restated)


def test_riptide_train_at_its_defaults_is_the_attach_apis_job():
    """riptide-train with no overrides composes JobConfig's defaults, except what the default task
    (copy) and model (tiny) set for themselves."""
    import dataclasses

    from trainer_bridge.config import JobConfig
    from trainer_bridge.train import compose_job
    composed = compose_job([])
    default = dataclasses.replace(JobConfig(), model=composed.model, task=composed.task, run_dir=composed.run_dir)
    default.validate()                      # resolves what is auto (the learning rate) as the job does
    for section in ("weight_sync", "cluster", "trainer", "logger"):
        assert getattr(composed, section) == getattr(default, section), section
    task_sets = {"use_chat_template", "max_new_tokens"}
    for name in {f for f in vars(default.rollout)} - task_sets:
        assert getattr(composed.rollout, name) == getattr(default.rollout, name), f"rollout.{name}"
    derived = {"context_length", "kv_cache_gb"}      # the task's context, and the KV budget sized from it
    assert {k: v for k, v in vars(composed.server).items() if k not in derived} == \
        {k: v for k, v in vars(default.server).items() if k not in derived}
    assert (composed.mode, composed.seed) == (default.mode, default.seed)


def test_a_jobs_rollout_side_is_its_own_sections():
    """JobConfig.backend(): each BackendConfig field from the job's (or its trainer's) field of that
    name, so a field added to one is not silently left at its default in the other."""
    import dataclasses

    from trainer_bridge.config import BackendConfig, JobConfig
    job = JobConfig()
    job.rollout.group_size, job.trainer.overlong_buffer, job.seed = 3, 7, 11
    job.model.path = "/some/model"
    b = job.backend("logs")
    assert (b.rollout, b.server, b.weight_sync, b.cluster, b.task) == \
        (job.rollout, job.server, job.weight_sync, job.cluster, job.task)
    assert (b.overlong_buffer, b.seed, b.model_path, b.log_dir) == (7, 11, "/some/model", "logs")
    unmatched = [f.name for f in dataclasses.fields(BackendConfig)
                 if not hasattr(job, f.name) and not hasattr(job.trainer, f.name)]
    assert sorted(unmatched) == ["log_dir", "model_path"]


def test_a_setting_with_fixed_values_is_an_enum_checked_before_start():
    """The attach API may pass the value as a string; it becomes the member, equal and printed as the
    value. A value outside the set is named with the ones allowed."""
    from trainer_bridge.config import ClusterConfig, ConfigError, ServerConfig, TrainerConfig
    server, cluster, trainer = ServerConfig(kv_layout="paged", engine="riptide", context_length=64), \
        ClusterConfig(kind="ray"), \
        TrainerConfig(off_policy="icepop")
    for section in (server, cluster, trainer):
        section.validate()
    assert (server.kv_layout.name, cluster.kind.name, trainer.off_policy.name) == ("paged", "ray", "icepop")
    assert f"{server.kv_layout} {cluster.kind}" == "paged ray" and cluster.kind == "ray"
    with pytest.raises(ConfigError) as e:
        ServerConfig(kv_layout="pagd", engine="sglang", context_length=64).validate()
    assert "server.kv_layout='pagd': use auto | paged | contiguous" in str(e.value)
    assert "server.engine='sglang': use riptide | vllm" in str(e.value)
