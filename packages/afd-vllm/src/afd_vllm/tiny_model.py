"""``afd-vllm tiny-model DIR``: a 3-layer DeepSeek checkpoint with random weights and a
word-level tokenizer (``t0 .. t511``), small enough to run both roles on a laptop CPU.

``--preset tiny`` is DeepSeek-V2 routing (MLA 512+64, the shape vLLM's CPU MLA kernel
accepts; 8 experts top-2, one shared expert, YaRN); ``--preset v3-mini`` is DeepSeek-V3
routing (sigmoid scores, noaux_tc with a correction bias over 4 groups, routed scale 2.5,
q LoRA). The tokenizer needs ``tokenizers`` and ``transformers``, which vLLM installs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PRESETS = ("tiny", "v3-mini")


def write_tiny_model(directory: Path, preset_name: str = "tiny", seed: int = 7) -> Path:
    """Write the checkpoint (``config.json``, safetensors) and the tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from afd_models import RandomWeights, preset
    from afd_models.weights import materialize, save_checkpoint

    config = preset(preset_name)
    save_checkpoint(directory, config, materialize(config, RandomWeights(seed)))
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="t2", bos_token="t0", eos_token="t1"
    )
    fast.save_pretrained(directory)
    return directory


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``tiny-model`` subcommand of ``afd-vllm``."""
    tiny = sub.add_parser(
        "tiny-model",
        help="write a tiny random DeepSeek checkpoint and tokenizer to try the plugin",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tiny.add_argument("directory", type=Path, help="where to write it (created)")
    tiny.add_argument("--preset", choices=PRESETS, default="tiny", help="routing flavour")
    tiny.add_argument("--seed", type=int, default=7, help="weights' random seed")
    tiny.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        write_tiny_model(args.directory, args.preset, args.seed)
    except ImportError as exc:
        print(
            f"afd-vllm tiny-model: error: {exc}; the tokenizer needs `tokenizers` and "
            f"`transformers` (vLLM installs both)",
            file=sys.stderr,
        )
        return 2
    except OSError as exc:
        print(f"afd-vllm tiny-model: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"afd-vllm tiny-model: wrote a {args.preset} checkpoint and tokenizer to {args.directory}"
    )
    return 0
