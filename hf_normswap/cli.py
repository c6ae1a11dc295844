"""The `hf-normswap` command line: convert, export-native, generate, heal, compare, push."""

import argparse
import dataclasses
import sys
from pathlib import Path

import datasets
import yaml
from huggingface_hub.errors import StrictDataclassError
from transformers.utils import logging as transformers_logging

from .configuration_normswap import NORM_PLACEMENTS, NORM_TYPES, POSITION_EMBEDDING_TYPES
from .convert import DTYPES
from .families import FAMILIES
from .heads import HEAD_CLASSES
from .norm_mapping import NORM_MAPPINGS


def _placement(value: str) -> str | list[str]:
    """One placement, or a comma-separated list with one per layer."""
    return value.split(",") if "," in value else value


def _add_convert(commands) -> None:
    parser = commands.add_parser("convert", help="put a supported pretrained or NormSwap checkpoint on NormSwap")
    parser.add_argument("source", help="local folder or Hub id")
    parser.add_argument("output", help="folder to write")
    parser.add_argument("--norm-placement", type=_placement, help=f"one of {', '.join(NORM_PLACEMENTS)} (or one per layer, comma-separated); default: the source's")
    parser.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, help="default: the source's")
    parser.add_argument("--norm-type", choices=NORM_TYPES, help="default: the source's")
    parser.add_argument("--norm-mapping", choices=NORM_MAPPINGS, default="shift")
    parser.add_argument(
        "--calibrate", action=argparse.BooleanOptionalAction, default=True,
        help="scale sublayer writes, and refit output projections against the source, where norms that wrote the residual stream come to read it (post -> pre, sandwich)",
    )
    parser.add_argument("--attention", choices=("bidirectional", "causal"), help="default: bidirectional (a NormSwap source: its own)")
    parser.add_argument("--head", choices=("auto", *HEAD_CLASSES), default="auto")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--no-verify", action="store_true", help="skip the exactness check and the swap measurement")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")
    parser.add_argument("--allow-pickle", action="store_true", help="accept pytorch_model.bin (loaded with weights_only=True)")
    parser.add_argument("--family", choices=[family.name for family in FAMILIES], help="refuse sources of any other family")


def _run_convert(args) -> None:
    from .convert import convert_checkpoint

    convert_checkpoint(
        args.source,
        args.output,
        norm_placement=args.norm_placement,
        position_embedding_type=args.position_embedding_type,
        norm_type=args.norm_type,
        norm_mapping=args.norm_mapping,
        calibrate=args.calibrate,
        attention=args.attention,
        head=args.head,
        dtype=args.dtype,
        verify=not args.no_verify,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle,
        family=args.family,
    )


def _add_export(commands) -> None:
    parser = commands.add_parser("export-native", help="write a NormSwap checkpoint as its native Transformers classes")
    parser.add_argument("source", help="NormSwap checkpoint folder or Hub id")
    parser.add_argument("output", help="folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")


def _run_export(args) -> None:
    from .export import export_native

    export_native(args.source, args.output, overwrite=args.overwrite)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _add_generate(commands) -> None:
    parser = commands.add_parser("generate", help="continue prompts with a causal NormSwap model (text-generation pipeline)")
    parser.add_argument("folder", help="NormSwap causal-LM checkpoint folder or Hub id")
    parser.add_argument("--prompt", required=True, action="append", help="the text to continue; repeat for more")
    parser.add_argument("--max-new-tokens", type=_positive, default=32)
    parser.add_argument("--sample", action="store_true", help="sample (with --seed) instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0)


def _run_generate(args) -> None:
    from transformers import AutoConfig, pipeline, set_seed

    from .heads import head_of_config

    config = AutoConfig.from_pretrained(args.folder)
    if config.model_type != "normswap" or not config.is_causal or head_of_config(config) != "causal-lm":
        raise ValueError(
            f"{args.folder}: not a NormSwap causal LM (is_causal=True, NormSwapForCausalLM); convert with "
            "--attention causal --head causal-lm"
        )
    set_seed(args.seed)
    generator = pipeline("text-generation", model=args.folder)
    for outputs in generator(args.prompt, max_new_tokens=args.max_new_tokens, do_sample=args.sample):
        print(outputs[0]["generated_text"])


def _add_heal(commands) -> None:
    from .heal import DEFAULTS, EVAL_SIZE, OBJECTIVES

    parser = commands.add_parser(
        "heal",
        help="train a swapped variant to compute what its unswapped source computes",
        description="Distils the source (the teacher) into the converted VARIANT on unlabeled text, through the Trainer, "
        "and writes the healed checkpoint with heal.json (before/after figures per layer) and heal.png.",
    )
    parser.add_argument("variant", help="a NormSwap checkpoint folder written by convert")
    parser.add_argument("output", help="folder to write")
    parser.add_argument("--teacher", help="folder or Hub id of a BERT-, LLaMA-family or NormSwap checkpoint (default: the source named in VARIANT's conversion.json)")
    parser.add_argument("--data", default=DEFAULTS["data"], help="sst2-sample (default), a GLUE task name, a .txt / .csv / .jsonl file, or a datasets hub id")
    parser.add_argument("--text-column", help="the text column of a CSV / JSON-lines file or hub dataset (default: text)")
    parser.add_argument("--data-dir", help="folder holding GLUE TASK/train.jsonl and TASK/validation.jsonl")
    parser.add_argument("--objective", choices=OBJECTIVES, default=DEFAULTS["objective"])
    parser.add_argument("--max-steps", type=int, default=DEFAULTS["max_steps"])
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS["learning_rate"])
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"])
    parser.add_argument("--max-length", type=int, default=DEFAULTS["max_length"])
    parser.add_argument("--eval-size", type=int, default=EVAL_SIZE, help="held-out texts measured before, during and after")
    parser.add_argument("--checkpoint-dir", help="keep resumable Trainer checkpoints here; a rerun continues from the last")
    parser.add_argument("--packing", action=argparse.BooleanOptionalAction, default=DEFAULTS["packing"],
                        help="run student and teacher on padding-free batches (default: on)")
    parser.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=DEFAULTS["dropout"],
                        help="train the student with its configured dropout (default: off; the saved config keeps it)")
    parser.add_argument("--freeze-embeddings", action=argparse.BooleanOptionalAction, default=DEFAULTS["freeze_embeddings"],
                        help="keep the student's embeddings as converted (default: on)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")


def _run_heal(args) -> None:
    from .experiment import HEAL_SETTINGS
    from .heal import heal_checkpoint

    options = {name: getattr(args, name) for name in (*HEAL_SETTINGS, "teacher", "checkpoint_dir", "overwrite")}
    heal_checkpoint(args.variant, args.output, **options)


def _add_compare(commands) -> None:
    from .experiment import Experiment

    parser = commands.add_parser(
        "compare",
        help="fine-tune variants through the Trainer and report",
        description="Without --model or --config, the embedded default experiment (hf_normswap/data/default_experiment.yaml: "
        "all-MiniLM-L6-v2 as post, pre, pre+heal and sandwich+heal on the shipped SST-2 sample) is the base that options "
        "override.",
    )
    parser.add_argument(
        "--config",
        help="a YAML or JSON experiment file, or the name of one shipped with the package (stability); "
        "options given here take precedence",
    )
    for field in dataclasses.fields(Experiment):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        option = f"--{field.name.replace('_', '-')}"
        if field.type is bool:
            parser.add_argument(option, dest=field.name, action=argparse.BooleanOptionalAction, help=f"default: {default}")
        else:
            parser.add_argument(option, dest=field.name, type=_option_type(field), help=f"default: {default}")


def _option_type(field):
    """How to read a command-line value for an `Experiment` field (lists are comma-separated; numbers in a list
    are read, and checked, with the experiment)."""
    if "list" in str(field.type):
        return lambda text: text.split(",")
    if "dict" in str(field.type):  # a YAML / JSON mapping, e.g. --heal "{max_steps: 100}"
        return yaml.safe_load
    for kind in (int, float):
        if field.type is kind or kind in getattr(field.type, "__args__", ()):
            return kind
    return str


def _run_compare(args) -> None:
    from .compare import run_comparison
    from .experiment import DEFAULT_EXPERIMENT, Experiment

    options = {field.name: getattr(args, field.name) for field in dataclasses.fields(Experiment)}
    base = args.config or (DEFAULT_EXPERIMENT if args.model is None else None)
    if base:
        experiment = Experiment.from_file(base, **options)
    else:
        experiment = Experiment(**{name: value for name, value in options.items() if value is not None})
    document = run_comparison(experiment)
    if document is not None:
        print(f"report: {Path(experiment.output) / 'report.md'}")


def _add_push(commands) -> None:
    parser = commands.add_parser("push", help="upload a NormSwap variant to the Hub with its model card")
    parser.add_argument("folder", help="NormSwap checkpoint folder")
    parser.add_argument("--repo-id", required=True, help="user/name on the Hub")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision", help="branch to push to (created if missing)")
    parser.add_argument("--commit-message")
    parser.add_argument("--dry-run", metavar="DIR", help="write the exact folder that would be uploaded, upload nothing")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --dry-run folder")
    parser.add_argument("--base-model", help="Hub id of the source (default: from conversion.json)")
    parser.add_argument("--license", help="default: the source's model card")
    parser.add_argument("--datasets", type=lambda text: text.split(","), help="comma-separated dataset ids")


def _run_push(args) -> None:
    from .push import push

    push(
        args.folder,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        dry_run=args.dry_run,
        overwrite=args.overwrite,
        base_model=args.base_model,
        license=args.license,
        datasets=args.datasets,
    )


COMMANDS = {
    "convert": (_add_convert, _run_convert),
    "export-native": (_add_export, _run_export),
    "generate": (_add_generate, _run_generate),
    "heal": (_add_heal, _run_heal),
    "compare": (_add_compare, _run_compare),
    "push": (_add_push, _run_push),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="hf-normswap", description="Swap the layer-norm arrangement of pretrained weights.")
    commands = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(commands)
    args = parser.parse_args(argv)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # the Trainer's own progress bars stay
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    try:
        COMMANDS[args.command][1](args)
    except (ValueError, OSError, StrictDataclassError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"hf-normswap {args.command}: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
