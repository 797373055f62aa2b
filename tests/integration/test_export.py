"""`aidaptiv-ds train --output-dir`: the fine-tuned model comes out as a Hugging Face folder that
transformers loads and that gives the trained model's logits (fp32, to 1e-6 plus 1.3e-6 relative), and
`aidaptiv-ds export` makes the same folder from a saved checkpoint."""

import json
import os
import subprocess
import sys

import torch
from helpers import CONFIGS, child_env, read_metrics, run_train


def _config(tmp_path, **top):
    with open(os.path.join(CONFIGS, "aidaptiv.json")) as f:
        cfg = json.load(f)
    (tmp_path / "swap").mkdir()
    cfg["aidaptiv"].update(nvme_path=str(tmp_path / "swap"), host_memory_budget="64MiB")
    cfg["optimizer"]["params"]["lr"] = 1e-3  # weights that move visibly in two steps
    cfg.update(top)
    path = tmp_path / "aidaptiv.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_output_dir_loads_with_transformers_and_gives_the_trained_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    out, ck = tmp_path / "model", tmp_path / "ck"
    rc, log = run_train(
        [
            "--config",
            _config(tmp_path),
            "--model",
            "micro",
            "--seq-len",
            "64",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--no-progress",
            "--save-dir",
            str(ck),
            "--output-dir",
            str(out),
            "--logits-out",
            str(tmp_path / "logits.pt"),
            "--metrics-out",
            str(tmp_path / "m.json"),
        ],
        cwd=tmp_path,
    )
    assert rc == 0, log[-3000:]
    assert {"model.safetensors", "config.json"} <= set(os.listdir(out)), os.listdir(out)
    assert not (out / "checkpoint").exists()  # --save-dir holds the checkpoint it was made from
    assert read_metrics(tmp_path / "m.json")["output_dir"] == str(out)
    from transformers import AutoTokenizer

    # BOS and the bytes: a prompt for generate() does not end the sequence (training records add their EOS)
    assert AutoTokenizer.from_pretrained(str(out))("hi")["input_ids"] == [256, ord("h"), ord("i")]
    trained = torch.load(tmp_path / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=trained["input_ids"]).logits
    # the same weights; fp32 matmuls of two code paths may differ in the last bit (1e-6 absolute failed on a
    # Xeon VM at logits near 10: 1.19e-6, one ulp)
    torch.testing.assert_close(logits, trained["logits"], rtol=1.3e-6, atol=1e-6)
    assert not torch.equal(model.lm_head.weight, _initial_model().lm_head.weight)  # trained weights, not seed's

    # The same checkpoint through the command, in shards.
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "aidaptiv_ds",
            "export",
            str(ck),
            "--out",
            str(tmp_path / "again"),
            "--max-shard-size",
            "4MiB",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    files = os.listdir(tmp_path / "again")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) >= 3
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=trained["input_ids"]).logits, logits)


def _initial_model():
    from aidaptiv_ds.models import presets as models

    torch.manual_seed(1234)
    return models.build_model(models.resolve("micro"), torch.float32)


def test_two_ranks_without_save_dir_export_through_a_removed_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "model"
    rc, log = run_train(
        [
            "--config",
            _config(tmp_path),
            "--model",
            "micro",
            "--seq-len",
            "64",
            "--steps",
            "2",
            "--warmup",
            "0",
            "--no-progress",
            "--output-dir",
            str(out),
            "--logits-out",
            str(tmp_path / "logits.pt"),
        ],
        cwd=tmp_path,
        launcher_procs=2,
    )
    assert rc == 0, log[-3000:]
    assert not (out / "checkpoint").exists() and "model.safetensors" in os.listdir(out)
    trained = torch.load(tmp_path / "logits.pt")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=trained["input_ids"]).logits
    # the same weights; fp32 matmuls of two code paths may differ in the last bit (1e-6 absolute failed on a
    # Xeon VM at logits near 10: 1.19e-6, one ulp)
    torch.testing.assert_close(logits, trained["logits"], rtol=1.3e-6, atol=1e-6)


def test_output_dir_is_refused_before_training_without_the_swapper(tmp_path):
    rc, log = run_train(
        [
            "--config",
            os.path.join(CONFIGS, "zero3.json"),
            "--model",
            "micro",
            "--steps",
            "1",
            "--no-progress",
            "--output-dir",
            str(tmp_path / "model"),
            "--metrics-out",
            str(tmp_path / "m.json"),
        ],
        cwd=tmp_path,
    )
    assert rc == 1 and '--output-dir needs a config with an enabled "aidaptiv" block' in log, log[-2000:]
    # The console has the one line; the metrics also say where it was raised (for runs one cannot reach again).
    m = read_metrics(tmp_path / "m.json")
    assert m["status"] == "error" and "Traceback" not in log
    assert "train.py" in m["traceback"] and m["traceback"].rstrip().endswith(m["error"]), m["traceback"]


def test_output_dir_with_weights_is_refused_before_training(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"x")
    rc, log = run_train(
        [
            "--config",
            _config(tmp_path),
            "--model",
            "micro",
            "--steps",
            "1",
            "--no-progress",
            "--output-dir",
            str(tmp_path / "model"),
        ],
        cwd=tmp_path,
    )
    assert rc == 1 and "--output-dir: output folder" in log and "already holds model weights" in log, log[-2000:]
