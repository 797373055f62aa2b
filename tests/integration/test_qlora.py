"""`aidaptiv-ds train --lora ...,bits=4` (QLoRA): the base's linear layers quantised to bitsandbytes nf4, then
partitioned and streamed read-only by our swapper; only the adapters train.

Runs on this CPU (bitsandbytes' CPU backend). The loss trajectory equals the same QLoRA model on plain ZeRO-3
in memory (fp32, 1e-5 relative); the export writes the adapter only, which PEFT loads on the quantised base
to give the trained logits; merging into a 4-bit base is refused with the reason."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import (
    adapter_config,
    assert_same_losses,
    child_env,
    read_metrics,
    run_train,
)

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

ARGS = [
    "--model",
    "micro",
    "--seq-len",
    "64",
    "--steps",
    "3",
    "--warmup",
    "1",
    "--no-progress",
    "--lora",
    "r=8,alpha=16,targets=q_proj,v_proj,bits=4",
]


def test_qlora_on_swapped_base_matches_zero3_and_exports_the_adapter(tmp_path):
    from peft import PeftModel

    from aidaptiv_ds.job import lora
    from aidaptiv_ds.models import presets as models

    ours, ref = tmp_path / "ours", tmp_path / "ref"
    ours.mkdir(), ref.mkdir()
    rc, log = run_train(
        [
            "--config",
            adapter_config(ours, "aidaptiv.json"),
            *ARGS,
            "--metrics-out",
            str(ours / "m.json"),
            "--save-dir",
            str(ours / "ck"),
            "--output-dir",
            str(ours / "out"),
            "--logits-out",
            str(ours / "logits.pt"),
        ],
        cwd=ours,
    )
    assert rc == 0, log[-3000:]
    rc, log = run_train(
        ["--config", adapter_config(ref, "zero3.json"), *ARGS, "--metrics-out", str(ref / "m.json")], cwd=ref
    )
    assert rc == 0, log[-3000:]
    m, r = read_metrics(ours / "m.json"), read_metrics(ref / "m.json")
    assert m["qlora_layers"] == r["qlora_layers"] == 2 * 7  # micro: 2 layers x q,k,v,o,gate,up,down
    assert m["lora"]["trainable_params"] == 2 * 2 * 2 * 8 * 256
    assert_same_losses(m["losses"], r["losses"], rel=1e-5)
    assert m["losses"][-1] < m["losses"][0]
    per_step = m["nvme_write_bytes"] / m["nvme_bytes_steps"]
    assert per_step <= 2 * 12 * m["lora"]["trainable_params"], per_step  # no byte of the base written back

    # --output-dir of a QLoRA run: the adapter alone (the 4-bit base is no HF weights file)
    out = ours / "out"
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out / "adapter"))
    # PEFT's adapter on the same quantised base (preset weights come from the seed) gives the trained logits
    trained = torch.load(ours / "logits.pt")
    torch.manual_seed(1234)
    base = models.build_model(models.resolve("micro"), torch.float32)
    lora.quantize_base(base, torch.float32)
    with torch.no_grad():
        plain = base.eval()(input_ids=trained["input_ids"]).logits
        got = PeftModel.from_pretrained(base, str(out / "adapter")).eval()(input_ids=trained["input_ids"]).logits
    assert (plain - trained["logits"]).abs().max().item() > 1e-3  # the adapters changed the model
    assert (got - trained["logits"]).abs().max().item() <= 1e-4

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "aidaptiv_ds",
            "export",
            str(ours / "ck"),
            "--out",
            str(tmp_path / "merged"),
            "--merge-lora",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
    )
    assert p.returncode != 0 and "QLoRA" in p.stderr and "drop --merge-lora" in p.stderr, p.stderr
