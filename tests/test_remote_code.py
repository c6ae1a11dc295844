"""A saved NormSwap folder loads through every Auto class where hf_normswap cannot be imported."""

import json
import os
import subprocess
import sys

import torch

from hf_normswap import NormSwapForMaskedLM

from helpers import padded_batch, tiny_config


LOADER = r"""
import json, sys
import torch

class BlockHfNormswap:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "hf_normswap":
            raise ImportError("hf_normswap is blocked in this process")

sys.meta_path.insert(0, BlockHfNormswap())
import transformers

folder, batch_file = sys.argv[1], sys.argv[2]
batch = torch.load(batch_file, weights_only=True)
results = {}
for name in ["AutoModel", "AutoModelForMaskedLM", "AutoModelForSequenceClassification",
             "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"]:
    model = getattr(transformers, name).from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        output = model(**batch)
    results[name] = [type(model).__module__, type(model).__name__, output[0].tolist()]
assert not any(module.split(".")[0] == "hf_normswap" for module in sys.modules)
print(json.dumps(results))
"""


def test_remote_code_loads_without_the_package(tmp_path):
    config = tiny_config(norm_placement="sandwich", position_embedding_type="alibi", norm_type="rmsnorm")
    model = NormSwapForMaskedLM(config).eval()
    model.save_pretrained(tmp_path / "model")
    input_ids, attention_mask = padded_batch()
    torch.save({"input_ids": input_ids, "attention_mask": attention_mask}, tmp_path / "batch.pt")

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    process = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "model"), str(tmp_path / "batch.pt")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    results = json.loads(process.stdout.strip().splitlines()[-1])

    module, class_name, logits = results["AutoModelForMaskedLM"]
    assert module.startswith("transformers_modules.") and class_name == "NormSwapForMaskedLM"
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
    assert (torch.tensor(logits) - expected).abs().max().item() <= 1e-6
    with torch.no_grad():
        hidden = model.model(input_ids, attention_mask=attention_mask).last_hidden_state
    assert (torch.tensor(results["AutoModel"][2]) - hidden).abs().max().item() <= 1e-6
    assert results["AutoModelForSequenceClassification"][1] == "NormSwapForSequenceClassification"
    assert results["AutoModelForTokenClassification"][1] == "NormSwapForTokenClassification"
    assert results["AutoModelForQuestionAnswering"][1] == "NormSwapForQuestionAnswering"
