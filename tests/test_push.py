import base64
import json

import httpx2
import huggingface_hub
import pytest
import yaml
from huggingface_hub import ModelCard

from hf_normswap import NormSwapForSequenceClassification, convert_checkpoint
from hf_normswap.cli import main as cli
from hf_normswap.compare import Experiment, run_comparison
from hf_normswap.hub.card import build_card
from hf_normswap.model import REMOTE_CODE_FILES

from helpers import save_source, tiny_config, tiny_task


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """A finished tiny comparison: OUTPUT/variants/{post,pre} plus results.json and plots."""
    root = tmp_path_factory.mktemp("push")
    save_source(root / "bert", "bert", "Model")
    (root / "bert" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny bert\n")
    glue = root / "glue" / "sst2"  # a local stand-in for GLUE SST-2, so that the card gets a model-index
    glue.mkdir(parents=True)
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in (tiny_task(root / "task") / f"{split}.jsonl").read_text().splitlines()]
        (glue / f"{split}.jsonl").write_text(
            "".join(
                json.dumps({"sentence": row["text"], "label": row["label"], "idx": i}) + "\n"
                for i, row in enumerate(rows)
            )
        )
    run_comparison(
        Experiment(
            model=str(root / "bert"),
            task="sst2",
            data_dir=str(root / "glue"),
            variants=["post", "pre"],
            seeds=2,
            epochs=1,
            batch_size=16,
            logging_steps=1,
            output=str(root / "comparison"),
        )
    )
    return root / "comparison"


def test_dry_run_writes_the_upload_and_card(comparison, tmp_path):
    variant = comparison / "variants" / "pre"
    assert (
        cli(
            [
                "push",
                str(variant),
                "--repo-id",
                "someone/tiny-bert-pre",
                "--dry-run",
                str(tmp_path / "up"),
                "--base-model",
                "someone/tiny-bert",
                "--datasets",
                "nyu-mll/glue",
            ]
        )
        == 0
    )
    files = sorted(path.name for path in (tmp_path / "up").iterdir())
    assert files == sorted(
        [
            "README.md",
            "config.json",
            *REMOTE_CODE_FILES,
            "model.safetensors",
            "conversion.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.txt",
            "loss.png",
            "eval_metric.png",
            "grad_norm_init.png",
            "residual_rms.png",
        ]
    )
    card = ModelCard.load(tmp_path / "up" / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["base_model"] == "someone/tiny-bert"
    assert data["license"] == "apache-2.0"  # from the source's card, through conversion.json
    assert data["tags"] == ["normswap", "norm-placement-pre", "position-absolute"]
    assert data["pipeline_tag"] == "text-classification" and data["datasets"] == ["nyu-mll/glue"]
    results = json.loads((comparison / "results.json").read_text())
    index = data["model-index"][0]["results"][0]
    assert index["metrics"][0]["type"] == "accuracy"
    assert index["metrics"][0]["value"] == round(results["summary"]["pre"]["metrics"]["accuracy"]["mean"], 4)
    assert "trust_remote_code=True" in card.text and 'revision="<commit sha>"' in card.text
    assert "| pre |" in card.text and "![loss.png](loss.png)" in card.text
    assert "| norm placement | post | pre |" in card.text
    scales = json.loads((variant / "conversion.json").read_text())["calibration"]["write_scales"].values()
    assert (
        f"| sublayer writes | | calibrated: scaled by {min(scales):.3g} to {max(scales):.3g}, "
        "4 refitted against the source (ridge 1), fitted on" in card.text
    )
    config = json.loads((tmp_path / "up" / "config.json").read_text())
    assert len(config["auto_map"]) == 7


def test_card_without_comparison(tmp_path):
    save_source(tmp_path / "bert", "bert", "ForMaskedLM")
    convert_checkpoint(
        str(tmp_path / "bert"), str(tmp_path / "variant"), norm_placement="sandwich", log=lambda _: None
    )
    assert (
        cli(
            [
                "push",
                str(tmp_path / "variant"),
                "--repo-id",
                "me/v",
                "--dry-run",
                str(tmp_path / "up"),
                "--base-model",
                "me/bert",
                "--license",
                "mit",
            ]
        )
        == 0
    )
    card = ModelCard.load(tmp_path / "up" / "README.md")
    assert card.data.pipeline_tag == "fill-mask" and card.data.license == "mit"
    assert "model-index" not in card.data.to_dict() and "## Comparison" not in card.text
    assert "masked lm loss" in card.text
    assert "model.layers.1.mlp_norms.output_norm.weight (calibrated)" in card.text  # sandwich branch norms
    assert "model.layers.1.mlp_norms.input_norm" not in card.text  # taken from the source, not initialised


def test_card_of_a_trainer_output_says_fine_tuned_and_claims_no_swap(tmp_path):
    """A folder without conversion.json (a Trainer's output) is described as fine-tuned, with no swap limitation."""
    NormSwapForSequenceClassification(tiny_config(norm_placement="pre", num_labels=2)).save_pretrained(
        tmp_path / "run"
    )
    card, _ = build_card(tmp_path / "run", "me/run", base_model="me/bert", license="mit")
    assert "A NormSwap model in a **pre** layer-norm arrangement (absolute positions" in card.text
    assert "fine-tuned from `me/bert`" in card.text and "pretrained weights placed" not in card.text
    assert "A swapped placement" not in card.text and "what it was converted from is not recorded" in card.text


def test_push_goes_through_the_hub_client(comparison, monkeypatch):
    """Everything runs but the HTTP calls, which a mock transport answers."""
    requests = []

    def answer(request):
        url = str(request.url)
        requests.append((request.method, url, request.content))
        if url.endswith("/api/repos/create"):
            return httpx2.Response(200, json={"url": "https://huggingface.co/someone/tiny", "name": "someone/tiny"})
        if "/preupload/" in url:
            files = json.loads(request.content)["files"]
            return httpx2.Response(
                200,
                json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
            )
        if "/commit/" in url:
            return httpx2.Response(
                200, json={"commitUrl": "https://huggingface.co/someone/tiny/commit/1234", "commitOid": "1" * 40}
            )
        if "/branch/" in url:
            return httpx2.Response(200, json={})
        if url.endswith("/api/validate-yaml"):  # the Hub checks the card's metadata
            return httpx2.Response(200, json={"errors": [], "warnings": []})
        return httpx2.Response(404, json={"error": "not part of a push"})

    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(answer)))
    try:
        assert (
            cli(
                [
                    "push",
                    str(comparison / "variants" / "post"),
                    "--repo-id",
                    "someone/tiny",
                    "--private",
                    "--revision",
                    "experiment",
                    "--commit-message",
                    "post variant",
                    "--base-model",
                    "someone/bert",
                ]
            )
            == 0
        )
    finally:
        huggingface_hub.set_client_factory(huggingface_hub.utils._http.default_client_factory)
    calls = [(method, url.split("huggingface.co")[1]) for method, url, _ in requests if "agent-harnesses" not in url]
    assert calls == [
        ("POST", "/api/repos/create"),
        ("POST", "/api/models/someone/tiny/branch/experiment"),
        ("POST", "/api/validate-yaml"),
        ("POST", "/api/models/someone/tiny/preupload/experiment"),
        ("POST", "/api/models/someone/tiny/commit/experiment"),
    ]
    create = json.loads(requests[[u for _, u, _ in requests].index("https://huggingface.co/api/repos/create")][2])
    assert (
        create["name"] == "tiny"
        and create["organization"] == "someone"
        and create.get("visibility", create.get("private")) in ("private", True)
    )
    commit = [json.loads(line) for line in requests[-1][2].decode().splitlines()]
    assert commit[0]["value"]["summary"] == "post variant"
    uploaded = {entry["value"]["path"]: entry["value"]["content"] for entry in commit[1:] if entry["key"] == "file"}
    assert {"README.md", "config.json", "modeling_normswap.py", "model.safetensors", "loss.png"} <= set(uploaded)
    card = base64.b64decode(uploaded["README.md"]).decode()
    assert yaml.safe_load(card.split("---")[1])["base_model"] == "someone/bert"


@pytest.mark.parametrize(
    "make, arguments, message",
    [
        (
            "bert",
            ["--repo-id", "me/x"],
            "neither a NormSwap checkpoint nor one `export-native` wrote (model_type 'bert', no conversion.json)",
        ),
        ("empty", ["--repo-id", "me/x"], "not a NormSwap checkpoint (no config.json)"),
        ("variant", ["--repo-id", "me/x"], "model card field 'base_model' is missing"),
        ("variant", ["--repo-id", "me/x", "--base-model", "me/b"], "model card field 'license' is missing"),
        ("variant", ["--repo-id", "not a/valid//id", "--base-model", "me/b"], "invalid repo id 'not a/valid//id'"),
    ],
)
def test_bad_input_gives_one_line_errors(tmp_path, capsys, make, arguments, message):
    folder = tmp_path / "folder"
    if make == "bert":
        save_source(folder, "bert", "Model")
    elif make == "empty":
        folder.mkdir()
    else:
        save_source(tmp_path / "bert", "bert", "Model")
        convert_checkpoint(str(tmp_path / "bert"), str(folder), log=lambda _: None)
    capsys.readouterr()
    assert cli(["push", str(folder), *arguments, "--dry-run", str(tmp_path / "up")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and message in error, error
    assert not (tmp_path / "up").exists()
