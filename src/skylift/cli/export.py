"""``skylift export RUN_DIR --to hf OUT``: a run's trained model as a Hugging Face folder."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (holds config.yaml)")
    parser.add_argument("out_dir", metavar="OUT", help="the folder to write (must not exist, or be empty)")
    parser.add_argument("--to", required=True, choices=["hf"],
                        help="the format: hf, a Hugging Face save_pretrained folder (config, safetensors, tokenizer)")
    parser.add_argument("--source", choices=["auto", "final", "checkpoint"], default="auto",
                        help="which weights: auto (default) takes RUN_DIR/model.safetensors when the run's "
                        "summary.json says it is at least as new as the newest complete checkpoint, else that "
                        "checkpoint; final or checkpoint insist on one")  # fmt: skip
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="dtype of the written weights (default fp32: the trained weights exactly)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the run's config.yaml, e.g. recipe.model_path=/models/llama where the "
                        "base model's folder (its config and tokenizer) lives on this machine")  # fmt: skip
    parser.add_argument("--merged", action="store_true",
                        help="a run that trained LoRA adapters (recipe.lora): write the base model with the adapters "
                        "merged in (PEFT's merge_and_unload), not the adapter folder")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--json", action="store_true", help="print what was written, and from which weights, as JSON")


def execute(args: argparse.Namespace) -> int:
    from skylift.checkpoint.manifest import CorruptCheckpointError
    from skylift.checkpoint.timeline import TimelineError
    from skylift.errors import EXIT_FAILURE
    from skylift.recipes.export import export_run
    from skylift.storage import StorageError

    try:
        result = export_run(Path(args.run_dir), Path(args.out_dir), source=args.source, dtype=args.dtype,
                            overrides=tuple(args.overrides), force=args.force,
                            merged=args.merged)  # fmt: skip
    except (CorruptCheckpointError, StorageError, TimelineError) as error:  # each names its cause and fix
        print(f"skylift export: {error}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    step = "unknown step" if result.step is None else f"step {result.step}"
    print(f"exported {result.source} weights ({step}; {result.reason}) as {result.dtype} to {result.out_dir}")
    if result.layout == "adapters":
        print(f"load it: PeftModel.from_pretrained(base_model, {result.out_dir!r})  (a PEFT adapter folder; "
              "--merged writes the base with the adapters merged in)")
    else:
        print(f"load it: AutoModelForCausalLM.from_pretrained({result.out_dir!r})")
    return 0
