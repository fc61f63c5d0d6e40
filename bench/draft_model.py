"""Writes a draft model for speculative decoding: some of the target's layers (its first ones, or
the ones named) with its embeddings, final norm and lm_head, untrained, as an HF checkpoint
folder of the same tokenizer (Llama-style weight names: model.layers.<i>.*).

    python -m bench.draft_model --num-layers 2 --out /tmp/smollm2-draft2
    python -m bench.draft_model --layers 0 29 --out /tmp/smollm2-first-last
    python -m bench.spec_decode --speculative-config \
        '{"method": "draft_model", "model": "/tmp/smollm2-draft2", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from bench.common import DEFAULT_MODEL

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncate(src: Path, dst: Path, num_layers: int = 0, layers: list[int] | None = None) -> Path:
    """layers: the target's layers kept, in order (default: the first num_layers)."""
    config = json.loads((src / "config.json").read_text())
    layers = layers or list(range(num_layers))
    if not layers or not all(0 <= i < config["num_hidden_layers"] for i in layers):
        raise SystemExit(f"layers must lie in [0, {config['num_hidden_layers']}), got {layers}")
    renumbered = {old: new for new, old in enumerate(layers)}
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, dst / path.name)
    weights = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            match = _LAYER.match(name)
            if match is None:
                weights[name] = tensor.contiguous()
            elif int(match.group(1)) in renumbered:
                new = f"model.layers.{renumbered[int(match.group(1))]}.{name[match.end():]}"
                weights[new] = tensor.contiguous()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = len(layers)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target's checkpoint folder")
    parser.add_argument("--num-layers", type=int, default=2, help="keep the first ones")
    parser.add_argument("--layers", type=int, nargs="+", help="keep these instead")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print(truncate(Path(args.model), Path(args.out), args.num_layers, args.layers))


if __name__ == "__main__":
    main()
