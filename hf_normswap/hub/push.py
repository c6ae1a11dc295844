"""Share a NormSwap variant on the Hub: the folder to upload and the upload."""

import json
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

from ..checkpoint import companion_files, output_folder, weight_files
from ..convert.converter import ConversionRecord
from ..heal.report import HEAL_PLOT, HealReport
from ..model import REMOTE_CODE_FILES
from ..model.configuration_normswap import NormSwapConfig
from ..model.heads import NATIVE_AUTO_CLASSES
from .card import build_card


def prepare_upload(folder: str | Path, repo_id: str, destination: Path, **card_options) -> list[str]:
    """Writes into `destination` exactly what is uploaded: weights, config, code (of a NormSwap checkpoint; one that
    `export-native` wrote needs none), tokenizer, sentence-transformers modules, records, card."""
    folder = Path(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise ValueError(f"invalid repo id {repo_id!r}: {str(error).splitlines()[0]}") from None
    if not (folder / "config.json").exists():
        raise ValueError(f"{folder}: not a NormSwap checkpoint (no config.json)")
    config = json.loads((folder / "config.json").read_text())
    exported = config.get("model_type") != NormSwapConfig.model_type
    if exported and not (folder / ConversionRecord.FILE).exists():
        raise ValueError(
            f"{folder}: neither a NormSwap checkpoint nor one `export-native` wrote (model_type "
            f"{config.get('model_type')!r}, no {ConversionRecord.FILE})"
        )
    code = [] if exported else REMOTE_CODE_FILES  # an export is Transformers' own class
    missing = [name for name in code if not (folder / name).exists()]
    auto_map = {"AutoConfig", *(auto_class.__name__ for auto_class in NATIVE_AUTO_CLASSES.values())}
    if missing or (code and set(config.get("auto_map", {})) != auto_map):
        raise ValueError(
            f"{folder}: the remote code is incomplete (missing {missing or 'auto_map entries'}); "
            "save it with save_pretrained"
        )
    card, plots = build_card(folder, repo_id, **card_options)
    files = [path.name for path in weight_files(folder)]
    files += ["config.json", *code]
    extras = (SAFE_WEIGHTS_INDEX_NAME, ConversionRecord.FILE, HealReport.FILE, HEAL_PLOT, "generation_config.json")
    files += [name for name in extras if (folder / name).exists()]
    files += companion_files(folder)  # tokenizer, sentence-transformers modules (some in module folders)
    for name in files:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / name, destination / name)
    for plot in plots:
        shutil.copy(folder.parent.parent / plot, destination / plot)
    card.save(destination / "README.md")
    return sorted([*files, *plots, "README.md"])


def push(
    folder: str,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: str | None = None,
    overwrite: bool = False,
    log=print,
    **card_options,
) -> str:
    """Uploads the variant in `folder` to `repo_id` (or, with `dry_run`, writes the folder it would upload there)."""
    if dry_run:
        with output_folder(dry_run, overwrite) as staging:
            files = prepare_upload(folder, repo_id, staging, **card_options)
        log(f"dry run: wrote the {len(files)} files that would be uploaded to {repo_id} into {dry_run}")
        return dry_run
    with tempfile.TemporaryDirectory() as staging:
        prepare_upload(folder, repo_id, Path(staging), **card_options)
        api = HfApi()
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=staging,
            revision=revision,
            commit_message=commit_message or f"Upload NormSwap variant from {Path(folder).name}",
        )
    log(f"pushed {folder} to {url} ({commit.oid})")
    return commit.commit_url
