"""The studio's run path with a mixture-of-experts model, without a browser (the browser walk is
tests/real/test_studio_real.py's): the plan counts its active parameters, a LoRA run of the micro-moe preset
trains to its end under the studio's supervisor, its export is an MoE folder (adapters merged, the base beside
it), and Compare asks both through `aidaptiv-ds generate`, which reads only the experts each token uses."""

from __future__ import annotations

import json
import time

from aidaptiv_ds.studio.compare import side_by_side
from aidaptiv_ds.studio.runs import ACTIVE, Runs, RunSettings, run_plan
from aidaptiv_ds.studio.workspace import Workspace


def test_an_moe_model_plans_trains_exports_and_compares_in_the_studio(tmp_path):
    ws = Workspace(tmp_path / "root")
    data = ws.data / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"Expert {i} answers question {i} about routing."}) + "\n" for i in range(32))
    )
    s = RunSettings(
        name="moe", model="micro-moe", data=str(data), steps=2, save_every=2, seq_len=32, nvme_path=str(ws.swap)
    )
    planned = tmp_path / "plan"
    plan = run_plan(s, planned)
    assert plan["active_parameters"] < plan["parameters"] and plan["experts"]["per_token"] == 2, plan["experts"]
    runs = Runs(ws)
    runs.create(s, planned)
    runs.launch("moe")
    deadline = time.monotonic() + 600
    while (st := runs.status("moe"))["state"] in ACTIVE:
        assert time.monotonic() < deadline, runs.log_tail("moe")
        time.sleep(1)
    assert st["state"] == "finished", (st, runs.log_tail("moe"))
    metrics = runs.metrics("moe")
    assert metrics["status"] == "ok" and len(metrics["losses"]) == 2, metrics
    written = runs.export("moe")
    model, base = (runs.folder("moe") / name for name in ("model", "base"))
    assert sorted(written) == ["runs/moe/base", "runs/moe/model"], written  # under the studio's root
    for folder in (model, base):
        assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_moe"
    *_, last = side_by_side(str(base), str(model), "Expert 3 answers", max_new_tokens=6, nvme_path=str(ws.swap))
    text_a, text_b, figures_a, figures_b = last
    assert text_a.strip() and text_b.strip(), (figures_a, figures_b)
    assert "tokens/s" in figures_a and "tokens/s" in figures_b, (figures_a, figures_b)
